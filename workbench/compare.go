package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/compare"
	"github.com/vlkv/vlkv/gohost/results"
)

func newCompareCmd(a *app) *cobra.Command {
	var (
		o        compare.Options
		asJSON   bool
		all      bool
		failIf   []string
		maxShown int
	)
	cmd := &cobra.Command{
		Use:   "compare RUN_A RUN_B",
		Short: "Join two runs on their jobs' parameters and show the metrics that changed",
		Long: `compare joins the rows of two run directories on the jobs' parameters
(method, its knobs, the workload and its knobs) and prints, per joined row,
the metrics that changed from A to B with absolute and relative deltas. A
knob that holds one value in each run and differs between them is what the
comparison is about: it is left out of the join (and named), so the rows it
changed are joined with their counterparts; so is, from that method's rows
only, a knob a method has in one run's rows and not in the other's (added
between their versions). Rows of a method one run lacks are listed one by
one, by their own knobs. --by joins on the keys given
instead (rows sharing a key are averaged). Metrics that are times (*_seconds,
*_ms, *_us, *_time) differ run to run: they are shown but count as a change
only when --metrics names them. Rows whose kernels_py sources differ are marked [code],
rows present in one run only are listed. Runs of different experiments are
compared the same way, with a warning.

--fail-if METRIC>X (or <X; X% for a relative change) exits 1 when a joined
row's change from A to B passes X, when the metric is lost (NaN) in B, or
when a job that succeeded in A failed or is missing in B (listed once,
whatever the number of guards), so a comparison can guard a change in CI:
  workbench compare results/quickstart/OLD results/quickstart/NEW --fail-if 'rel_err_mean>0.001'`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if maxShown < 0 {
				return &usageError{fmt.Errorf("--max-metrics must be 0 (all) or more, got %d", maxShown)}
			}
			if o.Tolerance < 0 {
				return &usageError{fmt.Errorf("--tolerance must be 0 or more, got %g", o.Tolerance)}
			}
			var guards []compare.Guard
			for _, f := range failIf {
				g, err := compare.ParseGuard(f)
				if err != nil {
					return &usageError{err}
				}
				guards = append(guards, g)
			}
			runA, err := loadRun(args[0])
			if err != nil {
				return err
			}
			runB, err := loadRun(args[1])
			if err != nil {
				return err
			}
			r, err := compare.Compare(runA, runB, o)
			var bad *compare.OptionError
			if errors.As(err, &bad) {
				return &usageError{err}
			}
			if err != nil {
				return err
			}
			for _, run := range []*compare.Run{runA, runB} {
				if run.Writer != "" && len(guards) > 0 {
					// A pass on a partial run says nothing of the jobs still to come.
					r.Warnings = append(r.Warnings, fmt.Sprintf("--fail-if judges a partial run: %s is still being written", run.Dir))
				}
			}
			for _, w := range r.Warnings {
				a.log.Warn().Msg(w)
			}
			broken, err := r.Failures(guards)
			if err != nil {
				return &usageError{err}
			}
			if asJSON {
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				if broken == nil {
					broken = []string{} // a list, as the report's others
				}
				if err := enc.Encode(jsonReport{r, broken}); err != nil {
					return err
				}
			} else {
				printComparison(a.stdout, r, all, maxShown)
			}
			if len(broken) > 0 {
				if !asJSON {
					fmt.Fprintln(a.stdout)
					for _, b := range broken {
						fmt.Fprintln(a.stdout, "FAIL", b)
					}
				}
				return &exitCodeError{code: 1}
			}
			return nil
		},
	}
	cmd.Flags().StringSliceVar(&o.By, "by", nil, "join on these keys: method, workload, a knob (budget) or a workload knob (workload.seed)")
	cmd.Flags().StringSliceVar(&o.Metrics, "metrics", nil, "only these metrics (default: every metric both runs have)")
	cmd.Flags().Float64Var(&o.Tolerance, "tolerance", 1e-9, "relative difference below which two values are equal")
	cmd.Flags().StringArrayVar(&failIf, "fail-if", nil, "exit 1 when a row's change passes this: METRIC>X or METRIC<X, X% relative (repeatable)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the comparison as JSON")
	cmd.Flags().BoolVar(&all, "all", false, "show every joined row, changed or not")
	cmd.Flags().IntVar(&maxShown, "max-metrics", 8, "metrics shown per row (the largest relative changes first); 0: all")
	return cmd
}

