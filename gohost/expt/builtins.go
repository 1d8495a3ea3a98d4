package expt

import (
	"fmt"
	"maps"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.starlark.net/starlark"
)

// nameRE is what an experiment name must look like: it becomes part of
// result paths and job ids, so it stays filesystem- and shell-safe.
var nameRE = regexp.MustCompile(`^[a-z0-9_-]+$`)

// maxTimeoutSeconds keeps timeout*time.Second inside a time.Duration.
const maxTimeoutSeconds = math.MaxInt64 / int64(time.Second)

var experimentArgs = []string{"doc", "extra", "grid", "methods", "name", "protocol", "timeout", "workloads"}

// keywords collects a built-in's keyword arguments, refusing unknown and
// repeated names (a built-in, unlike a def, gets no such check for free).
func (l *loader) keywords(thread *starlark.Thread, fn string, kwargs []starlark.Tuple, known []string) (map[string]starlark.Value, error) {
	kw := make(map[string]starlark.Value, len(kwargs))
	for _, kv := range kwargs {
		name := string(kv[0].(starlark.String))
		if known != nil && !slices.Contains(known, name) {
			return nil, l.pos.errorf(thread, path{name}, "%s: unknown argument %q (known: %s)", fn, name, strings.Join(known, ", "))
		}
		if _, dup := kw[name]; dup {
			return nil, l.pos.errorf(thread, path{name}, "%s: argument %q given twice", fn, name)
		}
		kw[name] = kv[1]
	}
	return kw, nil
}

// asList returns the elements of a list, tuple or range. Strings are
// iterable in Python but never meant as a list of values here.
func asList(v starlark.Value) ([]starlark.Value, bool) {
	switch v.(type) {
	case starlark.String, starlark.Bytes:
		return nil, false
	}
	x, ok := v.(starlark.Indexable)
	if !ok {
		return nil, false
	}
	out := make([]starlark.Value, x.Len())
	for i := range out {
		out[i] = x.Index(i)
	}
	return out, true
}

// known lists names for an error message.
func known(names []string) string {
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ", ")
}

// UnknownName says that name is not among names, suggesting the closest one.
func UnknownName(name string, names []string) string {
	return fmt.Sprintf("%q is unknown%s (known: %s)", name, Closest(name, names), known(names))
}

// workload([name or workload], **params) returns a complete, checked
// workload value of the registered workload name (default: the schema's
// default workload), or of another workload value's kind with its knobs as
// the starting point: workload(wl, seed=1) is wl with another seed.
func (l *loader) workload(thread *starlark.Thread, _ *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	kind := l.schema.DefaultWorkload
	if len(args) > 1 {
		return nil, l.pos.errorf(thread, nil, `workload: takes the workload's name and keyword arguments, e.g. workload("%s", seed=0)`, kind)
	}
	var base map[string]any
	if len(args) == 1 {
		switch x := args[0].(type) {
		case starlark.String:
			kind = string(x)
			if _, ok := l.schema.Workloads[kind]; !ok {
				return nil, l.pos.errorf(thread, path{0}, "workload: %s", UnknownName(kind, l.schema.WorkloadNames()))
			}
		case *workloadValue:
			kind, base = x.name, x.values()
		default:
			return nil, l.pos.errorf(thread, path{0}, `workload: the first argument names the workload (str) or is a workload to start from, got %s %s; knobs are keyword arguments, e.g. workload("%s", seed=0)`, args[0].Type(), shortRepr(args[0]), kind)
		}
	}
	kw, err := l.keywords(thread, "workload", kwargs, nil)
	if err != nil {
		return nil, err
	}
	params := l.schema.Workloads[kind].Params
	vals := params.Defaults()
	if base != nil {
		vals = base
	}
	for _, kv := range kwargs {
		name := string(kv[0].(starlark.String))
		p, ok := params[name]
		if !ok {
			return nil, l.pos.errorf(thread, path{name}, "workload: param %s", UnknownName(name, params.Names()))
		}
		for from, how := range l.schema.Workloads[kind].Expand {
			if how == "index:"+name { // the plan sets it in each job it spreads the workload over
				return nil, l.pos.errorf(thread, path{name}, "workload: param %q is set by the plan from %s (one job for each of 0..%s-1): leave it out", name, from, from)
			}
		}
		v, err := checkValue(p, kw[name])
		if err != nil {
			return nil, l.pos.errorf(thread, path{name}, "workload: param %q: %v (%s: %s)", name, err, name, p.Describe())
		}
		vals[name] = v
	}
	msg, err := l.schema.Workloads[kind].Rules.Violated(vals)
	if err != nil {
		return nil, l.pos.errorf(thread, nil, "workload %q: %v", kind, err)
	}
	if msg != "" {
		return nil, l.pos.errorf(thread, nil, "workload %q: %s", kind, msg)
	}
	return newWorkloadValue(kind, vals), nil
}

