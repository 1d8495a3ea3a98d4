package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/mattn/go-isatty"
	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/compare"
	"github.com/vlkv/vlkv/gohost/expt"
	"github.com/vlkv/vlkv/gohost/pyrt"
	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/runner"
	"github.com/vlkv/vlkv/gohost/slurm"
	"github.com/vlkv/vlkv/gohost/worker"
)

type watchFlags struct {
	bench        bool
	size         []string
	dtype        enumFlag
	seed         int
	noCompile    bool
	target       int
	experiment   string
	out          string
	resetHistory bool
	debounce     time.Duration
}

func newWatchCmd(a *app) *cobra.Command {
	f := watchFlags{dtype: enumFlag{value: "float32", allowed: []string{"float32", "float16", "bfloat16"}}}
	cmd := &cobra.Command{
		Use:   "watch OP | watch --experiment FILE.star",
		Short: "Rerun an op's checks (or an experiment's jobs) each time a kernels_py source is saved",
		Long: `watch OP watches kernels_py/ and, on each save, reloads the worker's
modules and checks the op again: its selftest (every kernel against the
PyTorch reference on the op's test shapes, with the largest error), on a
machine without a GPU a real compile of its first compile case for sm_90
(the interpreter compiles nothing: compile time, registers, spills), and
with --bench on a GPU its benchmark (--size picks the size with the
benchmark's own knobs, as workbench bench NAME --help lists them: e.g.
--size batches=8,lengths=4096,16384 for gather_decode; kv-heads or
kv_heads alike).
Each iteration prints one screen, with each figure's change against the
previous iteration and the first one. A kernel that does not import,
interpret or compile is shown as its source line and the error, and the
watch goes on. Iterations are kept in the user cache (watch/), so a
restarted watch continues the trend of the iterations with the same
--dtype, --seed, --target and --size (--reset-history starts afresh).
Ctrl-C stops the worker and everything it started.

watch --experiment FILE.star runs the experiment (into --out, resuming its
newest run), then on each save of kernels_py/ or the script reruns the jobs
whose rows were computed on other sources (or are new) and prints the
metrics that changed.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			opOnly := []string{"bench", "size", "dtype", "seed", "no-compile", "target", "reset-history"}
			switch {
			case f.experiment != "" && len(args) > 0:
				return &usageError{errors.New("give an OP or --experiment FILE.star, not both")}
			case f.experiment != "":
				for _, name := range opOnly {
					if cmd.Flags().Changed(name) {
						return &usageError{fmt.Errorf("--%s applies to watch OP, not to --experiment", name)}
					}
				}
				if err := checkOutDir(f.out); err != nil { // else every iteration would fail the same way
					return err
				}
				return a.watchExperiment(cmd.Context(), f)
			case cmd.Flags().Changed("out"):
				return &usageError{errors.New("--out applies to watch --experiment")}
			case len(args) == 0:
				ops := "kernels_py/ops/<op>"
				if s, _, err := a.schema(); err == nil {
					ops = "one of " + strings.Join(s.OpNames(), ", ")
				}
				return &usageError{fmt.Errorf("give the op to watch (%s) or --experiment FILE.star", ops)}
			}
			return a.watchOp(cmd.Context(), args[0], f)
		},
	}
	fl := cmd.Flags()
	fl.BoolVar(&f.bench, "bench", false, "also time the op with its benchmark (needs a GPU)")
	fl.StringArrayVar(&f.size, "size", nil, "benchmark knobs for --bench, KNOB=VALUE,... (a list knob takes several values: "+
		"batches=8,lengths=4096,16384; repeatable)")
	fl.Var(&f.dtype, "dtype", "dtype of the selftest inputs")
	fl.IntVar(&f.seed, "seed", 0, "seed of the selftest inputs")
	fl.BoolVar(&f.noCompile, "no-compile", false, "skip the sm_90 compile on a machine without a GPU")
	fl.IntVar(&f.target, "target", 90, "compute capability of that compile: 80 or 90")
	fl.StringVar(&f.experiment, "experiment", "", "watch an experiment script's jobs instead of an op")
	fl.StringVar(&f.out, "out", "results", "with --experiment: results root directory")
	fl.BoolVar(&f.resetHistory, "reset-history", false, "forget the op's earlier iterations")
	fl.DurationVar(&f.debounce, "debounce", 300*time.Millisecond, "quiet time after a save before rerunning (editors write in bursts)")
	return cmd
}

// watchResult is what kernels_py.watch.check returns.
type watchResult struct {
	Op          string `json:"op"`
	OK          bool   `json:"ok"`
	Device      string `json:"device"`
	Interpreter bool   `json:"interpreter"`
	Selftest    *struct {
		table
		Title         string   `json:"title"`
		Notes         []string `json:"notes"`
		OK            bool     `json:"ok"`
		KernelSeconds float64  `json:"kernel_seconds"`
		WallSeconds   float64  `json:"wall_seconds"`
	} `json:"selftest"`
	Compile *struct {
		Case    string  `json:"case"`
		Target  int     `json:"target"`
		Seconds float64 `json:"seconds"`
		Kernels []struct {
			Kernel     string   `json:"kernel"`
			Seconds    *float64 `json:"seconds"`
			Config     string   `json:"config"`
			Registers  *int     `json:"registers"`
			SpillBytes int      `json:"spill_bytes"`
			Pruned     bool     `json:"pruned"` // spills, so the autotuner never runs it`
		} `json:"kernels"`
		Error *sourceError `json:"error"`
	} `json:"compile"`
	Bench *table       `json:"bench"`
	Error *sourceError `json:"error"`
	// WorkerLost is why the worker's GPU was unusable after the error: it
	// exits once it has replied, and the next check starts a fresh one.
	WorkerLost string `json:"worker_lost"`
}

