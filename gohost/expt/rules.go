package expt

import (
	"fmt"
	"sort"

	"go.starlark.net/starlark"
	"go.starlark.net/syntax"
)

// Rule is a constraint between the parameters of a method, workload or
// benchmark (kernels_py.params.Rule): an expression over the parameter
// names in the common subset of Python and Starlark, and the message that
// says what to change, formatted with the values ({name}, {name!r}).
// Python checks it when it builds the object; the host checks it when it
// plans, so a script that breaks one fails with file:line:col before
// anything runs.
type Rule struct {
	Check   string `json:"check"`
	Message string `json:"message"`
	expr    syntax.Expr
}

// Rules are checked in order; the first that fails is reported.
type Rules []*Rule

// parseRules compiles the rules of one parameter set; each may name only
// its parameters and the functions rules may call.
func parseRules(in []*Rule, params Params) (Rules, error) {
	for i, r := range in {
		if r == nil || r.Check == "" || r.Message == "" {
			return nil, fmt.Errorf("rules[%d]: want a check and a message", i)
		}
		expr, err := syntax.ParseExpr("rule", r.Check, 0)
		if err != nil {
			return nil, fmt.Errorf("rules[%d]: %q: %w", i, r.Check, err)
		}
		r.expr = expr
		// Evaluated on the defaults: a rule that cannot run, or that the
		// defaults break, is the schema's mistake.
		ok, msg, err := r.eval(params.Defaults())
		if err != nil {
			return nil, fmt.Errorf("rules[%d]: %w", i, err)
		}
		if !ok {
			return nil, fmt.Errorf("rules[%d]: the defaults break it: %s", i, msg)
		}
		// The message is formatted only when a job breaks the rule: one that
		// names no parameter (or takes a format spec, which Starlark lacks)
		// would fail there instead of saying what to change.
		if _, err := r.message(params.Defaults()); err != nil {
			return nil, fmt.Errorf("rules[%d]: %w", i, err)
		}
	}
	return in, nil
}

// Violated returns the message of the first rule values break, or "".
// values must hold every parameter (defaults filled in).
func (rs Rules) Violated(values map[string]any) (string, error) {
	for _, r := range rs {
		ok, msg, err := r.eval(values)
		if err != nil {
			return "", err
		}
		if !ok {
			return msg, nil
		}
	}
	return "", nil
}

// ruleFunctions are what Python has and Starlark lacks among the functions
// a rule may call.
var ruleFunctions = starlark.StringDict{"sum": starlark.NewBuiltin("sum", starlarkSum)}

func (r *Rule) eval(values map[string]any) (bool, string, error) {
	env := starlark.StringDict{}
	for k, v := range ruleFunctions {
		env[k] = v
	}
	for name, v := range values {
		env[name] = toStarlark(v)
	}
	thread := &starlark.Thread{Name: "rule"}
	thread.SetMaxExecutionSteps(1 << 20)
	res, err := starlark.EvalExprOptions(syntax.LegacyFileOptions(), thread, r.expr, env)
	if err != nil {
		return false, "", fmt.Errorf("rule %q: %w", r.Check, err)
	}
	b, ok := res.(starlark.Bool)
	if !ok {
		return false, "", fmt.Errorf("rule %q: gives %s, not a bool", r.Check, res.Type())
	}
	if b {
		return true, "", nil
	}
	msg, err := r.message(values)
	return false, msg, err
}

// message is the rule's message formatted with values ({name}, {name!r}).
func (r *Rule) message(values map[string]any) (string, error) {
	names := make([]string, 0, len(values))
	for name := range values {
		names = append(names, name)
	}
	sort.Strings(names)
	kwargs := make([]starlark.Tuple, 0, len(values))
	for _, name := range names {
		kwargs = append(kwargs, starlark.Tuple{starlark.String(name), toStarlark(values[name])})
	}
	format, _ := starlark.String(r.Message).Attr("format")
	msg, err := starlark.Call(&starlark.Thread{Name: "rule message"}, format, nil, kwargs)
	if err != nil {
		return "", fmt.Errorf("rule message %q: %w", r.Message, err)
	}
	return string(msg.(starlark.String)), nil
}

// starlarkSum is Python's sum(iterable, start=0) over ints and floats.
func starlarkSum(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var xs starlark.Iterable
	var total starlark.Value = starlark.MakeInt(0)
	if err := starlark.UnpackPositionalArgs(b.Name(), args, kwargs, 1, &xs, &total); err != nil {
		return nil, err
	}
	it := xs.Iterate()
	defer it.Done()
	var x starlark.Value
	for it.Next(&x) {
		var err error
		if total, err = starlark.Binary(syntax.PLUS, total, x); err != nil {
			return nil, fmt.Errorf("sum: %w", err)
		}
	}
	return total, nil
}