// grid(**lists) returns {name: list} in argument order: a way to write a
// grid without quoting the names.
func (l *loader) grid(thread *starlark.Thread, _ *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	if len(args) > 0 {
		return nil, l.pos.errorf(thread, nil, "grid: takes keyword arguments only, e.g. grid(budget=[0.1, 0.5])")
	}
	if _, err := l.keywords(thread, "grid", kwargs, nil); err != nil {
		return nil, err
	}
	d := starlark.NewDict(len(kwargs))
	for _, kv := range kwargs {
		if _, ok := asList(kv[1]); !ok {
			return nil, l.pos.errorf(thread, path{string(kv[0].(starlark.String))}, "grid: %q: want a list of values, got %s %s", string(kv[0].(starlark.String)), kv[1].Type(), shortRepr(kv[1]))
		}
		if err := d.SetKey(kv[0], kv[1]); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// product(*lists) returns the cartesian product as a list of tuples, the
// first list varying slowest (itertools.product); product(**lists)
// returns it as a list of dicts, handy for extra points.
func (l *loader) product(thread *starlark.Thread, _ *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	if len(args) > 0 && len(kwargs) > 0 {
		return nil, l.pos.errorf(thread, nil, "product: give the lists either all positionally (tuples) or all by keyword (dicts)")
	}
	if len(args) == 0 && len(kwargs) == 0 {
		return nil, l.pos.errorf(thread, nil, "product: needs at least one list")
	}
	if _, err := l.keywords(thread, "product", kwargs, nil); err != nil {
		return nil, err
	}
	var keys []starlark.Value
	var lists [][]starlark.Value
	add := func(at any, v starlark.Value) error {
		xs, ok := asList(v)
		if !ok {
			return l.pos.errorf(thread, path{at}, "product: want lists, got %s %s", v.Type(), shortRepr(v))
		}
		lists = append(lists, xs)
		return nil
	}
	for i, a := range args {
		if err := add(i, a); err != nil {
			return nil, err
		}
	}
	for _, kv := range kwargs {
		keys = append(keys, kv[0])
		if err := add(string(kv[0].(starlark.String)), kv[1]); err != nil {
			return nil, err
		}
	}
	sizes := make([]int, len(lists))
	for i, xs := range lists {
		sizes[i] = len(xs)
	}
	if n := productSize(sizes); n > MaxJobs {
		return nil, l.pos.errorf(thread, nil, "product: %d combinations, more than the limit of %d", n, MaxJobs)
	}
	var out []starlark.Value
	for combo := range combos(sizes) {
		if keys == nil {
			t := make(starlark.Tuple, len(combo))
			for i, j := range combo {
				t[i] = lists[i][j]
			}
			out = append(out, t)
			continue
		}
		d := starlark.NewDict(len(keys))
		for i, j := range combo {
			if err := d.SetKey(keys[i], lists[i][j]); err != nil {
				return nil, err
			}
		}
		out = append(out, d)
	}
	return starlark.NewList(out), nil
}

// productSize multiplies sizes, saturating just above MaxJobs so that a
// huge product cannot overflow into a small number.
func productSize(sizes []int) int {
	n := 1
	for _, s := range sizes {
		if s == 0 {
			return 0
		}
		n *= s
		if n > MaxJobs {
			return MaxJobs + 1
		}
	}
	return n
}

// combos yields every index tuple into lists of the given sizes, the last
// index varying fastest. No sizes yields one empty tuple; the slice is
// reused between iterations.
func combos(sizes []int) func(yield func([]int) bool) {
	return func(yield func([]int) bool) {
		for _, s := range sizes {
			if s == 0 {
				return
			}
		}
		idx := make([]int, len(sizes))
		for {
			if !yield(idx) {
				return
			}
			i := len(idx) - 1
			for ; i >= 0; i-- {
				idx[i]++
				if idx[i] < sizes[i] {
					break
				}
				idx[i] = 0
			}
			if i < 0 {
				return
			}
		}
	}
}

// axis is one grid parameter as a given method sees it: values already
// checked and converted against that method's declaration.
type axis struct {
	name   string
	values []any
}

// point is one extra job before it gets an id.
type point struct {
	method   *Method
	params   map[string]any
	workload *workloadValue
}

// experiment(name, methods, grid, workloads, extra, timeout, doc) checks
// its arguments and appends the expanded experiment to the plan.
func (l *loader) experiment(thread *starlark.Thread, _ *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	if len(args) > 0 {
		return nil, l.pos.errorf(thread, nil, `experiment: takes keyword arguments only, e.g. experiment(name="q", methods=["full"])`)
	}
	kwargs, err := l.renameOld(thread, kwargs)
	if err != nil {
		return nil, err
	}
	kw, err := l.keywords(thread, "experiment", kwargs, experimentArgs)
	if err != nil {
		return nil, err
	}
	here := l.pos.locate(l.pos.callPos(thread), nil).String()

	nv, ok := kw["name"]
	if !ok {
		return nil, l.pos.errorf(thread, nil, "experiment: name is required")
	}
	ns, ok := nv.(starlark.String)
	if !ok {
		return nil, l.pos.errorf(thread, path{"name"}, "experiment: name: want str, got %s %s", nv.Type(), shortRepr(nv))
	}
	name := string(ns)
	// fail reports a problem with this experiment, prefixed by its name.
	fail := func(at path, format string, args ...any) error {
		return l.pos.errorf(thread, at, "experiment %q: "+format, append([]any{name}, args...)...)
	}
	if !nameRE.MatchString(name) {
		return nil, fail(path{"name"}, "name must match [a-z0-9_-]+")
	}
	if prev, dup := l.names[name]; dup {
		return nil, fail(path{"name"}, "name already used by the experiment at %s", prev)
	}

	methods, err := l.methods(kw, fail)
	if err != nil {
		return nil, err
	}
	protocol, err := l.protocol(kw, fail)
	if err != nil {
		return nil, err
	}
	workloads, err := l.workloads(kw, fail)
	if err != nil {
		return nil, err
	}
	var jobWorkloads []*workloadValue // one per job a workload spreads over (tasks, shards)
	for _, w := range workloads {
		jobWorkloads = append(jobWorkloads, l.schema.expand(w)...)
	}
	axes, err := l.gridAxes(kw, methods, fail)
	if err != nil {
		return nil, err
	}
	warn := func(at path, format string, args ...any) {
		l.warn(thread, at, "experiment %q: "+format, append([]any{name}, args...)...)
	}
	extras, err := l.extras(kw, workloads[0], protocol, fail, warn)
	if err != nil {
		return nil, err
	}
	if err := l.checkRunnable(methods, workloads, extras, fail); err != nil {
		return nil, err
	}

	e := Experiment{Name: name, Pos: here, Timeout: DefaultTimeout, Protocol: protocol}
	if v, ok := kw["timeout"]; ok {
		i, ok := v.(starlark.Int)
		if !ok {
			return nil, fail(path{"timeout"}, "timeout: want whole seconds (int), got %s %s", v.Type(), shortRepr(v))
		}
		n, ok := i.Int64()
		if !ok || n <= 0 || n > maxTimeoutSeconds {
			return nil, fail(path{"timeout"}, "timeout: %s seconds is out of range (want 1 to %d)", i, maxTimeoutSeconds)
		}
		e.Timeout = time.Duration(n) * time.Second
	}
	if v, ok := kw["doc"]; ok {
		s, ok := v.(starlark.String)
		if !ok {
			return nil, fail(path{"doc"}, "doc: want str, got %s %s", v.Type(), shortRepr(v))
		}
		e.Doc = string(s)
	}

	// Count before building anything, so a runaway grid fails fast.
	n := 0
	for _, p := range extras {
		n += len(l.schema.expand(p.workload))
	}
	for _, m := range methods {
		sizes := make([]int, len(axes[m.Name]))
		for i, a := range axes[m.Name] {
			sizes[i] = len(a.values)
		}
		n += productSize(sizes) * len(jobWorkloads)
		if l.jobs+n > MaxJobs {
			return nil, fail(nil, "expands to more than %d jobs in this plan (the limit)", MaxJobs)
		}
	}

	seen := make(map[string]bool, n)
	var repeated []string // the grid's jobs spelt more than once, as "method with k=v"
	repeatedIDs := map[string]bool{}
	add := func(m *Method, params map[string]any, w *workloadValue, inGrid bool) {
		j := Job{Experiment: name, Method: m.Name, Params: params, WorkloadName: w.name, Workload: w.values(), Timeout: e.Timeout}
		j.OutOfID = append(defaultsOutOfID("params.", m.Params, j.Params),
			defaultsOutOfID("workload.", l.schema.Workloads[w.name].Params, j.Workload)...)
		j.ID = j.ComputeID()
		if !seen[j.ID] {
			seen[j.ID] = true
			e.Jobs = append(e.Jobs, j)
			return
		}
		// The same job spelt twice: first wins. An extra the grid or another
		// extra holds is usually meant (lists of figures sharing points); a
		// grid that makes a job twice repeats a value or a workload, and
		// the plan says which.
		if inGrid && !repeatedIDs[j.ID] {
			repeatedIDs[j.ID] = true
			at := gridPoint(m.Params, params, "")
			if at == "" {
				at = " at its defaults"
			}
			repeated = append(repeated, m.Name+at)
		}
	}
	for _, w := range jobWorkloads {
		for _, m := range methods {
			ax := axes[m.Name]
			sizes := make([]int, len(ax))
			for i, a := range ax {
				sizes[i] = len(a.values)
			}
			for combo := range combos(sizes) {
				params := m.Params.Defaults()
				maps.Copy(params, m.ProtocolParams(protocol))
				for i, j := range combo {
					params[ax[i].name] = ax[i].values[j]
				}
				if msg, err := m.Violated(params); err != nil || msg != "" {
					return nil, fail(path{"grid"}, "method %q%s: %s", m.Name, gridPoint(m.Params, params, msg), ruleError(msg, err))
				}
				add(m, params, w, true)
			}
		}
	}
	for _, p := range extras {
		for _, w := range l.schema.expand(p.workload) {
			add(p.method, p.params, w, false)
		}
	}

	if len(repeated) > 0 {
		shown := repeated[:min(len(repeated), 3)]
		more := ""
		if len(repeated) > len(shown) {
			more = fmt.Sprintf(", and %d more", len(repeated)-len(shown))
		}
		what := "its grid and workloads make a job more than once (a repeated value, or two workloads alike), planned once"
		if len(repeated) > 1 {
			what = fmt.Sprintf("its grid and workloads make %d jobs more than once (a repeated value, or two workloads "+
				"alike), each planned once", len(repeated))
		}
		l.warn(thread, nil, "experiment %q: %s: %s%s", name, what, strings.Join(shown, "; "), more)
	}
	l.names[name] = here
	l.jobs += n
	l.plan.Experiments = append(l.plan.Experiments, e)
	return starlark.None, nil
}

// renameOld reads experiment(policies=...), the old word for methods, as
// methods=..., with a warning.
func (l *loader) renameOld(thread *starlark.Thread, kwargs []starlark.Tuple) ([]starlark.Tuple, error) {
	out := make([]starlark.Tuple, len(kwargs))
	for i, kv := range kwargs {
		out[i] = kv
		if string(kv[0].(starlark.String)) != "policies" {
			continue
		}
		for _, other := range kwargs {
			if string(other[0].(starlark.String)) == "methods" {
				return nil, l.pos.errorf(thread, path{"policies"}, "experiment: give methods only (policies is its old name)")
			}
		}
		l.warn(thread, path{"policies"}, `experiment: "policies" is the old word for methods; write methods=[...]`)
		out[i] = starlark.Tuple{starlark.String("methods"), kv[1]}
	}
	return out, nil
}

type (
	failFunc func(at path, format string, args ...any) error
	warnFunc func(at path, format string, args ...any)
)

// warn records, at the place in the call that path names, something that
// works but should change.
func (l *loader) warn(thread *starlark.Thread, at path, format string, args ...any) {
	l.plan.Warnings = append(l.plan.Warnings, l.pos.locate(l.pos.callPos(thread), at).String()+": "+fmt.Sprintf(format, args...))
}

// methods checks the methods argument: a non-empty list of known names.
// Repeats are dropped, first kept, since a method listed twice is the same
// jobs twice.
func (l *loader) methods(kw map[string]starlark.Value, fail failFunc) ([]*Method, error) {
	v, ok := kw["methods"]
	if !ok {
		return nil, fail(nil, "methods is required")
	}
	xs, ok := asList(v)
	if !ok {
		return nil, fail(path{"methods"}, "methods: want a list of method names, got %s %s", v.Type(), shortRepr(v))
	}
	if len(xs) == 0 {
		return nil, fail(path{"methods"}, "methods is empty")
	}
	var out []*Method
	for i, x := range xs {
		s, ok := x.(starlark.String)
		if !ok {
			return nil, fail(path{"methods", i}, "methods[%d]: want a method name (str), got %s %s", i, x.Type(), shortRepr(x))
		}
		m, ok := l.schema.Methods[string(s)]
		if !ok {
			return nil, fail(path{"methods", i}, "method %s", l.schema.UnknownMethod(string(s)))
		}
		if !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	return out, nil
}

// workloads checks the workloads argument; absent means one workload of
// schema defaults.
func (l *loader) workloads(kw map[string]starlark.Value, fail failFunc) ([]*workloadValue, error) {
	v, ok := kw["workloads"]
	if !ok {
		kind := l.schema.DefaultWorkload
		return []*workloadValue{newWorkloadValue(kind, l.schema.Workloads[kind].Params.Defaults())}, nil
	}
	xs, ok := asList(v)
	if !ok {
		return nil, fail(path{"workloads"}, "workloads: want a list of workload(...) values, got %s %s", v.Type(), shortRepr(v))
	}
	if len(xs) == 0 {
		return nil, fail(path{"workloads"}, "workloads is empty (leave it out for the default workload)")
	}
	out := make([]*workloadValue, len(xs))
	for i, x := range xs {
		w, ok := x.(*workloadValue)
		if !ok {
			hint := ""
			if _, isDict := x.(*starlark.Dict); isDict {
				hint = " (wrap a dict d as workload(**d))"
			}
			return nil, fail(path{"workloads", i}, "workloads[%d]: want a workload(...) value, got %s %s%s", i, x.Type(), shortRepr(x), hint)
		}
		out[i] = w
	}
	return out, nil
}

// gridAxes checks the grid argument and returns, per method name, the
// axes that method accepts, in the order the grid lists them. A method
// without a param simply does not vary along it: that is how "full" ends
// up once per workload in a budget sweep.
func (l *loader) gridAxes(kw map[string]starlark.Value, methods []*Method, fail failFunc) (map[string][]axis, error) {
	axes := make(map[string][]axis)
	v, ok := kw["grid"]
	if !ok {
		return axes, nil
	}
	d, ok := v.(*starlark.Dict)
	if !ok {
		return nil, fail(path{"grid"}, "grid: want a dict of param name to list of values, got %s %s", v.Type(), shortRepr(v))
	}
	for _, item := range d.Items() {
		ks, ok := item[0].(starlark.String)
		if !ok {
			return nil, fail(path{"grid"}, "grid: keys must be param names (str), got %s %s", item[0].Type(), shortRepr(item[0]))
		}
		k := string(ks)
		xs, ok := asList(item[1])
		if !ok {
			return nil, fail(path{"grid", k}, "grid[%q]: want a list of values, got %s %s (write [x] for a single value)", k, item[1].Type(), shortRepr(item[1]))
		}
		if len(xs) == 0 {
			return nil, fail(path{"grid", k}, "grid[%q] is empty", k)
		}
		accepted := false
		for _, m := range methods {
			p, ok := m.Params[k]
			if !ok {
				continue
			}
			accepted = true
			vals := make([]any, len(xs))
			for i, x := range xs {
				var err error
				if vals[i], err = checkValue(p, x); err != nil {
					return nil, fail(path{"grid", k, i}, "grid[%q][%d]: %v (method %q; %s: %s)", k, i, err, m.Name, k, p.Describe())
				}
			}
			axes[m.Name] = append(axes[m.Name], axis{name: k, values: vals})
		}
		if !accepted {
			// "workload.seed" is how compare --by names a workload knob.
			knob := strings.TrimPrefix(k, "workload.")
			var holders []string // the workloads with the knob
			for _, w := range l.schema.WorkloadNames() {
				if _, ok := l.schema.Workloads[w].Params[knob]; ok {
					holders = append(holders, w)
				}
			}
			if len(holders) > 0 {
				if slices.Contains(holders, l.schema.DefaultWorkload) {
					return nil, fail(path{"grid", k}, "grid param %q is a workload param, not a method param: use workloads=[workload(%s=v) for v in ...]", k, knob)
				}
				// workload(k=v) alone would be the default workload, which has no such knob: vary the
				// experiment's own workload.
				quoted := make([]string, len(holders))
				for i, w := range holders {
					quoted[i] = fmt.Sprintf("workload(%q, ...)", w)
				}
				return nil, fail(path{"grid", k}, "grid param %q is a workload param (of %s), not a method param: use workloads=[workload(wl, %s=v) for v in ...] with wl your %s",
					k, strings.Join(holders, ", "), knob, strings.Join(quoted, " or "))
			}
			var accepts, all []string
			for _, m := range methods {
				accepts = append(accepts, fmt.Sprintf("%s: %s", m.Name, known(m.Params.Names())))
				all = append(all, m.Params.Names()...)
			}
			return nil, fail(path{"grid", k}, "grid param %q is not a param of any listed method%s (%s)", k, Closest(k, all), strings.Join(accepts, "; "))
		}
	}
	return axes, nil
}

// extras checks the extra argument: explicit points, each a dict with a
// "method", an optional "workload" (default: the experiment's first) and
// that method's params; the rest take defaults.
func (l *loader) extras(kw map[string]starlark.Value, first *workloadValue, protocol string, fail failFunc, warn warnFunc) ([]point, error) {
	v, ok := kw["extra"]
	if !ok {
		return nil, nil
	}
	xs, ok := asList(v)
	if !ok {
		return nil, fail(path{"extra"}, `extra: want a list of dicts like {"method": "h2o", "budget": 0.5}, got %s %s`, v.Type(), shortRepr(v))
	}
	out := make([]point, 0, len(xs))
	for i, x := range xs {
		d, ok := x.(*starlark.Dict)
		if !ok {
			return nil, fail(path{"extra", i}, "extra[%d]: want a dict, got %s %s", i, x.Type(), shortRepr(x))
		}
		key := "method"
		mv, found, _ := d.Get(starlark.String(key))
		if old, oldFound, _ := d.Get(starlark.String("policy")); oldFound {
			if found {
				return nil, fail(path{"extra", i, "policy"}, `extra[%d]: give "method" only ("policy" is its old name)`, i)
			}
			key, mv, found = "policy", old, true
			warn(path{"extra", i, "policy"}, `extra[%d]: "policy" is the old word; write "method"`, i)
		}
		if !found {
			return nil, fail(path{"extra", i}, `extra[%d]: "method" is required`, i)
		}
		ms, ok := mv.(starlark.String)
		if !ok {
			return nil, fail(path{"extra", i, key}, "extra[%d]: method: want str, got %s %s", i, mv.Type(), shortRepr(mv))
		}
		m, ok := l.schema.Methods[string(ms)]
		if !ok {
			return nil, fail(path{"extra", i, key}, "extra[%d]: method %s", i, l.schema.UnknownMethod(string(ms)))
		}
		p := point{method: m, params: m.Params.Defaults(), workload: first}
		maps.Copy(p.params, m.ProtocolParams(protocol))
		for _, kv := range d.Items() {
			ks, ok := kv[0].(starlark.String)
			if !ok {
				return nil, fail(path{"extra", i}, "extra[%d]: keys must be str, got %s %s", i, kv[0].Type(), shortRepr(kv[0]))
			}
			switch k := string(ks); k {
			case "method", "policy":
			case "workload":
				w, ok := kv[1].(*workloadValue)
				if !ok {
					return nil, fail(path{"extra", i, k}, "extra[%d]: workload: want a workload(...) value, got %s %s", i, kv[1].Type(), shortRepr(kv[1]))
				}
				p.workload = w
			default:
				param, ok := m.Params[k]
				if !ok && l.schema.Workloads[p.workload.name].Params[k] != nil {
					// A knob of the point's workload: what the grid says of one, said for a point.
					return nil, fail(path{"extra", i, k}, `extra[%d]: param %q is a workload param, not a param of method %q: `+
						`give the point a workload of its own, "workload": workload(wl, %s=...) with wl the %s workload it varies`,
						i, k, m.Name, k, p.workload.name)
				}
				if !ok {
					return nil, fail(path{"extra", i, k}, "extra[%d]: param %q is unknown for method %q%s (known: %s)", i, k, m.Name, Closest(k, m.Params.Names()), known(m.Params.Names()))
				}
				val, err := checkValue(param, kv[1])
				if err != nil {
					return nil, fail(path{"extra", i, k}, "extra[%d]: param %q of method %q: %v (%s: %s)", i, k, m.Name, err, k, param.Describe())
				}
				p.params[k] = val
			}
		}
		if msg, err := m.Violated(p.params); err != nil || msg != "" {
			return nil, fail(path{"extra", i}, "extra[%d]: method %q: %s", i, m.Name, ruleError(msg, err))
		}
		out = append(out, p)
	}
	return out, nil
}

// checkRunnable refuses, before any job is planned, the jobs that could
// only fail when they run: a workload with a required knob left empty (a
// model, a prompt), and a method that runs only inside a model on a
// workload without one.
func (l *loader) checkRunnable(methods []*Method, workloads []*workloadValue, extras []point, fail failFunc) error {
	for i, w := range workloads {
		if msg := l.missingKnobs(w); msg != "" {
			return fail(path{"workloads", i}, "workloads[%d]: %s", i, msg)
		}
		for _, m := range methods {
			if msg := l.needsModel(m, w); msg != "" {
				return fail(path{"workloads", i}, "workloads[%d]: %s (or pair them in extra: "+
					`{"method": %q, "workload": workload("vlm", ...)})`, i, msg, m.Name)
			}
		}
	}
	for i, p := range extras {
		if p.workload != workloads[0] {
			if msg := l.missingKnobs(p.workload); msg != "" {
				return fail(path{"extra", i}, "extra[%d]: %s", i, msg)
			}
		}
		if msg := l.needsModel(p.method, p.workload); msg != "" {
			return fail(path{"extra", i}, "extra[%d]: %s", i, msg)
		}
	}
	return nil
}

// missingKnobs names the required knobs w leaves empty, "" for none.
func (l *loader) missingKnobs(w *workloadValue) string {
	params := l.schema.Workloads[w.name].Params
	var missing []string
	for _, name := range params.Names() {
		if params[name].Required && w.vals[name] == "" {
			missing = append(missing, fmt.Sprintf("%s= (%s)", name, params[name].Doc))
		}
	}
	if len(missing) == 0 {
		return ""
	}
	return fmt.Sprintf("workload %q needs %s", w.name, strings.Join(missing, "; "))
}

// needsModel says why m cannot run on w, "" where it can.
func (l *loader) needsModel(m *Method, w *workloadValue) string {
	if !m.InModelOnly || l.schema.Workloads[w.name].RunsModel {
		return ""
	}
	var with []string
	for _, name := range l.schema.WorkloadNames() {
		if l.schema.Workloads[name].RunsModel {
			with = append(with, strconv.Quote(name))
		}
	}
	return fmt.Sprintf("method %q runs only inside a model, and workload %q runs none: give it one that does (%s)",
		m.Name, w.name, strings.Join(with, ", "))
}

// protocol reads experiment(protocol=...): one of the schema's protocols,
// DefaultProtocol when not given ("" for a schema without protocols).
func (l *loader) protocol(kw map[string]starlark.Value, fail failFunc) (string, error) {
	v, ok := kw["protocol"]
	if !ok {
		if _, ok := l.schema.Protocols[DefaultProtocol]; ok {
			return DefaultProtocol, nil
		}
		return "", nil
	}
	s, ok := v.(starlark.String)
	if !ok {
		return "", fail(path{"protocol"}, "protocol: want str, got %s %s", v.Type(), shortRepr(v))
	}
	if _, ok := l.schema.Protocols[string(s)]; !ok {
		return "", fail(path{"protocol"}, "protocol %s", UnknownName(string(s), l.schema.ProtocolNames()))
	}
	return string(s), nil
}

// ruleError is what a broken rule says, or the error that kept it from
// being checked.
func ruleError(msg string, err error) string {
	if err != nil {
		return err.Error()
	}
	return msg
}

// gridPoint says which grid point broke a rule: " with" the params set
// away from their defaults that the rule's message does not already quote.
func gridPoint(ps Params, values map[string]any, msg string) string {
	var parts []string
	for _, name := range ps.Names() {
		if v := values[name]; fmt.Sprint(v) != fmt.Sprint(ps[name].Default) && !strings.Contains(msg, name+"=") {
			parts = append(parts, name+"="+formatValue(v))
		}
	}
	if len(parts) == 0 {
		return ""
	}
	return " with " + strings.Join(parts, " ")
}

// defaultsOutOfID lists, as prefix + name, the values at their defaults whose
// params the job id leaves out (Param.IDOmitsDefault), in name order.
func defaultsOutOfID(prefix string, params Params, values map[string]any) []string {
	var out []string
	for _, name := range slices.Sorted(maps.Keys(values)) {
		if p := params[name]; p != nil && p.IDOmitsDefault && p.Type != TypeInts && values[name] == p.Default {
			out = append(out, prefix+name)
		}
	}
	return out
}
