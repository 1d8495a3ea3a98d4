// Package compare joins the rows of two runs on their jobs' parameters and
// says which metrics changed, by how much, and where the code or the
// script behind a row differs.
package compare

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/vlkv/vlkv/gohost/results"
)

// Run is one run directory's rows (the last record of each job) and manifest.
type Run struct {
	Dir      string
	Manifest results.Manifest
	Rows     []results.Record
	// Writer names the workbench process still writing the run (its
	// run.lock is held): its rows are the jobs finished so far. Empty when none.
	Writer string
}

// Load reads a run directory, merging nothing: what its journal holds, or,
// for a run whose journal lacks jobs its table has (no journal: a run
// copied as its table), its results.parquet.
func Load(dir string) (*Run, error) {
	info, err := os.Stat(dir)
	if os.IsNotExist(err) {
		return nil, fmt.Errorf("run directory %s does not exist: give OUT/<experiment>/<run-id>", dir)
	}
	if err != nil {
		return nil, fmt.Errorf("run directory %s: %w", dir, err)
	}
	if !info.IsDir() {
		return nil, fmt.Errorf("%s is not a run directory", dir)
	}
	recs, err := results.ReadJournal(dir)
	if err != nil {
		return nil, err
	}
	// A journal that lacks jobs its table has (none, or one emptied or cut
	// short: status or a refused resume leaves an empty one in a run copied
	// as its table) gives way to the table, as no rebuild shrinks a table.
	if _, ahead := results.TableAhead(dir, distinctJobs(recs)); ahead {
		if recs, err = results.ReadParquet(dir); err != nil {
			return nil, err
		}
	}
	r := &Run{Dir: dir}
	if h, held := results.Writer(dir); held {
		r.Writer = h.Name()
	}
	data, merr := os.ReadFile(filepath.Join(dir, results.ManifestFile))
	if merr == nil {
		json.Unmarshal(data, &r.Manifest)
	}
	if merr != nil && len(recs) == 0 {
		return nil, fmt.Errorf("%s is not a run directory (no %s, %s or %s): give OUT/<experiment>/<run-id>", dir,
			results.ManifestFile, results.JournalFile, results.ParquetFile)
	}
	if r.Manifest.Experiment == "" && len(recs) > 0 {
		r.Manifest.Experiment = recs[0].Experiment
	}
	last := map[string]int{}
	for i, rec := range recs {
		last[rec.JobID] = i
	}
	for i, rec := range recs {
		if last[rec.JobID] == i {
			r.Rows = append(r.Rows, rec)
		}
	}
	return r, nil
}

// Options say how to join and what counts as a change.
type Options struct {
	// By are the keys rows are joined and grouped on: "method", "workload",
	// a parameter ("budget") or a workload knob ("workload.seed"). Empty:
	// every parameter, except a knob that holds one value in each run and
	// differs between them (the knob the comparison is about).
	By []string
	// Metrics to compare; empty: every metric both runs have.
	Metrics []string
	// Tolerance is the relative difference below which values are equal.
	Tolerance float64
}

// Delta is one metric of one joined row.
type Delta struct {
	Metric   string  `json:"metric"`
	A        float64 `json:"a"`
	B        float64 `json:"-"`         // NaN when B lost the metric (JSON: null)
	Abs      float64 `json:"-"`         // B - A; NaN when B lost the metric (JSON: null)
	Rel      float64 `json:"-"`         // (B - A) / |A|; ±Inf when A is 0 (JSON: null)
	Changed  bool    `json:"changed"`   // beyond the tolerance
	IsTiming bool    `json:"is_timing"` // a time: shown, not counted as a change unless asked for
}

// An OptionError is an option the runs cannot honour (a key or metric they
// do not have, a threshold that can never be passed): the caller's usage error.
type OptionError struct{ Err error }

func (e *OptionError) Error() string { return e.Err.Error() }
func (e *OptionError) Unwrap() error { return e.Err }

// MarshalJSON writes b, abs and rel as null where they are not finite (A
// was 0, or B lost the metric): JSON has no NaN or Inf.
func (d Delta) MarshalJSON() ([]byte, error) {
	type plain Delta
	finite := func(x float64) *float64 {
		if math.IsInf(x, 0) || math.IsNaN(x) {
			return nil
		}
		return &x
	}
	return json.Marshal(struct {
		plain
		B   *float64 `json:"b"`
		Abs *float64 `json:"abs"`
		Rel *float64 `json:"rel"`
	}{plain(d), finite(d.B), finite(d.Abs), finite(d.Rel)})
}

