package expt

import (
	"fmt"
	"hash/fnv"
	"maps"
	"math"
	"strconv"
	"strings"

	"go.starlark.net/starlark"
	"go.starlark.net/syntax"
)

// fromStarlark converts a script value to the Go form Param.check takes.
// It returns nil, nil for a value that cannot be a parameter at all (a
// list, None, ...), which the caller reports against the wanted type.
func fromStarlark(v starlark.Value) (any, error) {
	switch x := v.(type) {
	case starlark.Bool:
		return bool(x), nil
	case starlark.Int:
		i, ok := x.Int64()
		if !ok {
			return nil, fmt.Errorf("integer %s does not fit in 64 bits", x)
		}
		return i, nil
	case starlark.Float:
		f := float64(x)
		if math.IsNaN(f) || math.IsInf(f, 0) {
			return nil, fmt.Errorf("%s is not a finite number", x)
		}
		return f, nil
	case starlark.String:
		return string(x), nil
	}
	return nil, nil
}

// shortRepr is a value as the script would print it, cut for messages.
func shortRepr(v starlark.Value) string {
	s := v.String()
	if r := []rune(s); len(r) > 60 {
		s = string(r[:57]) + "..."
	}
	return s
}

// toStarlark converts a Go parameter value back for scripts to read.
func toStarlark(v any) starlark.Value {
	switch x := v.(type) {
	case bool:
		return starlark.Bool(x)
	case int64:
		return starlark.MakeInt64(x)
	case float64:
		return starlark.Float(x)
	case string:
		return starlark.String(x)
	case []int64:
		elems := make([]starlark.Value, len(x))
		for i, e := range x {
			elems[i] = starlark.MakeInt64(e)
		}
		return starlark.NewList(elems)
	}
	return starlark.None
}

// checkValue converts and checks one script value against a parameter.
func checkValue(p *Param, v starlark.Value) (any, error) {
	g, err := fromStarlark(v)
	if err != nil {
		return nil, err
	}
	if g == nil {
		return nil, fmt.Errorf("want %s, got %s %s", p.Type, v.Type(), shortRepr(v))
	}
	return p.check(g)
}

// workloadValue is what workload() returns: a registered workload's name and
// a complete, validated, frozen set of its parameters. It reads like a dict
// of the parameters (wl["seed"], wl.seed, keys(), **wl); workload(wl, seed=1)
// derives another workload of the same kind from it.
type workloadValue struct {
	name string         // the registered workload
	vals map[string]any // complete: every schema param, defaults filled in
	keys []string       // sorted, for deterministic iteration and printing
}

var (
	_ starlark.IterableMapping = (*workloadValue)(nil)
	_ starlark.HasAttrs        = (*workloadValue)(nil)
	_ starlark.Sequence        = (*workloadValue)(nil)
	_ starlark.Comparable      = (*workloadValue)(nil)
)

func newWorkloadValue(name string, vals map[string]any) *workloadValue {
	return &workloadValue{name: name, vals: vals, keys: sortedKeys(vals)}
}

// values returns a copy, so each job owns its map.
func (w *workloadValue) values() map[string]any { return maps.Clone(w.vals) }

func (w *workloadValue) String() string {
	var b strings.Builder
	b.WriteString("workload(" + strconv.Quote(w.name))
	for _, k := range w.keys {
		fmt.Fprintf(&b, ", %s=%s", k, formatValue(w.vals[k]))
	}
	b.WriteString(")")
	return b.String()
}

func (w *workloadValue) Type() string         { return "workload" }
func (w *workloadValue) Freeze()              {} // immutable from birth
func (w *workloadValue) Truth() starlark.Bool { return starlark.True }
func (w *workloadValue) Len() int             { return len(w.keys) }

func (w *workloadValue) Hash() (uint32, error) {
	h := fnv.New32a()
	h.Write([]byte(w.name))
	h.Write(appendCanonical(nil, w.vals))
	return h.Sum32(), nil
}

func (w *workloadValue) Get(k starlark.Value) (starlark.Value, bool, error) {
	s, ok := k.(starlark.String)
	if !ok {
		return nil, false, fmt.Errorf("workload keys are strings, got %s", k.Type())
	}
	v, ok := w.vals[string(s)]
	if !ok {
		return nil, false, nil
	}
	return toStarlark(v), true, nil
}

func (w *workloadValue) Items() []starlark.Tuple {
	items := make([]starlark.Tuple, len(w.keys))
	for i, k := range w.keys {
		items[i] = starlark.Tuple{starlark.String(k), toStarlark(w.vals[k])}
	}
	return items
}

func (w *workloadValue) Iterate() starlark.Iterator {
	return &keyIterator{keys: w.keys}
}

func (w *workloadValue) Attr(name string) (starlark.Value, error) {
	if v, ok := w.vals[name]; ok {
		return toStarlark(v), nil
	}
	return nil, nil // starlark reports "workload has no .name field or method"
}

func (w *workloadValue) AttrNames() []string { return w.keys }

func (w *workloadValue) CompareSameType(op syntax.Token, y starlark.Value, depth int) (bool, error) {
	other := y.(*workloadValue)
	eq := w.name == other.name && maps.Equal(w.vals, other.vals)
	switch op {
	case syntax.EQL:
		return eq, nil
	case syntax.NEQ:
		return !eq, nil
	}
	return false, fmt.Errorf("workload values are not ordered (%s)", op)
}

type keyIterator struct {
	keys []string
	i    int
}

func (it *keyIterator) Next(p *starlark.Value) bool {
	if it.i >= len(it.keys) {
		return false
	}
	*p = starlark.String(it.keys[it.i])
	it.i++
	return true
}

func (it *keyIterator) Done() {}