// sourceError is an error at a kernels_py line (kernels_py.runtime.errors).
type sourceError = worker.SourceLine

// figures are the numbers of an iteration that get compared.
func (r watchResult) figures() map[string]float64 {
	f := map[string]float64{}
	if st := r.Selftest; st != nil {
		maxErr, failed, judged := 0.0, 0.0, false
		for _, row := range st.Rows {
			for k, v := range row {
				if x, ok := v.(float64); ok && strings.HasSuffix(k, "err") {
					maxErr = math.Max(maxErr, x)
				}
			}
			if ok, isBool := row["ok"].(bool); isBool {
				judged = true
				if !ok {
					failed++
				}
			}
		}
		// Under the interpreter the kernels' time is Python's, which swings
		// with the machine's load: named so, it is not read as kernel speed.
		timed := "kernel s"
		if r.Interpreter {
			timed = "interpreter s"
		}
		f["max error"], f[timed] = maxErr, st.KernelSeconds
		// Every op's rows say whether each is within tolerance (test_selftest);
		// a table that does not cannot count its failures, and 0 next to a
		// mismatch would be a lie.
		if judged {
			f["failed shapes"] = failed
		}
	}
	if c := r.Compile; c != nil && c.Error == nil {
		seconds, regs, spill := 0.0, 0, 0
		for _, k := range c.Kernels {
			if k.Seconds != nil {
				seconds += *k.Seconds
			}
			if k.Pruned { // never runs: its registers and spills are none of the kernel's
				continue
			}
			if k.Registers != nil && *k.Registers > regs {
				regs = *k.Registers
			}
			spill += k.SpillBytes
		}
		f["compile s"], f["registers"], f["spill bytes"] = seconds, float64(regs), float64(spill)
	}
	if b := r.Bench; b != nil && len(b.Rows) > 0 {
		for k, v := range b.Rows[0] {
			if x, ok := v.(float64); ok {
				f["bench "+k] = x
			}
		}
	}
	return f
}

// watchEntry is one iteration in the history file.
type watchEntry struct {
	Time      time.Time          `json:"time"`
	Iteration int                `json:"iteration"`
	OK        bool               `json:"ok"`
	Changed   []string           `json:"changed,omitempty"`
	Figures   map[string]float64 `json:"figures"`
	Error     *sourceError       `json:"error,omitempty"`
	// Settings are what the figures were measured with (dtype, seed,
	// compile target, benchmark size): figures are compared only with an
	// iteration's of the same settings.
	Settings string `json:"settings,omitempty"`
}

// watchHistory is an op's iterations, kept in the user cache per kernels root.
type watchHistory struct {
	path    string
	entries []watchEntry
}