// Row is one join key's rows in both runs.
type Row struct {
	Key string `json:"key"`
	// Params are the key's values as the jobs hold them ("budget": 0.5); a
	// key a row lacks (--by) is null.
	Params        map[string]any `json:"params"`
	A, B          int            `json:"-"` // rows of each run under this key (several are averaged)
	Deltas        []Delta        `json:"deltas"`
	Changed       bool           `json:"changed"`
	KernelsDiffer bool           `json:"kernels_differ"`
	StatusA       string         `json:"status_a"`
	StatusB       string         `json:"status_b"`
	// ErrorA and ErrorB are the first error of a side whose status is not
	// ok: why a job that worked now fails.
	ErrorA string `json:"error_a,omitempty"`
	ErrorB string `json:"error_b,omitempty"`
}

// Report is the comparison of two runs.
type Report struct {
	A, B          string   `json:"-"`
	RunA          string   `json:"run_a"`
	RunB          string   `json:"run_b"`
	Keys          []string `json:"keys"`
	Varied        []string `json:"varied"`   // knobs left out of the join: "name: a -> b"
	Warnings      []string `json:"warnings"` // different experiments, different scripts
	ScriptsDiffer bool     `json:"scripts_differ"`
	Metrics       []string `json:"metrics"`
	Rows          []Row    `json:"rows"`   // joined keys, in key order
	OnlyA         []string `json:"only_a"` // keys with rows in A only
	OnlyB         []string `json:"only_b"` // keys with rows in B only
	// OnlyAParams and OnlyBParams are those keys' values, as Row.Params.
	OnlyAParams []map[string]any `json:"only_a_params"`
	OnlyBParams []map[string]any `json:"only_b_params"`
	// OnlyAStatus and OnlyBStatus are those keys' statuses, as Row.StatusA.
	OnlyAStatus []string `json:"only_a_status"`
	OnlyBStatus []string `json:"only_b_status"`
	Changed     int      `json:"changed"` // joined rows with a changed metric
}

// timing says whether a metric is a time, which differs run to run.
func timing(metric string) bool {
	for _, suffix := range []string{"_seconds", "_ms", "_us", "_time"} {
		if strings.HasSuffix(metric, suffix) {
			return true
		}
	}
	return false
}

// field is one joinable value of a row: method, workload, a parameter or a
// workload knob.
func fields(rec results.Record) map[string]string {
	f := map[string]string{"method": rec.Method}
	wl := rec.WorkloadName
	if wl == "" {
		wl = "synthetic"
	}
	f["workload"] = wl
	for k, v := range rec.Params {
		f[k] = format(v)
	}
	for k, v := range rec.Workload {
		f["workload."+k] = format(v)
	}
	return f
}

// values are fields' values as the record holds them.
func values(rec results.Record) map[string]any {
	v := map[string]any{}
	for k, x := range rec.Params {
		v[k] = x
	}
	for k, x := range rec.Workload {
		v["workload."+k] = x
	}
	f := fields(rec)
	v["method"], v["workload"] = f["method"], f["workload"]
	return v
}

// params are a key's values in rec (nil where rec lacks one).
func params(rec results.Record, keys []string) map[string]any {
	v := values(rec)
	out := make(map[string]any, len(keys))
	for _, k := range keys {
		out[k] = v[k]
	}
	return out
}

func format(v any) string {
	switch x := v.(type) {
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	case string:
		return x
	}
	data, _ := json.Marshal(v)
	return string(data)
}

