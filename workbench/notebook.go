package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"

	"github.com/spf13/cobra"

	vlkv "github.com/vlkv/vlkv"
	"github.com/vlkv/vlkv/gohost/pyrt"
	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/worker"
)

func newNotebookCmd(a *app) *cobra.Command {
	var out string
	cmd := &cobra.Command{
		Use:   "notebook NAME RUN_DIR...",
		Short: "Execute a notebook of notebooks/ against runs; write it, and an HTML copy with its plots, beside the run",
		Long: `notebook executes notebooks/NAME.ipynb, every cell as "Run all" would, on
the run directories given (compare reads two, A then B; the others one), in
the workbench's runtime with kernels_py importable, and writes the executed
notebook and a self-contained HTML copy (plots inline) into the last run
directory, or --out DIR:

  workbench notebook quickstart results/quickstart/20261123-101500-aaaaaa
  workbench notebook compare results/quickstart/OLD results/quickstart/NEW

A run whose journal is ahead of its results.parquet has the table rebuilt
first, as status does, so a run that was killed is read as far as it got;
a finished run is only read (a run another workbench is writing is read as
its table last stood).
A cell that fails exits 1; the notebook up to it is still written, with
the error. workbench lab opens the notebooks in JupyterLab instead.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			kernels, err := a.kernelsRoot()
			if err != nil {
				return err
			}
			available := notebookNames(kernels)
			if len(args) == 0 {
				return &usageError{fmt.Errorf("give a notebook (%s) and the run directories it reads",
					strings.Join(available, ", "))}
			}
			name, err := notebookName(kernels.Dir, args[0])
			if err != nil {
				return &usageError{fmt.Errorf("%w (one of %s)", err, strings.Join(available, ", "))}
			}
			nb, err := readNotebook(kernels, name)
			if errors.Is(err, fs.ErrNotExist) {
				return &usageError{fmt.Errorf("no notebook %q: notebooks/ has %s", name, strings.Join(available, ", "))}
			}
			if err != nil {
				return err
			}
			runs := args[1:]
			meta := readNotebookMeta(nb)
			if want := meta.Runs; len(runs) != want {
				return &usageError{fmt.Errorf("notebook %s reads %d run director%s, got %d", name, want,
					map[bool]string{true: "y", false: "ies"}[want == 1], len(runs))}
			}
			for _, run := range runs {
				if err := checkExperiment(name, meta, run); err != nil {
					return err
				}
			}
			for _, run := range runs {
				if err := a.syncForReading(run); err != nil {
					return err
				}
			}
			if out == "" {
				out = runs[len(runs)-1]
			}
			if err := os.MkdirAll(out, 0o755); err != nil {
				return fmt.Errorf("--out %s: %w", out, err)
			}
			// The notebook runs from a file: a checkout's own, or the binary's copy.
			src := filepath.Join(kernels.Dir, "notebooks", name+".ipynb")
			if _, err := os.Stat(src); err != nil {
				tmp, err := os.MkdirTemp("", "workbench-notebook-")
				if err != nil {
					return err
				}
				defer os.RemoveAll(tmp)
				src = filepath.Join(tmp, name+".ipynb")
				if err := os.WriteFile(src, nb, 0o644); err != nil {
					return err
				}
			}
			s, err := a.newSession(cmd.Context())
			if err != nil {
				return err
			}
			pyArgs := append([]string{safePath, "-m", "kernels_py.notebooks", src, filepath.Join(out, name+".ipynb")}, runs...)
			c := exec.CommandContext(cmd.Context(), s.runtime.Python, pyArgs...)
			c.Env = worker.Environment(os.Environ(), s.kernels.Dir, s.device)
			c.Stdout, c.Stderr = a.stdout, a.stderr
			if err := c.Run(); err != nil {
				var ee *exec.ExitError
				if errors.As(err, &ee) {
					return &exitCodeError{code: ee.ExitCode()}
				}
				return fmt.Errorf("execute notebook %s: %w", name, err)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&out, "out", "", "directory for NAME.ipynb and NAME.html (default: the last run directory)")
	return cmd
}

// notebookName is the notebook arg names: NAME, NAME.ipynb, or the path of
// a notebook in the kernels root's notebooks/ (as a shell completes it).
func notebookName(kernelsDir, arg string) (string, error) {
	dir, name := filepath.Split(strings.TrimSuffix(arg, ".ipynb"))
	if dir == "" {
		return name, nil
	}
	want, err := filepath.Abs(filepath.Join(kernelsDir, "notebooks"))
	if err != nil {
		return "", err
	}
	got, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	if got != want {
		return "", fmt.Errorf("%s: a notebook is named from %s", arg, want)
	}
	return name, nil
}

// notebookNames lists the notebooks of the kernels root, else the binary's.
func notebookNames(kernels pyrt.KernelsRoot) []string {
	paths, _ := filepath.Glob(filepath.Join(kernels.Dir, "notebooks", "*.ipynb"))
	if len(paths) == 0 {
		paths, _ = fs.Glob(vlkv.Assets, "notebooks/*.ipynb")
	}
	var names []string
	for _, p := range paths {
		names = append(names, strings.TrimSuffix(filepath.Base(p), ".ipynb"))
	}
	sort.Strings(names)
	return names
}

func readNotebook(kernels pyrt.KernelsRoot, name string) ([]byte, error) {
	if strings.ContainsAny(name, `/\`) {
		return nil, fs.ErrNotExist
	}
	data, err := os.ReadFile(filepath.Join(kernels.Dir, "notebooks", name+".ipynb"))
	if errors.Is(err, fs.ErrNotExist) {
		return fs.ReadFile(vlkv.Assets, "notebooks/"+name+".ipynb")
	}
	return data, err
}

// notebookMeta is what a notebook's metadata says of the runs it reads
// (vlkv.runs: how many, else one; vlkv.experiment: of which experiment,
// "" for any).
type notebookMeta struct {
	Runs       int    `json:"runs"`
	Experiment string `json:"experiment"`
}

func readNotebookMeta(nb []byte) notebookMeta {
	var doc struct {
		Metadata struct {
			Vlkv notebookMeta `json:"vlkv"`
		} `json:"metadata"`
	}
	json.Unmarshal(nb, &doc) // a notebook without it reads one run of any experiment
	if doc.Metadata.Vlkv.Runs < 1 {
		doc.Metadata.Vlkv.Runs = 1
	}
	return doc.Metadata.Vlkv
}

// checkExperiment refuses a run of another experiment than the notebook's,
// whose cells would fail on what it lacks.
func checkExperiment(name string, meta notebookMeta, run string) error {
	m, err := results.ReadManifest(run)
	if meta.Experiment == "" || err != nil || m.Experiment == "" || m.Experiment == meta.Experiment {
		return nil // the notebook reads any run, or this one cannot say: let the notebook judge
	}
	return &usageError{fmt.Errorf("notebook %s reads a run of experiment %s; %s is a run of %s", name,
		meta.Experiment, run, m.Experiment)}
}

func newLabCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "lab [-- JUPYTER_ARGS...]",
		Short: "Open JupyterLab on notebooks/ in the workbench's runtime (installs the lock's jupyter group on first use)",
		Long: `lab starts JupyterLab in notebooks/, its kernels running the workbench's
Python with kernels_py importable and the device settings workers get, so
the notebooks read runs as they do under workbench notebook. JupyterLab is
not part of the runtime: the first lab installs the jupyter dependency group
pinned in uv.lock into the managed runtime (once; later runs reuse it). With
--python or WORKBENCH_PYTHON, install jupyterlab into that interpreter
yourself. Arguments after -- go to JupyterLab, e.g.:

  workbench lab -- --no-browser --port 8890`,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			s, err := a.newSession(ctx)
			if err != nil {
				return err
			}
			if s.runtime.Kind == pyrt.Managed {
				if err := a.installGroup(ctx, s, "jupyter"); err != nil {
					return err
				}
			} else if err := exec.CommandContext(ctx, s.runtime.Python, "-c", "import jupyterlab").Run(); err != nil {
				return fmt.Errorf("jupyterlab is not installed in %s (from %s): install it there (the version uv.lock "+
					"pins in its jupyter group), or run without --python to use the managed runtime, which installs it "+
					"on first use", s.runtime.Python, s.runtime.Source)
			}
			dir := filepath.Join(s.kernels.Dir, "notebooks")
			if _, err := os.Stat(dir); err != nil {
				dir = "." // a kernels root without notebooks (the binary's own): the current directory
			}
			c := exec.CommandContext(ctx, s.runtime.Python, append([]string{"-m", "jupyterlab", "--notebook-dir", dir}, args...)...)
			c.Env = worker.Environment(os.Environ(), s.kernels.Dir, s.device)
			c.Stdin, c.Stdout, c.Stderr = os.Stdin, a.stdout, a.stderr
			if err := c.Run(); err != nil {
				var ee *exec.ExitError
				if errors.As(err, &ee) && ctx.Err() == nil {
					return &exitCodeError{code: ee.ExitCode()}
				}
				if ctx.Err() != nil {
					return nil
				}
				return fmt.Errorf("start JupyterLab: %w", err)
			}
			return nil
		},
	}
}