func openWatchHistory(kernelsDir, op string, reset bool) (*watchHistory, error) {
	cache, err := pyrt.CacheDir()
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256([]byte(kernelsDir))
	h := &watchHistory{path: filepath.Join(cache, "watch", hex.EncodeToString(sum[:6])+"-"+op+".jsonl")}
	if err := os.MkdirAll(filepath.Dir(h.path), 0o755); err != nil {
		return nil, err
	}
	if reset {
		os.Remove(h.path)
		return h, nil
	}
	if f, err := os.Open(h.path); err == nil {
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<24)
		for sc.Scan() {
			var e watchEntry
			if json.Unmarshal(sc.Bytes(), &e) == nil {
				h.entries = append(h.entries, e)
			}
		}
		f.Close()
	}
	return h, nil
}

func (h *watchHistory) add(e watchEntry) error {
	h.entries = append(h.entries, e)
	f, err := os.OpenFile(h.path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	line, _ := json.Marshal(e)
	_, err = f.Write(append(line, '\n'))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// previous is the newest iteration with figures measured with these settings.
func (h *watchHistory) previous(settings string) *watchEntry {
	for i := len(h.entries) - 1; i >= 0; i-- {
		if e := &h.entries[i]; len(e.Figures) > 0 && e.Settings == settings {
			return e
		}
	}
	return nil
}

// first is the oldest iteration with figures measured with these settings.
func (h *watchHistory) first(settings string) *watchEntry {
	for i := range h.entries {
		if e := &h.entries[i]; len(e.Figures) > 0 && e.Settings == settings {
			return e
		}
	}
	return nil
}

// watchSettings names what a check's figures depend on besides the sources
// (--no-compile and --bench only leave figures out or add some: not
// settings; --size changes the benchmark's).
func watchSettings(f watchFlags, size map[string]any) string {
	if len(size) == 0 {
		size = nil
	}
	data, _ := json.Marshal(map[string]any{"dtype": f.dtype.value, "seed": f.seed, "target": f.target, "size": size})
	return string(data)
}

func (a *app) watchOp(ctx context.Context, op string, f watchFlags) error {
	schema, kernels, err := a.schema()
	if err != nil {
		return err
	}
	if _, ok := schema.Ops[op]; !ok {
		return &usageError{fmt.Errorf("op %s%s", expt.UnknownName(op, schema.OpNames()), unknownHint(kernels, "op", op))}
	}
	if f.target != 80 && f.target != 90 {
		return &usageError{fmt.Errorf("--target must be 80 or 90, got %d", f.target)}
	}
	if len(f.size) > 0 && !f.bench {
		return &usageError{errors.New("--size sets the benchmark's knobs: add --bench")}
	}
	var params map[string]any
	if f.bench {
		if params, err = watchBenchParams(schema, op, f.size); err != nil {
			return &usageError{err}
		}
	}
	s, err := a.newSession(ctx)
	if err != nil {
		return err
	}
	args := map[string]any{"op": op, "dtype": f.dtype.value, "seed": f.seed}
	if f.bench {
		if s.device != worker.CUDA {
			return errors.New("--bench times the op on a GPU, and this run has none (the Triton interpreter's " +
				"timings mean nothing); watch without --bench checks correctness and compiles for sm_90")
		}
		args["bench"] = map[string]any{"params": params}
	}
	if !f.noCompile && s.device != worker.CUDA {
		args["compile_target"] = f.target
	}
	history, err := openWatchHistory(s.kernels.Dir, op, f.resetHistory)
	if err != nil {
		return err
	}
	settings := watchSettings(f, params)
	if n := len(history.entries); n > 0 {
		other := 0
		for _, e := range history.entries {
			if e.Settings != settings {
				other++
			}
		}
		note := ""
		if other > 0 {
			note = fmt.Sprintf(" (%d with another --dtype, --seed, --target or --size: not compared)", other)
		}
		fmt.Fprintf(a.stdout, "%d earlier iteration(s) of %s in %s%s\n", n, op, history.path, note)
	}
	changes, stop, err := watchSources(ctx, filepath.Join(s.kernels.Dir, "kernels_py"), nil, f.debounce)
	if err != nil {
		return err
	}
	defer stop()
	var w *worker.Worker
	defer func() {
		if w != nil {
			w.Close()
		}
	}()
	tty := isatty.IsTerminal(os.Stdout.Fd()) && isStdout(a.stdout)
	var changed []string
	for iteration := 1; ; iteration++ {
		if w != nil && w.Alive() && iteration > 1 {
			if _, err := w.Reload(ctx); err != nil && ctx.Err() == nil {
				a.log.Warn().Err(err).Msg("reload failed; starting a fresh worker")
				w.Close()
				w = nil
			}
		}
		if w == nil || !w.Alive() { // the first, or one that crashed on the last edit
			if w != nil {
				w.Close()
				w = nil
			}
			started, err := a.startWorker(ctx, s)
			if ctx.Err() != nil {
				return nil
			}
			if err != nil { // say so and wait for the save that mends it
				fmt.Fprintf(a.stdout, "── watch %s · iteration %d · %s\nERROR the worker did not start: %s\n"+
					"FAILING; watching kernels_py/ (Ctrl-C stops)\n", op, iteration, time.Now().Format("15:04:05"),
					firstLine(err.Error()))
				select {
				case <-ctx.Done():
					return nil
				case changed = <-changes:
				}
				continue
			}
			w = started
		}
		start := time.Now()
		raw, err := w.Run(ctx, worker.Job{Fn: "kernels_py.watch:check", Args: args})
		if ctx.Err() != nil {
			return nil
		}
		entry := watchEntry{Time: start, Iteration: len(history.entries) + 1, Changed: changed, Settings: settings}
		var r watchResult
		switch {
		case err != nil: // the check itself failed: the worker died, or watch.py does not import
			entry.Error = &sourceError{Message: firstLine(err.Error())}
		case json.Unmarshal(raw, &r) != nil:
			entry.Error = &sourceError{Message: "the check returned an unexpected result"}
		default:
			entry.OK, entry.Figures, entry.Error = r.OK, r.figures(), r.Error
		}
		prev, first := history.previous(settings), history.first(settings)
		if tty {
			fmt.Fprint(a.stdout, "\033[H\033[2J")
		}
		printWatchScreen(a.stdout, op, iteration, entry, r, prev, first, time.Since(start))
		if err := history.add(entry); err != nil {
			a.log.Warn().Err(err).Msg("watch history not written")
		}
		select {
		case <-ctx.Done():
			return nil
		case changed = <-changes:
		}
	}
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// watchBenchParams reads --size against the knobs of the benchmark that times op:
// KNOB=VALUE items separated by commas, where a value with no "=" belongs
// to the list knob before it (batches=8,lengths=4096,16384), each checked
// as `workbench bench NAME` checks its flags.
func watchBenchParams(schema *expt.Schema, op string, items []string) (map[string]any, error) {
	name := schema.Ops[op].Benchmark
	b := schema.Benchmarks[name]
	if b == nil {
		return nil, fmt.Errorf("--bench: no registered benchmark times %s", op)
	}
	values := map[string][]string{}
	var order []string
	last := ""
	for _, item := range items {
		for _, part := range strings.Split(item, ",") {
			part = strings.TrimSpace(part)
			k, v, ok := strings.Cut(part, "=")
			k = strings.ReplaceAll(k, "-", "_") // bench NAME's flag spelling (--kv-heads) or the knob's (kv_heads)
			switch {
			case ok && k != "":
				if _, seen := values[k]; seen {
					return nil, fmt.Errorf("--size: %s is given twice", k)
				}
				last = k
				order = append(order, k)
				values[k] = []string{v}
			case last != "" && part != "":
				values[last] = append(values[last], part)
			default:
				return nil, fmt.Errorf("--size %q: want KNOB=VALUE,..., e.g. --size %s", item, sizeExample(b))
			}
		}
	}
	out := map[string]any{}
	for _, k := range order {
		p := b.Params[k]
		if p == nil {
			return nil, fmt.Errorf("--size: benchmark %s (which times %s): knob %s", name, op,
				expt.UnknownName(k, b.Params.Names()))
		}
		raw, err := knobValue(p, values[k])
		if err == nil {
			out[k], err = p.Check(raw)
		}
		if err != nil {
			return nil, fmt.Errorf("--size %s: %v (%s)", k, err, p.Describe())
		}
	}
	return out, nil
}

// knobValue is what Param.Check takes for the texts given: a list for a
// list knob, else one number, bool or word.
func knobValue(p *expt.Param, texts []string) (any, error) {
	if p.Type == expt.TypeInts {
		out := make([]int64, len(texts))
		for i, t := range texts {
			x, err := strconv.ParseInt(t, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("%q is not a whole number", t)
			}
			out[i] = x
		}
		return out, nil
	}
	if len(texts) != 1 {
		return nil, fmt.Errorf("takes one value, got %d (%s)", len(texts), strings.Join(texts, ","))
	}
	t := texts[0]
	switch p.Type {
	case expt.TypeInt:
		x, err := strconv.ParseInt(t, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%q is not a whole number", t)
		}
		return x, nil
	case expt.TypeFloat:
		x, err := strconv.ParseFloat(t, 64)
		if err != nil {
			return nil, fmt.Errorf("%q is not a number", t)
		}
		return x, nil
	case expt.TypeBool:
		x, err := strconv.ParseBool(t)
		if err != nil {
			return nil, fmt.Errorf("%q is not true or false", t)
		}
		return x, nil
	}
	return t, nil
}

// sizeExample is a --size for benchmark b from its first list knobs.
func sizeExample(b *expt.Benchmark) string {
	var parts []string
	for _, n := range b.Params.Names() {
		if p := b.Params[n]; p.Type == expt.TypeInts && len(parts) < 2 {
			if def, ok := p.Default.([]int64); ok && len(def) > 0 {
				parts = append(parts, fmt.Sprintf("%s=%d", n, def[0]))
			}
		}
	}
	return strings.Join(parts, ",")
}

func printWatchScreen(w io.Writer, op string, iteration int, e watchEntry, r watchResult, prev, first *watchEntry, took time.Duration) {
	what := "start"
	if len(e.Changed) > 0 {
		what = strings.Join(e.Changed, ", ")
	}
	fmt.Fprintf(w, "── watch %s · iteration %d · %s · %s (%.1f s)\n", op, iteration, e.Time.Format("15:04:05"), what, took.Seconds())
	if st := r.Selftest; st != nil {
		verdict := "OK"
		if !st.OK {
			verdict = "MISMATCH"
		}
		mode := r.Device
		if r.Interpreter {
			mode += ", Triton interpreter"
		}
		fmt.Fprintf(w, "selftest (%s): %s\n", mode, verdict)
		st.table.print(w)
	}
	if c := r.Compile; c != nil && c.Error == nil && len(c.Kernels) > 0 {
		var parts []string
		for _, k := range c.Kernels {
			part := k.Kernel
			if k.Config != "" {
				part += " (" + k.Config + ")"
			}
			if k.Seconds != nil {
				part += fmt.Sprintf(" %.2f s", *k.Seconds)
			}
			if k.Registers != nil {
				part += fmt.Sprintf(", %d registers", *k.Registers)
			}
			if k.SpillBytes > 0 {
				part += fmt.Sprintf(", %d B spilled", k.SpillBytes)
			}
			if k.Pruned {
				part += " (pruned: the autotuner skips a config that spills)"
			}
			parts = append(parts, part)
		}
		fmt.Fprintf(w, "compile sm_%d (%s): %s\n", c.Target, c.Case, strings.Join(parts, "; "))
	}
	if r.Bench != nil {
		fmt.Fprintln(w, "bench:")
		r.Bench.print(w)
	}
	if e.Error != nil {
		fmt.Fprintf(w, "ERROR %s\n", e.Error.Format())
	}
	if r.WorkerLost != "" {
		fmt.Fprintf(w, "the GPU was unusable after it (%s): the next check starts a fresh worker\n", r.WorkerLost)
	}
	if len(e.Figures) > 0 {
		names := make([]string, 0, len(e.Figures))
		for k := range e.Figures {
			names = append(names, k)
		}
		sort.Strings(names)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  \tnow\tvs previous\tvs first")
		for _, k := range names {
			fmt.Fprintf(tw, "  %s\t%.4g\t%s\t%s\n", k, e.Figures[k], change(e.Figures[k], prev, k), change(e.Figures[k], first, k))
		}
		tw.Flush()
	}
	status := "OK"
	if !e.OK {
		status = "FAILING"
	}
	fmt.Fprintf(w, "%s; watching kernels_py/ (Ctrl-C stops)\n", status)
}

func change(now float64, than *watchEntry, key string) string {
	if than == nil {
		return "-"
	}
	was, ok := than.Figures[key]
	switch {
	case !ok:
		return "-"
	case was == now:
		return "="
	case was == 0:
		return fmt.Sprintf("%+.3g", now-was)
	}
	return fmt.Sprintf("%+.3g (%+.1f%%)", now-was, 100*(now-was)/math.Abs(was))
}

// watchSources sends the sources saved under root (and the extra files),
// relative to root's parent, each burst of saves once after debounce.
func watchSources(ctx context.Context, root string, extra []string, debounce time.Duration) (<-chan []string, func(), error) {
	fw, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, nil, fmt.Errorf("watch %s: %w", root, err)
	}
	addTree := func(dir string) {
		filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				if name := d.Name(); name == "__pycache__" || (strings.HasPrefix(name, ".") && p != dir) {
					return filepath.SkipDir
				}
				fw.Add(p)
			}
			return nil
		})
	}
	addTree(root)
	extras := map[string]bool{}
	for _, f := range extra {
		abs, _ := filepath.Abs(f)
		extras[abs] = true
		fw.Add(filepath.Dir(abs)) // editors replace files: watch the directory
	}
	base := filepath.Dir(root)
	out := make(chan []string)
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		defer close(out)
		pending := map[string]bool{}
		var timer <-chan time.Time
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-fw.Events:
				if !ok {
					return
				}
				if ev.Has(fsnotify.Create) {
					if info, err := os.Stat(ev.Name); err == nil && info.IsDir() {
						addTree(ev.Name)
						continue
					}
				}
				abs, _ := filepath.Abs(ev.Name)
				if !(strings.HasSuffix(ev.Name, ".py") && strings.HasPrefix(abs, root)) && !extras[abs] {
					continue
				}
				if ev.Has(fsnotify.Chmod) && !ev.Has(fsnotify.Write) {
					continue
				}
				rel, err := filepath.Rel(base, abs)
				if err != nil || strings.HasPrefix(rel, "..") {
					rel = abs
				}
				pending[rel] = true
				timer = time.After(debounce)
			case <-timer:
				files := make([]string, 0, len(pending))
				for f := range pending {
					files = append(files, f)
				}
				sort.Strings(files)
				pending = map[string]bool{}
				timer = nil
				select {
				case out <- files:
				case <-ctx.Done():
					return
				}
			case <-fw.Errors:
			}
		}
	}()
	return out, func() { cancel(); fw.Close() }, nil
}