// Compare joins a and b.
func Compare(a, b *Run, o Options) (*Report, error) {
	r := &Report{A: a.Dir, B: b.Dir, RunA: a.Dir, RunB: b.Dir}
	if a.Manifest.Experiment != b.Manifest.Experiment {
		r.Warnings = append(r.Warnings, fmt.Sprintf("the runs are of different experiments (%s, %s): rows are joined "+
			"on their parameters", a.Manifest.Experiment, b.Manifest.Experiment))
	}
	if a.Manifest.FileHash != "" && b.Manifest.FileHash != "" && a.Manifest.FileHash != b.Manifest.FileHash {
		r.ScriptsDiffer = true
		r.Warnings = append(r.Warnings, fmt.Sprintf("the experiment scripts differ (sha256 %.12s, %.12s)",
			a.Manifest.FileHash, b.Manifest.FileHash))
	}
	for _, run := range []*Run{a, b} {
		if run.Writer != "" {
			r.Warnings = append(r.Warnings, fmt.Sprintf("%s is being written by %s: comparing the jobs it has finished so far",
				run.Dir, run.Writer))
		}
	}
	fa, fb := make([]map[string]string, len(a.Rows)), make([]map[string]string, len(b.Rows))
	for i, rec := range a.Rows {
		fa[i] = fields(rec)
	}
	for i, rec := range b.Rows {
		fb[i] = fields(rec)
	}
	keys, varied, skip, err := joinKeys(a, b, fa, fb, o.By)
	if err != nil {
		return nil, err
	}
	r.Varied = varied
	r.Keys = keys
	if len(o.By) == 0 {
		// Keys that hold one value in every row of both runs split nothing: the
		// rows are told apart, and shown, by the others.
		r.Keys = distinguishing(keys, append(append([]map[string]string{}, fa...), fb...))
		keys = r.Keys
	}
	metrics, err := chooseMetrics(a, b, o.Metrics)
	if err != nil {
		return nil, err
	}
	r.Metrics = metrics
	asked := map[string]bool{}
	for _, m := range o.Metrics {
		asked[m] = true
	}
	explicit := len(o.By) > 0
	groupA, groupB := group(a.Rows, fa, keys, skip, explicit), group(b.Rows, fb, keys, skip, explicit)
	var all []string
	for k := range groupA {
		all = append(all, k)
	}
	for k := range groupB {
		if _, ok := groupA[k]; !ok {
			all = append(all, k)
		}
	}
	sort.Strings(all)
	for _, k := range all {
		ra, rb := groupA[k], groupB[k]
		switch {
		case len(ra) == 0:
			r.OnlyB = append(r.OnlyB, k)
			r.OnlyBParams = append(r.OnlyBParams, params(rb[0], keys))
			r.OnlyBStatus = append(r.OnlyBStatus, status(rb))
			continue
		case len(rb) == 0:
			r.OnlyA = append(r.OnlyA, k)
			r.OnlyAParams = append(r.OnlyAParams, params(ra[0], keys))
			r.OnlyAStatus = append(r.OnlyAStatus, status(ra))
			continue
		}
		row := Row{Key: k, Params: params(ra[0], keys), A: len(ra), B: len(rb), StatusA: status(ra), StatusB: status(rb),
			ErrorA: firstError(ra), ErrorB: firstError(rb)}
		row.KernelsDiffer = digests(ra) != digests(rb)
		for _, m := range metrics {
			va, oka := mean(ra, m)
			vb, okb := mean(rb, m)
			// A metric a job that succeeded in both runs lost in B (a worker
			// writes NaN as null) is a change, not a blank: dropping it would
			// let a guard on it pass.
			lost := oka && !okb && row.StatusA == results.StatusOK && row.StatusB == results.StatusOK
			if !lost && (!oka || !okb) {
				continue
			}
			if lost {
				vb = math.NaN()
			}
			d := Delta{Metric: m, A: va, B: vb, Abs: vb - va, IsTiming: timing(m) && !asked[m]}
			d.Rel = relative(va, vb)
			d.Changed = lost || !equal(va, vb, o.Tolerance)
			if d.Changed && !d.IsTiming {
				row.Changed = true
			}
			row.Deltas = append(row.Deltas, d)
		}
		if row.StatusA != row.StatusB {
			row.Changed = true
		}
		if row.Changed {
			r.Changed++
		}
		row.Deltas = nonNil(row.Deltas)
		r.Rows = append(r.Rows, row)
	}
	// JSON readers (and kernels_py.runs.compare_runs) expect lists, not null.
	r.Keys, r.Varied, r.Warnings, r.Metrics = nonNil(r.Keys), nonNil(r.Varied), nonNil(r.Warnings), nonNil(r.Metrics)
	r.Rows, r.OnlyA, r.OnlyB = nonNil(r.Rows), nonNil(r.OnlyA), nonNil(r.OnlyB)
	r.OnlyAParams, r.OnlyBParams = nonNil(r.OnlyAParams), nonNil(r.OnlyBParams)
	r.OnlyAStatus, r.OnlyBStatus = nonNil(r.OnlyAStatus), nonNil(r.OnlyBStatus)
	return r, nil
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// joinKeys are the fields rows are joined on; varied lists the knobs left
// out because each run holds one value of them and the values differ; skip
// the knobs left out of one kind of row's key (kindOf: a method on a
// workload) because that kind has them in one run and not in the other.
func joinKeys(a, b *Run, fa, fb []map[string]string, by []string) ([]string, []string, map[string]map[string]bool, error) {
	knobsA, knobsB := knobsOfKinds(fa), knobsOfKinds(fb)
	inA, inB := allKnobs(fa), allKnobs(fb)
	// --by takes a parameter of both runs' rows. A run with no rows (stopped
	// before its first job) has none to offer: the other's serve.
	shared := map[string]bool{}
	for k := range inA {
		if len(fb) == 0 || inB[k] {
			shared[k] = true
		}
	}
	if len(fa) == 0 {
		shared = inB
	}
	// Rows join on every knob they have, so that the rows of a method only
	// one run holds are told apart by their own knobs, except a knob that a
	// kind of row has in one run and not in the other (a knob added between
	// the runs' versions): on it no row of that kind would join, so that
	// kind's rows join without it (other kinds' rows still on it).
	common := maps.Clone(inA)
	maps.Copy(common, inB)
	skip := map[string]map[string]bool{}
	for kind, ka := range knobsA {
		kb, ok := knobsB[kind]
		if !ok {
			continue
		}
		for k := range common {
			if ka[k] != kb[k] {
				if skip[kind] == nil {
					skip[kind] = map[string]bool{}
				}
				skip[kind][k] = true
			}
		}
	}
	if len(by) > 0 {
		var keys []string
		seen := map[string]bool{}
		for _, k := range by {
			if !shared[k] {
				return nil, nil, nil, &OptionError{fmt.Errorf("--by %s: not a parameter of both runs%s; they share: %s", k,
					keyColumnHint(k, shared), strings.Join(sorted(shared), ", "))}
			}
			if !seen[k] {
				seen[k] = true
				keys = append(keys, k)
			}
		}
		return keys, nil, nil, nil
	}
	// A knob is left out of the key when, among the rows of each method that
	// have it, it holds one value per run and the two differ.
	var keys, varied []string
	for _, k := range sorted(common) {
		if k == "method" {
			keys = append(keys, k)
			continue
		}
		if v, ok := variedKnob(k, fa, fb); ok {
			varied = append(varied, v)
			continue
		}
		keys = append(keys, k)
	}
	return keys, varied, skip, nil
}

// knobsOfKinds is the fields the rows of each kind (a method on a
// workload) have.
func knobsOfKinds(fs []map[string]string) map[string]map[string]bool {
	out := map[string]map[string]bool{}
	for _, f := range fs {
		kind := kindOf(f)
		if out[kind] == nil {
			out[kind] = map[string]bool{}
		}
		for k := range f {
			out[kind][k] = true
		}
	}
	return out
}

// kindOf is the kind of a row: its method on its workload.
func kindOf(f map[string]string) string { return f["method"] + " on " + f["workload"] }

// allKnobs is the fields any row has.
func allKnobs(fs []map[string]string) map[string]bool {
	out := map[string]bool{}
	for _, f := range fs {
		for k := range f {
			out[k] = true
		}
	}
	return out
}

func variedKnob(k string, fa, fb []map[string]string) (string, bool) {
	values := func(fs []map[string]string) map[string]map[string]bool { // method -> values of k
		out := map[string]map[string]bool{}
		for _, f := range fs {
			if v, ok := f[k]; ok {
				if out[f["method"]] == nil {
					out[f["method"]] = map[string]bool{}
				}
				out[f["method"]][v] = true
			}
		}
		return out
	}
	va, vb := values(fa), values(fb)
	changes := map[string][]string{} // "a -> b" -> methods
	for _, method := range sorted(va) {
		as, bs := va[method], vb[method]
		if bs == nil {
			continue
		}
		if len(as) != 1 || len(bs) != 1 {
			return "", false
		}
		x, y := sorted(as)[0], sorted(bs)[0]
		if x != y {
			change := x + " -> " + y
			changes[change] = append(changes[change], method)
		}
	}
	if len(changes) == 0 {
		return "", false
	}
	var parts []string
	for _, change := range sorted(changes) {
		parts = append(parts, fmt.Sprintf("%s: %s (%s)", k, change, strings.Join(changes[change], ", ")))
	}
	return strings.Join(parts, "; "), true
}

func chooseMetrics(a, b *Run, asked []string) ([]string, error) {
	inA, both := map[string]bool{}, map[string]bool{}
	for _, rec := range a.Rows {
		for m := range rec.Metrics {
			inA[m] = true
		}
	}
	for _, rec := range b.Rows {
		for m := range rec.Metrics {
			if inA[m] || len(a.Rows) == 0 {
				both[m] = true
			}
		}
	}
	if len(b.Rows) == 0 { // as in joinKeys: the side with rows names them
		both = inA
	}
	if len(asked) == 0 {
		return sorted(both), nil
	}
	for _, m := range asked {
		if !both[m] {
			return nil, &OptionError{fmt.Errorf("unknown metric %q%s: the runs share %s", m, tablePrefix(m, both),
				strings.Join(sorted(both), ", "))}
		}
	}
	return asked, nil
}

// tablePrefix is a hint for a metric named as results.parquet's column
// ("metric_rel_err_mean"), where the runs have the metric: "" otherwise.
func tablePrefix(name string, metrics map[string]bool) string {
	if bare, ok := strings.CutPrefix(name, "metric_"); ok && metrics[bare] {
		return fmt.Sprintf(" (metrics go by their own names: %s, not results.parquet's column %s)", bare, name)
	}
	return ""
}

// keyColumnHint is a hint for a key named as results.parquet's column
// ("param_budget", "workload_seed"), where the runs share the key: ""
// otherwise.
func keyColumnHint(name string, shared map[string]bool) string {
	key := ""
	if bare, ok := strings.CutPrefix(name, "param_"); ok {
		key = bare
	} else if bare, ok := strings.CutPrefix(name, "workload_"); ok {
		key = "workload." + bare
	}
	if key == "" || !shared[key] {
		return ""
	}
	return fmt.Sprintf(" (keys go by the knobs' names: %s, not results.parquet's column %s)", key, name)
}

func setOf(names []string) map[string]bool {
	out := make(map[string]bool, len(names))
	for _, n := range names {
		out[n] = true
	}
	return out
}

// distinguishing keeps the keys with more than one value among the rows
// that have them (always the method).
func distinguishing(keys []string, fs []map[string]string) []string {
	var out []string
	for _, k := range keys {
		values := map[string]bool{}
		for _, f := range fs {
			if v, ok := f[k]; ok {
				values[v] = true
			}
		}
		if k == "method" || len(values) > 1 {
			out = append(out, k)
		}
	}
	return out
}

func group(rows []results.Record, fs []map[string]string, keys []string, skip map[string]map[string]bool,
	explicit bool) map[string][]results.Record {
	out := map[string][]results.Record{}
	for i, rec := range rows {
		var parts []string
		skipped := skip[kindOf(fs[i])]
		for _, k := range keys {
			v, ok := fs[i][k]
			switch {
			case skipped[k]:
			case ok:
				parts = append(parts, k+"="+v)
			case explicit: // a key the user asked to join on: a row without it says so
				parts = append(parts, k+"=-")
			}
		}
		key := strings.Join(parts, " ")
		out[key] = append(out[key], rec)
	}
	return out
}

func mean(rows []results.Record, metric string) (float64, bool) {
	sum, n := 0.0, 0
	for _, rec := range rows {
		if v, ok := rec.Metrics[metric].(float64); ok {
			sum += v
			n++
		}
	}
	if n == 0 {
		return 0, false
	}
	return sum / float64(n), true
}

func status(rows []results.Record) string {
	for _, rec := range rows {
		if rec.Status != results.StatusOK {
			return rec.Status
		}
	}
	return results.StatusOK
}

// firstError is the error of the first row that is not ok, "" if none.
func firstError(rows []results.Record) string {
	for _, rec := range rows {
		if rec.Status != results.StatusOK {
			return rec.Error
		}
	}
	return ""
}

func digests(rows []results.Record) string {
	var ds []string
	for _, rec := range rows {
		ds = append(ds, rec.KernelsDigest)
	}
	sort.Strings(ds)
	return strings.Join(ds, ",")
}

func relative(a, b float64) float64 {
	switch {
	case a == b:
		return 0
	case a == 0:
		return math.Copysign(math.Inf(1), b)
	}
	return (b - a) / math.Abs(a)
}

func equal(a, b, tol float64) bool {
	if a == b || (math.IsNaN(a) && math.IsNaN(b)) {
		return true
	}
	return math.Abs(b-a) <= tol*math.Max(math.Abs(a), math.Abs(b))
}

func sorted[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Guard is one --fail-if condition: METRIC>X or METRIC<X on the change
// B - A, absolute or, with a trailing %, relative.
type Guard struct {
	Metric    string
	Greater   bool
	Threshold float64
	Relative  bool
	Text      string
}

// ParseGuard reads "rel_err_mean>0.01", "compression_ratio<-5%".
func ParseGuard(s string) (Guard, error) {
	g := Guard{Text: s}
	i := strings.IndexAny(s, "<>")
	if i > 0 && i+1 < len(s) && s[i+1] == '=' {
		return g, fmt.Errorf("--fail-if %q: only > and < are supported (the change from A to B passing X)", s)
	}
	if i <= 0 {
		return g, fmt.Errorf("--fail-if %q: want METRIC>X or METRIC<X (the change from A to B; X%% for a relative one), "+
			"e.g. rel_err_mean>0.01 or compression_ratio<-5%%", s)
	}
	g.Metric, g.Greater = strings.TrimSpace(s[:i]), s[i] == '>'
	value := strings.TrimSpace(s[i+1:])
	if strings.HasSuffix(value, "%") {
		g.Relative, value = true, strings.TrimSuffix(value, "%")
	}
	x, err := strconv.ParseFloat(value, 64)
	if err != nil {
		return g, fmt.Errorf("--fail-if %q: %q is not a number", s, value)
	}
	if math.IsNaN(x) || math.IsInf(x, 0) { // no change passes them: the guard could never fire
		return g, fmt.Errorf("--fail-if %q: the threshold must be a finite number", s)
	}
	g.Threshold = x
	if g.Relative {
		g.Threshold /= 100
	}
	return g, nil
}

// Failures lists what breaks the guards: each job that succeeded in A and
// failed or is missing in B, once whatever the number of guards (a guard
// guards nothing if B may fail a job or drop it), then each guard's
// violations, prefixed with the guard.
func (r *Report) Failures(guards []Guard) ([]string, error) {
	var out []string
	for _, g := range guards {
		v, err := r.Violations(g)
		if err != nil {
			return nil, err
		}
		for _, line := range v {
			out = append(out, g.Text+": "+line)
		}
	}
	if len(guards) == 0 {
		return nil, nil
	}
	return append(r.Lost(), out...), nil
}

// Lost lists the jobs that succeeded in A and failed or are missing in B. A
// job that had failed in A already is no regression of B's.
func (r *Report) Lost() []string {
	var out []string
	for _, row := range r.Rows {
		if row.StatusA == results.StatusOK && row.StatusB != results.StatusOK {
			out = append(out, fmt.Sprintf("%s: ok in A, %s in B", row.Key, row.StatusB))
		}
	}
	for i, k := range r.OnlyA {
		if i < len(r.OnlyAStatus) && r.OnlyAStatus[i] == results.StatusOK {
			out = append(out, fmt.Sprintf("%s: ok in A, missing from B", k))
		}
	}
	return out
}

// Violations lists the joined rows whose change in g's metric breaks g; a
// metric B lost (NaN) breaks any guard on it. Jobs B failed or dropped are
// Lost's.
func (r *Report) Violations(g Guard) ([]string, error) {
	known := false
	for _, m := range r.Metrics {
		known = known || m == g.Metric
	}
	if !known {
		return nil, &OptionError{fmt.Errorf("--fail-if %s: metric %q is not compared%s: the comparison holds %s (add a "+
			"metric the runs share to --metrics, or check its name)", g.Text, g.Metric,
			tablePrefix(g.Metric, setOf(r.Metrics)), strings.Join(r.Metrics, ", "))}
	}
	var out []string
	for _, row := range r.Rows {
		for _, d := range row.Deltas {
			if d.Metric != g.Metric {
				continue
			}
			change := d.Abs
			if g.Relative {
				change = d.Rel
			}
			if math.IsNaN(d.B) || (g.Greater && change > g.Threshold) || (!g.Greater && change < g.Threshold) {
				out = append(out, fmt.Sprintf("%s: %s %g -> %g", row.Key, d.Metric, d.A, d.B))
			}
		}
	}
	return out, nil
}

// distinctJobs counts the jobs records name.
func distinctJobs(recs []results.Record) int {
	ids := map[string]bool{}
	for _, r := range recs {
		ids[r.JobID] = true
	}
	return len(ids)
}