type jsonReport struct {
	*compare.Report
	Failed []string `json:"failed"`
}

func printComparison(w io.Writer, r *compare.Report, all bool, maxShown int) {
	fmt.Fprintf(w, "A %s\nB %s\n", r.RunA, r.RunB)
	if len(r.Varied) > 0 {
		fmt.Fprintf(w, "varied: %s\n", strings.Join(r.Varied, "; "))
	}
	fmt.Fprintf(w, "joined on: %s\n", strings.Join(r.Keys, ", "))
	fmt.Fprintf(w, "%d rows joined, %d changed; %d only in A, %d only in B\n", len(r.Rows), r.Changed, len(r.OnlyA), len(r.OnlyB))
	for _, row := range r.Rows {
		if !row.Changed && !all {
			continue
		}
		mark := ""
		if row.KernelsDiffer {
			mark = " [code]"
		}
		if row.StatusA != row.StatusB {
			mark += fmt.Sprintf(" [status %s -> %s]", row.StatusA, row.StatusB)
		}
		fmt.Fprintf(w, "\n%s%s\n", row.Key, mark)
		for _, e := range []struct{ side, err string }{{"A", row.ErrorA}, {"B", row.ErrorB}} {
			if e.err != "" {
				fmt.Fprintf(w, "  %s failed: %s\n", e.side, firstLine(e.err))
			}
		}
		if countShown(row.Deltas, all) == 0 {
			continue // a status change alone: no table of metrics
		}
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  metric\tA\tB\tB-A\trel")
		shown, more := 0, 0
		for _, d := range byChange(row.Deltas) {
			if !d.Changed && !all {
				continue
			}
			if maxShown > 0 && shown == maxShown {
				more = countShown(row.Deltas, all) - shown
				break
			}
			note := ""
			if d.IsTiming {
				note = " (time)"
			}
			fmt.Fprintf(tw, "  %s%s\t%.6g\t%.6g\t%+.3g\t%s\n", d.Metric, note, d.A, d.B, d.Abs, percent(d.Rel))
			shown++
		}
		tw.Flush()
		if more > 0 {
			fmt.Fprintf(w, "  ... %d more (--max-metrics 0 shows all)\n", more)
		}
	}
	only := func(side string, keys, statuses []string) {
		for i, k := range keys {
			if i < len(statuses) && statuses[i] != results.StatusOK {
				k += " [" + statuses[i] + "]" // a job new in B that failed is no row to miss
			}
			fmt.Fprintf(w, "only in %s: %s\n", side, k)
		}
	}
	only("A", r.OnlyA, r.OnlyAStatus)
	only("B", r.OnlyB, r.OnlyBStatus)
}

// countShown counts the deltas a row shows without a limit.
func countShown(ds []compare.Delta, all bool) int {
	n := 0
	for _, d := range ds {
		if d.Changed || all {
			n++
		}
	}
	return n
}

// byChange orders deltas: changed metrics first, a metric B lost first of
// them, then the largest relative change first, times last.
func byChange(ds []compare.Delta) []compare.Delta {
	out := append([]compare.Delta(nil), ds...)
	rank := func(d compare.Delta) float64 {
		switch {
		case !d.Changed:
			return -2
		case d.IsTiming:
			return -1
		case math.IsNaN(d.Rel): // lost in B: a NaN rank compares false both ways and would stall the sort
			return math.Inf(1)
		}
		return math.Abs(d.Rel)
	}
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && rank(out[j]) > rank(out[j-1]); j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

func percent(rel float64) string {
	if math.IsInf(rel, 0) || math.IsNaN(rel) {
		return "-"
	}
	return fmt.Sprintf("%+.2f%%", 100*rel)
}

// loadRun is compare.Load, where a path it cannot read says what it is
// instead (an experiment's folder lists its runs to pick from); a table
// without a manifest or journal is still a run to compare.
func loadRun(dir string) (*compare.Run, error) {
	run, err := compare.Load(dir)
	if err != nil {
		if perr := checkRunPath(dir); perr != nil {
			return nil, perr
		}
	}
	return run, err
}