// watchExperiment runs an experiment, then reruns its stale jobs after each
// save and prints what changed.
func (a *app) watchExperiment(ctx context.Context, f watchFlags) error {
	if !strings.HasPrefix(f.experiment, "embedded:") {
		// A script that is not there is a typo, not a save still to come.
		if _, err := os.Stat(f.experiment); err != nil {
			return fmt.Errorf("--experiment %s: %w", f.experiment, errors.Unwrap(err))
		}
	}
	s, err := a.newSession(ctx)
	if err != nil {
		return err
	}
	// schema.json too: a run refused for a stale schema runs again once
	// `workbench schema` has written it.
	changes, stop, err := watchSources(ctx, filepath.Join(s.kernels.Dir, "kernels_py"),
		[]string{f.experiment, filepath.Join(s.kernels.Dir, schemaFile)}, f.debounce)
	if err != nil {
		return err
	}
	defer stop()
	good := map[string]map[string]results.Record{} // experiment -> job -> its last successful row
	var changed []string
	for iteration := 1; ; iteration++ {
		what := "start"
		if len(changed) > 0 {
			what = strings.Join(changed, ", ")
		}
		fmt.Fprintf(a.stdout, "── watch %s · iteration %d · %s · %s\n", f.experiment, iteration, time.Now().Format("15:04:05"), what)
		if err := a.rerunExperiment(ctx, s, f, good); err != nil {
			if ctx.Err() != nil { // stopped mid-rerun: say what that leaves
				fmt.Fprintf(a.stdout, "stopped while rerunning: the jobs rerun so far are kept in the run under %s; "+
					"the next watch reruns the others\n", f.out)
				return nil
			}
			var se *sourceError
			if errors.As(err, &se) {
				fmt.Fprintf(a.stdout, "ERROR %s\n", se.Format())
				fmt.Fprintln(a.stdout, "no job rerun: the run's rows are kept until the sources import")
			} else {
				fmt.Fprintf(a.stdout, "ERROR %v\n", err)
			}
		}
		fmt.Fprintf(a.stdout, "watching kernels_py/ and %s (Ctrl-C stops)\n", f.experiment)
		select {
		case <-ctx.Done():
			return nil
		case changed = <-changes:
		}
	}
}

