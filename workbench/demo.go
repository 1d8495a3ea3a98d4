package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/results"
)

func newDemoCmd(a *app) *cobra.Command {
	o := runOptions{experiment: "quickstart"}
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the quickstart ablation (4 KV-cache methods x 3 budgets) and print its summary",
		Long: `demo runs experiments/quickstart.star — full, H2O, SnapKV and StreamingLLM at
budgets 0.1/0.25/0.5 on the default synthetic VLM workload — exactly as
"workbench run experiments/quickstart.star" would (the copy in the checkout,
else the one embedded in this binary), then prints compression ratio and
attention-output error per method. Results land in OUT/quickstart/<run-id>/;
notebooks/quickstart.ipynb plots them.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.check(); err != nil {
				return err
			}
			o.rerun = a.rerunCommand(cmd, nil, o.out)
			kernels, err := a.kernelsRoot()
			if err != nil {
				return err
			}
			file := filepath.Join(kernels.Dir, "experiments", "quickstart.star")
			if _, err := os.Stat(file); err != nil {
				file = "embedded:experiments/quickstart.star"
			}
			dirs, err := a.runExperiments(cmd.Context(), file, o)
			for _, dir := range dirs {
				if perr := printSummary(a, dir); perr != nil && err == nil {
					err = perr
				}
			}
			return err
		},
	}
	o.addRunFlags(cmd)
	return cmd
}

// printSummary prints one line per job of a run: method, budget, compression
// ratio and attention-output error.
func printSummary(a *app, dir string) error {
	recs, err := results.ReadJournal(dir)
	if err != nil {
		return err
	}
	sort.SliceStable(recs, func(i, j int) bool {
		if recs[i].Method != recs[j].Method {
			return recs[i].Method < recs[j].Method
		}
		return fmt.Sprint(recs[i].Params["budget"]) < fmt.Sprint(recs[j].Params["budget"])
	})
	fmt.Fprintln(a.stdout)
	tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "method\tbudget\tcompression\trel. error (mean)\trel. error (max)\tstatus\t")
	for _, r := range recs {
		budget := "-"
		if b, ok := r.Params["budget"]; ok {
			budget = fmt.Sprint(b)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t\n", r.Method, budget, metric(r, "compression_ratio", "%.2fx"),
			metric(r, "rel_err_mean", "%.4f"), metric(r, "rel_err_max", "%.4f"), r.Status)
	}
	tw.Flush()
	fmt.Fprintf(a.stdout, "\nresults: %s\n", dir)
	return nil
}

func metric(r results.Record, name, format string) string {
	if v, ok := r.Metrics[name].(float64); ok {
		return fmt.Sprintf(format, v)
	}
	return "-"
}