// checkSources imports the kernels_py sources in a fresh worker: a
// *sourceError when they do not compile or import, so no job is run on them.
func (a *app) checkSources(ctx context.Context, s *session) error {
	w, err := a.startWorker(ctx, s)
	if err != nil {
		return &sourceError{Message: "the worker did not start: " + firstLine(err.Error())}
	}
	defer w.Close()
	raw, err := w.Run(ctx, worker.Job{Fn: "kernels_py.watch:import_sources"})
	if err != nil {
		return &sourceError{Message: firstLine(err.Error())}
	}
	var se *sourceError
	if err := json.Unmarshal(raw, &se); err != nil {
		return fmt.Errorf("check the sources: unexpected result %.200s", raw)
	}
	if se != nil {
		return se
	}
	return nil
}

// rerunExperiment resumes each experiment of the script, rerunning the jobs
// computed on other sources, and prints the rows whose metrics changed
// against each job's last successful row (good, updated here).
func (a *app) rerunExperiment(ctx context.Context, s *session, f watchFlags, good map[string]map[string]results.Record) error {
	if err := a.checkSources(ctx, s); err != nil {
		return err
	}
	plan, _, err := a.loadPlan(ctx, f.experiment)
	if err != nil {
		return err
	}
	executor := &runner.Local{Python: s.runtime.Python, KernelsRoot: s.kernels.Dir, Device: s.device,
		StartTimeout: a.flags.startTimeout, Log: a.log}
	for _, e := range plan.Experiments {
		var before *compare.Run
		if dir, _ := results.Latest(f.out, e.Name); dir != "" {
			before, _ = compare.Load(dir)
		}
		if good[e.Name] == nil {
			good[e.Name] = map[string]results.Record{}
			if before != nil {
				keepGood(good[e.Name], before.Rows)
			}
		}
		sum, err := runner.Run(ctx, runner.Options{
			Out: f.out, Experiment: e.Name, File: recordedScript(plan.File), FileHash: plan.Hash, Jobs: runnerJobs(plan.Schema, e),
			KernelsDir: s.kernels.Dir, Device: string(s.device), Version: version,
			Resume: true, RetryFailed: true, AllowCodeChange: true, RerunStale: true, StartIfNone: true,
			Executor: executor, Guard: slurm.CheckNoneActive, Progress: a.console, Log: a.log,
		})
		if err != nil {
			return err
		}
		after, err := compare.Load(sum.Dir)
		if err != nil {
			return err
		}
		a.printRerun(e.Name, before, after, good[e.Name])
		keepGood(good[e.Name], after.Rows)
	}
	return nil
}

func keepGood(good map[string]results.Record, rows []results.Record) {
	for _, rec := range rows {
		if rec.Status == results.StatusOK {
			good[rec.JobID] = rec
		}
	}
}

// printRerun compares the rows a rerun replaced with their new versions:
// each with the job's last successful row where it has one, so a save that
// mends a failure is compared with what worked before it.
func (a *app) printRerun(experiment string, before, after *compare.Run, good map[string]results.Record) {
	old := map[string]results.Record{}
	if before != nil {
		for _, rec := range before.Rows {
			old[rec.JobID] = rec
		}
	}
	was, now := &compare.Run{Dir: "before"}, &compare.Run{Dir: "after"}
	fresh := 0
	for _, rec := range after.Rows {
		prev, ok := old[rec.JobID]
		switch {
		case !ok:
			fresh++
		case !prev.Finished.Equal(rec.Finished):
			if g, ok := good[rec.JobID]; ok {
				prev = g
			}
			was.Rows, now.Rows = append(was.Rows, prev), append(now.Rows, rec)
		}
	}
	failed := 0
	for _, rec := range after.Rows {
		if rec.Status != results.StatusOK {
			failed++
		}
	}
	fmt.Fprintf(a.stdout, "%s: %d rows (%d failed) in %s; %d new, %d rerun\n", experiment, len(after.Rows), failed,
		after.Dir, fresh, len(now.Rows))
	if len(now.Rows) == 0 {
		return
	}
	r, err := compare.Compare(was, now, compare.Options{Tolerance: 1e-9})
	if err != nil {
		fmt.Fprintf(a.stdout, "ERROR %v\n", err)
		return
	}
	if r.Changed == 0 {
		fmt.Fprintln(a.stdout, "no metric changed")
		return
	}
	printComparison(a.stdout, r, false, 8)
}
