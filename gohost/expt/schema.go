package expt

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Type is the type of a method, workload or benchmark parameter.
type Type string

// The parameter types a schema may declare. Values are held in Go as bool,
// int64, float64, string and []int64; an int given for a float parameter is
// stored as a float so that 1 and 1.0 make the same job. Lists (TypeInts)
// are for benchmark sizes only: a job's parameters are scalars.
const (
	TypeInt   Type = "int"
	TypeFloat Type = "float"
	TypeStr   Type = "str"
	TypeBool  Type = "bool"
	TypeInts  Type = "ints"
)

// Schema is what the Python side publishes about its registries
// (kernels_py/schema.json): the methods, workloads and benchmarks with their
// knobs. Go only reads it, so that Go never needs to know what a method
// means, only which knobs it has.
type Schema struct {
	Methods         map[string]*Method
	Workloads       map[string]*Workload
	DefaultWorkload string // what workload() and an experiment without workloads use
	// Protocols are the comparison protocols an experiment may name, each
	// with what it means; each method says which of its params one sets.
	Protocols map[string]string
	// Renamed are old method names: what each is now, and why.
	Renamed    map[string]Renamed
	Benchmarks map[string]*Benchmark
	Ops        map[string]*Op
}

// Renamed is an old method name's successor.
type Renamed struct {
	Now string `json:"now"`
	Why string `json:"why"`
}

// UnknownMethod says that name is not a method: what it is now if it was
// renamed, else the closest name.
func (s *Schema) UnknownMethod(name string) string {
	if r, ok := s.Renamed[name]; ok {
		return fmt.Sprintf("%q is now %q: %s", name, r.Now, r.Why)
	}
	return UnknownName(name, s.MethodNames())
}

// Op is one registered kernel op (kernels_py/ops/<name>/).
type Op struct {
	Name      string
	Doc       string
	Benchmark string // the benchmark that measures it
}

// Method is one compression method and the parameters it accepts.
type Method struct {
	Name   string
	Doc    string
	Paper  string // where the method comes from
	Params Params
	Rules  Rules    // constraints between params, checked per job
	Notes  []string // more to know, one line each (kvpress: its presses and their parameters)
	// Protocols holds, per protocol, the param values it sets on this
	// method's jobs (checked against Params); absent: it sets none.
	Protocols map[string]map[string]any
	// Presses are the kvpress presses the method's press param may name
	// (the kvpress method's); nil: none are checked.
	Presses Presses
	// InModelOnly: the method runs only inside a model (a kvpress press),
	// so only on a workload that RunsModel.
	InModelOnly bool
}

// ProtocolParams returns a copy of the params `protocol` sets on m (empty
// when it sets none, and for "").
func (m *Method) ProtocolParams(protocol string) map[string]any {
	out := map[string]any{}
	for k, v := range m.Protocols[protocol] {
		out[k] = v
	}
	return out
}

// Workload is one registered workload and its knobs.
type Workload struct {
	Name   string
	Doc    string
	Params Params
	Rules  Rules
	// Expand names the knobs one workload value spreads over several jobs:
	// "each" (a comma-separated str: one job per item, holding that item) or
	// "index:KNOB" (an int N: N jobs, KNOB = 0..N-1 in each).
	Expand map[string]string
	// RunsModel: a model runs in the workload, so methods that run only
	// inside one (Method.InModelOnly) can run on it.
	RunsModel bool
}

// Benchmark is one kernel benchmark: its parameters (command-line flags) and
// the columns of the table it returns.
type Benchmark struct {
	Name    string
	Doc     string // one line
	Long    string // what it compares and how, for --help
	Params  Params
	Rules   Rules
	Columns []Column
}

// Column describes one column of a table a worker returns.
type Column struct {
	Name  string `json:"name"`
	Unit  string `json:"unit"`
	Doc   string `json:"doc"`
	Label string `json:"label"`
	Show  bool   `json:"show"`
}

// Params maps parameter names to their declarations.
type Params map[string]*Param

// Param declares one parameter. Every parameter has a default, so that a
// job always carries the complete set of values and its id does not depend
// on which defaults a script happened to spell out.
type Param struct {
	Name    string
	Doc     string
	Ref     string // where a paper defines it, if one does
	Type    Type
	Default any            // bool, int64, float64, string or []int64, per Type
	Min     *float64       // inclusive; numbers only (each element of a list)
	Max     *float64       // inclusive; numbers only (each element of a list)
	Choices []any          // allowed values, converted to Type; nil means any
	Pattern *regexp.Regexp // str only: the whole value must match; nil means any
	// IDOmitsDefault: at its default the parameter is left out of job ids
	// (Job.CanonicalJSON), so adding it to a workload or method kept the ids
	// of every job planned before it.
	IDOmitsDefault bool
	// Paths: a str parameter holding a file or folder, or comma-separated
	// ones. Workers run in the kernels root, so a relative one is from
	// there (plan warns of missing ones).
	Paths bool
	// Required: a str parameter whose default ("") only holds its place (a
	// model, a prompt); an experiment may not run with it empty.
	Required bool
}

// LoadSchema reads and parses a schema file.
func LoadSchema(path string) (*Schema, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("expt: read schema: %w", err)
	}
	s, err := parseSchema(data)
	if err != nil {
		return nil, fmt.Errorf("expt: schema %s: %w", path, err)
	}
	return s, nil
}

// Wire form of the schema. Unknown fields are rejected: a misspelt "max"
// would otherwise silently switch off a range check, and both sides of the
// contract live in the same repository, so they change together.
type (
	schemaJSON struct {
		Methods    map[string]methodJSON    `json:"methods"`
		Workloads  map[string]paramSetJSON  `json:"workloads"`
		Default    string                   `json:"default_workload"`
		Benchmarks map[string]benchmarkJSON `json:"benchmarks"`
		Ops        map[string]opJSON        `json:"ops"`
		Protocols  map[string]string        `json:"protocols"`
		Renamed    map[string]Renamed       `json:"renamed_methods"`
	}
	opJSON struct {
		Doc       string `json:"doc"`
		Benchmark string `json:"benchmark"`
	}
	methodJSON struct {
		Doc       string                    `json:"doc"`
		Paper     string                    `json:"paper"`
		Params    map[string]paramJSON      `json:"params"`
		Rules     []*Rule                   `json:"rules"`
		Notes     []string                  `json:"notes"`
		Protocols map[string]map[string]any `json:"protocols"`
		Presses   Presses                   `json:"presses"`
		// InModelOnly is Method.InModelOnly.
		InModelOnly bool `json:"in_model_only"`
	}
	paramSetJSON struct {
		Doc    string               `json:"doc"`
		Params map[string]paramJSON `json:"params"`
		Rules  []*Rule              `json:"rules"`
		Expand map[string]string    `json:"expand"`
		// RunsModel is Workload.RunsModel.
		RunsModel bool `json:"runs_model"`
	}
	benchmarkJSON struct {
		Doc     string               `json:"doc"`
		Long    string               `json:"long"`
		Params  map[string]paramJSON `json:"params"`
		Rules   []*Rule              `json:"rules"`
		Columns []Column             `json:"columns"`
	}
	paramJSON struct {
		Type    Type         `json:"type"`
		Doc     string       `json:"doc"`
		Ref     string       `json:"ref"`
		Default any          `json:"default"`
		Min     *json.Number `json:"min"`
		Max     *json.Number `json:"max"`
		Choices []any        `json:"choices"`
		Pattern string       `json:"pattern"`
		// IDOmitsDefault is Param.IDOmitsDefault.
		IDOmitsDefault bool `json:"id_omits_default"`
		// Paths is Param.Paths.
		Paths bool `json:"paths"`
		// Required is Param.Required.
		Required bool `json:"required"`
	}
)

// identRE is what a parameter name must look like: scripts pass parameters
// as keyword arguments, so a name must be a valid Starlark identifier.
var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// methodRE keeps method names to what reads well in a list and a path.
var methodRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// reservedParams are keys with a meaning of their own in an extra point
// ("policy" is the old word for "method", still read in scripts).
var reservedParams = []string{"method", "policy", "workload"}

// reservedFlags are flags every `workbench bench NAME` already has: a
// benchmark parameter cannot be one of them.
var reservedFlags = []string{"json", "help", "h", "python", "kernels", "device", "log_format", "verbose", "v", "version"}

// ParseSchema parses and checks a schema: known types, defaults present and
// valid, min <= max, choices of the declared type.
func ParseSchema(data []byte) (*Schema, error) {
	s, err := parseSchema(data)
	if err != nil {
		return nil, fmt.Errorf("expt: schema: %w", err)
	}
	return s, nil
}

func parseSchema(data []byte) (*Schema, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber() // keep 0 and 0.0 apart until the declared type is known
	dec.DisallowUnknownFields()
	var w schemaJSON
	if err := dec.Decode(&w); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("trailing data after the JSON object")
	}
	if len(w.Methods) == 0 {
		return nil, errors.New(`"methods" is missing or empty`)
	}
	s := &Schema{Methods: make(map[string]*Method, len(w.Methods)), Workloads: map[string]*Workload{},
		Benchmarks: map[string]*Benchmark{}, Ops: map[string]*Op{}, Protocols: w.Protocols, Renamed: w.Renamed}
	for _, name := range sortedKeys(w.Protocols) {
		if !methodRE.MatchString(name) {
			return nil, fmt.Errorf("protocol name %q is not valid (want %s)", name, methodRE)
		}
	}
	for _, name := range sortedKeys(w.Methods) { // sorted: the same schema always reports the same error
		mj := w.Methods[name]
		if !methodRE.MatchString(name) {
			return nil, fmt.Errorf("method name %q is not valid (want %s)", name, methodRE)
		}
		ps, err := parseParams(mj.Params, false)
		if err != nil {
			return nil, fmt.Errorf("method %q: %w", name, err)
		}
		for _, r := range reservedParams {
			if _, ok := ps[r]; ok {
				return nil, fmt.Errorf("method %q: param name %q is reserved", name, r)
			}
		}
		rules, err := parseRules(mj.Rules, ps)
		if err != nil {
			return nil, fmt.Errorf("method %q: %w", name, err)
		}
		protocols, err := parseProtocols(mj.Protocols, w.Protocols, ps)
		if err != nil {
			return nil, fmt.Errorf("method %q: %w", name, err)
		}
		if err := mj.Presses.parse(ps); err != nil {
			return nil, fmt.Errorf("method %q: presses: %w", name, err)
		}
		s.Methods[name] = &Method{Name: name, Doc: mj.Doc, Paper: mj.Paper, Params: ps, Rules: rules, Notes: mj.Notes,
			Protocols: protocols, Presses: mj.Presses, InModelOnly: mj.InModelOnly}
	}
	for _, name := range sortedKeys(w.Workloads) {
		if !methodRE.MatchString(name) {
			return nil, fmt.Errorf("workload name %q is not valid (want %s)", name, methodRE)
		}
		ps, err := parseParams(w.Workloads[name].Params, false)
		if err != nil {
			return nil, fmt.Errorf("workload %q: %w", name, err)
		}
		rules, err := parseRules(w.Workloads[name].Rules, ps)
		if err != nil {
			return nil, fmt.Errorf("workload %q: %w", name, err)
		}
		if err := checkExpand(w.Workloads[name].Expand, ps); err != nil {
			return nil, fmt.Errorf("workload %q: %w", name, err)
		}
		s.Workloads[name] = &Workload{Name: name, Doc: w.Workloads[name].Doc, Params: ps, Rules: rules,
			Expand: w.Workloads[name].Expand, RunsModel: w.Workloads[name].RunsModel}
	}
	if len(s.Workloads) == 0 {
		return nil, errors.New(`"workloads" is missing or empty`)
	}
	if _, ok := s.Workloads[w.Default]; !ok {
		return nil, fmt.Errorf("default_workload %q is not one of the workloads (%s)", w.Default, known(sortedKeys(s.Workloads)))
	}
	s.DefaultWorkload = w.Default
	for _, name := range sortedKeys(w.Benchmarks) {
		bj := w.Benchmarks[name]
		if !methodRE.MatchString(name) {
			return nil, fmt.Errorf("benchmark name %q is not valid (want %s)", name, methodRE)
		}
		ps, err := parseParams(bj.Params, true)
		if err != nil {
			return nil, fmt.Errorf("benchmark %q: %w", name, err)
		}
		for _, r := range reservedFlags {
			if _, ok := ps[r]; ok {
				return nil, fmt.Errorf("benchmark %q: param name %q is taken by a flag every benchmark has", name, r)
			}
		}
		rules, err := parseRules(bj.Rules, ps)
		if err != nil {
			return nil, fmt.Errorf("benchmark %q: %w", name, err)
		}
		s.Benchmarks[name] = &Benchmark{Name: name, Doc: bj.Doc, Long: bj.Long, Params: ps, Rules: rules, Columns: bj.Columns}
	}
	for _, name := range sortedKeys(w.Ops) {
		oj := w.Ops[name]
		if _, ok := s.Benchmarks[oj.Benchmark]; oj.Benchmark != "" && !ok {
			return nil, fmt.Errorf("op %q: its benchmark %q is not one of the benchmarks", name, oj.Benchmark)
		}
		s.Ops[name] = &Op{Name: name, Doc: oj.Doc, Benchmark: oj.Benchmark}
	}
	return s, nil
}

// parseProtocols checks what each protocol sets on a method: a known
// protocol, known params, values each param accepts.
func parseProtocols(in map[string]map[string]any, names map[string]string, ps Params) (map[string]map[string]any, error) {
	out := make(map[string]map[string]any, len(in))
	for _, protocol := range sortedKeys(in) {
		if _, ok := names[protocol]; !ok {
			return nil, fmt.Errorf("protocol %q is not one of the schema's protocols (%s)", protocol, known(sortedKeys(names)))
		}
		set := make(map[string]any, len(in[protocol]))
		for _, name := range sortedKeys(in[protocol]) {
			p, ok := ps[name]
			if !ok {
				return nil, fmt.Errorf("protocol %q sets param %q, which the method does not have", protocol, name)
			}
			v, err := p.check(fromJSON(in[protocol][name]))
			if err != nil {
				return nil, fmt.Errorf("protocol %q: param %q: %w", protocol, name, err)
			}
			set[name] = v
		}
		out[protocol] = set
	}
	return out, nil
}

// ProtocolNames returns the protocol names, sorted.
func (s *Schema) ProtocolNames() []string {
	return sortedKeys(s.Protocols)
}

func parseParams(in map[string]paramJSON, lists bool) (Params, error) {
	out := make(Params, len(in))
	for _, name := range sortedKeys(in) {
		pj := in[name]
		if !identRE.MatchString(name) {
			return nil, fmt.Errorf("param name %q is not an identifier", name)
		}
		if pj.Type == TypeInts && !lists {
			return nil, fmt.Errorf("param %q: type %q is only for benchmarks (job params are scalars)", name, pj.Type)
		}
		p, err := parseParam(name, pj)
		if err != nil {
			return nil, fmt.Errorf("param %q: %w", name, err)
		}
		out[name] = p
	}
	return out, nil
}

func parseParam(name string, pj paramJSON) (*Param, error) {
	p := &Param{Name: name, Doc: pj.Doc, Ref: pj.Ref, Type: pj.Type, IDOmitsDefault: pj.IDOmitsDefault, Paths: pj.Paths, Required: pj.Required}
	switch pj.Type {
	case TypeInt, TypeFloat, TypeStr, TypeBool, TypeInts:
	case "":
		return nil, errors.New(`"type" is missing`)
	default:
		return nil, fmt.Errorf("type %q is unknown (known: bool, float, int, ints, str)", pj.Type)
	}
	bound := func(key string, n *json.Number) (*float64, error) {
		if n == nil {
			return nil, nil
		}
		if pj.Type != TypeInt && pj.Type != TypeFloat && pj.Type != TypeInts {
			return nil, fmt.Errorf("%q is only for int and float params", key)
		}
		f, err := n.Float64()
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return nil, fmt.Errorf("%q: %s is not a finite number", key, n)
		}
		return &f, nil
	}
	var err error
	if p.Min, err = bound("min", pj.Min); err != nil {
		return nil, err
	}
	if p.Max, err = bound("max", pj.Max); err != nil {
		return nil, err
	}
	if p.Min != nil && p.Max != nil && *p.Min > *p.Max {
		return nil, fmt.Errorf("min %v is above max %v", *p.Min, *p.Max)
	}
	if pj.Paths && pj.Type != TypeStr {
		return nil, errors.New(`"paths" is only for str params`)
	}
	if pj.Pattern != "" {
		if pj.Type != TypeStr {
			return nil, errors.New(`"pattern" is only for str params`)
		}
		if p.Pattern, err = regexp.Compile(`^(?:` + pj.Pattern + `)$`); err != nil {
			return nil, fmt.Errorf("pattern: %w", err)
		}
	}
	if pj.Choices != nil {
		if len(pj.Choices) == 0 {
			return nil, errors.New(`"choices" is empty`)
		}
		choices := make([]any, len(pj.Choices))
		for i, c := range pj.Choices {
			if choices[i], err = p.check(fromJSON(c)); err != nil { // p.Choices still nil: type and range only
				return nil, fmt.Errorf("choices[%d]: %w", i, err)
			}
		}
		p.Choices = choices
	}
	if pj.Default == nil {
		// Also rejects an explicit null: a job must be complete.
		return nil, errors.New(`"default" is missing`)
	}
	if p.Default, err = p.check(fromJSON(pj.Default)); err != nil {
		return nil, fmt.Errorf("default: %w", err)
	}
	if p.Required && p.Default != "" {
		return nil, errors.New(`"required" is only for str params whose default is ""`)
	}
	return p, nil
}

// fromJSON turns a decoded JSON scalar (or list of them) into the Go value
// check expects.
func fromJSON(v any) any {
	if xs, ok := v.([]any); ok {
		ints := make([]int64, len(xs))
		for i, x := range xs {
			n, ok := fromJSON(x).(int64)
			if !ok {
				return v // check reports the type
			}
			ints[i] = n
		}
		return ints
	}
	n, ok := v.(json.Number)
	if !ok {
		return v
	}
	if i, err := strconv.ParseInt(string(n), 10, 64); err == nil {
		return i
	}
	if f, err := n.Float64(); err == nil {
		return f
	}
	return v // not reachable for a valid JSON number; check reports the type
}

// check converts v (bool, int64, float64 or string) to the parameter's
// type and checks its range and choices. It is the single place where
// values from the schema and values from scripts are normalized, so both
// produce identical job values.
func (p *Param) check(v any) (any, error) {
	if p.Type == TypeInts {
		xs, ok := v.([]int64)
		if !ok {
			return nil, wantErr(p.Type, v)
		}
		element := *p
		element.Type = TypeInt
		for _, x := range xs {
			if _, err := element.check(x); err != nil {
				return nil, err
			}
		}
		return slices.Clone(xs), nil
	}
	var out any
	switch p.Type {
	case TypeInt:
		i, ok := v.(int64)
		if !ok {
			return nil, wantErr(p.Type, v)
		}
		out = i
	case TypeFloat:
		var f float64
		switch x := v.(type) {
		case int64:
			f = float64(x)
		case float64:
			f = x
		default:
			return nil, wantErr(p.Type, v)
		}
		if math.IsNaN(f) || math.IsInf(f, 0) {
			return nil, fmt.Errorf("%v is not a finite number", f)
		}
		out = f + 0 // -0.0 becomes 0.0: they compare equal, so they must not give two ids
	case TypeStr:
		s, ok := v.(string)
		if !ok {
			return nil, wantErr(p.Type, v)
		}
		if !utf8.ValidString(s) {
			return nil, fmt.Errorf("%q is not valid UTF-8", s)
		}
		if p.Pattern != nil && !p.Pattern.MatchString(s) {
			return nil, fmt.Errorf("%q is not well-formed", s)
		}
		out = s
	case TypeBool:
		b, ok := v.(bool)
		if !ok {
			return nil, wantErr(p.Type, v)
		}
		out = b
	}
	// Messages quote v as the script wrote it, not as converted.
	if f, ok := asFloat(out); ok {
		if p.Min != nil && f < *p.Min {
			return nil, fmt.Errorf("%s is below the minimum %s", formatValue(v), formatBound(*p.Min))
		}
		if p.Max != nil && f > *p.Max {
			return nil, fmt.Errorf("%s is above the maximum %s", formatValue(v), formatBound(*p.Max))
		}
	}
	if p.Choices != nil && !slices.Contains(p.Choices, out) {
		cs := make([]string, len(p.Choices))
		for i, c := range p.Choices {
			cs[i] = formatValue(c)
		}
		return nil, fmt.Errorf("%s is not one of %s", formatValue(v), strings.Join(cs, ", "))
	}
	return out, nil
}

func asFloat(v any) (float64, bool) {
	switch x := v.(type) {
	case int64:
		return float64(x), true
	case float64:
		return x, true
	}
	return 0, false
}

func wantErr(t Type, v any) error {
	return fmt.Errorf("want %s, got %s %s", t, typeName(v), formatValue(v))
}

// typeName names a Go value's type the way a script author knows it.
func typeName(v any) string {
	switch v.(type) {
	case bool:
		return "bool"
	case int64:
		return "int"
	case float64:
		return "float"
	case string:
		return "str"
	case []int64:
		return "list"
	case nil:
		return "None"
	}
	return fmt.Sprintf("%T", v)
}

// formatValue writes a value in script syntax, for error messages.
func formatValue(v any) string {
	switch x := v.(type) {
	case bool:
		if x {
			return "True"
		}
		return "False"
	case int64:
		return strconv.FormatInt(x, 10)
	case float64:
		return string(appendFloat(nil, x))
	case string:
		return strconv.Quote(x)
	case []int64:
		parts := make([]string, len(x))
		for i, n := range x {
			parts[i] = strconv.FormatInt(n, 10)
		}
		return "[" + strings.Join(parts, ", ") + "]"
	case nil:
		return "None"
	}
	return fmt.Sprint(v)
}

func formatBound(f float64) string {
	if f == math.Trunc(f) && math.Abs(f) < 1e15 {
		return strconv.FormatFloat(f, 'f', -1, 64) // 2147483647, not 2.147483647e+09
	}
	return strconv.FormatFloat(f, 'g', -1, 64)
}

// Defaults returns a new map of every parameter's default.
func (ps Params) Defaults() map[string]any {
	m := make(map[string]any, len(ps))
	for name, p := range ps {
		m[name] = p.Default
	}
	return m
}

// Names returns the parameter names, sorted.
func (ps Params) Names() []string {
	return sortedKeys(ps)
}

// MethodNames returns the method names, sorted.
func (s *Schema) MethodNames() []string {
	return sortedKeys(s.Methods)
}

// WorkloadNames returns the workload names, sorted.
func (s *Schema) WorkloadNames() []string {
	return sortedKeys(s.Workloads)
}

// BenchmarkNames returns the benchmark names, sorted.
func (s *Schema) BenchmarkNames() []string {
	return sortedKeys(s.Benchmarks)
}

// OpNames returns the op names, sorted.
func (s *Schema) OpNames() []string {
	return sortedKeys(s.Ops)
}

// Check converts a value (bool, int64, float64, string or []int64) to the
// parameter's type and checks its range and choices.
func (p *Param) Check(v any) (any, error) { return p.check(v) }

// Describe is the parameter in one line for errors and listings: its type,
// bounds, default and what it means, e.g.
// "float in [0.001, 1], default 0.2: fraction of the tokens seen that the cache keeps".
func (p *Param) Describe() string { return p.describe(true) }

// Usage is Describe without the default, for flags (which show it themselves).
func (p *Param) Usage() string { return p.describe(false) }

func (p *Param) describe(withDefault bool) string {
	var b strings.Builder
	b.WriteString(string(p.Type))
	switch {
	case p.Choices != nil:
		cs := make([]string, len(p.Choices))
		for i, c := range p.Choices {
			cs[i] = formatValue(c)
		}
		b.WriteString(" in {" + strings.Join(cs, ", ") + "}")
	case p.Min != nil && p.Max != nil:
		fmt.Fprintf(&b, " in [%s, %s]", formatBound(*p.Min), formatBound(*p.Max))
	case p.Min != nil:
		b.WriteString(" >= " + formatBound(*p.Min))
	case p.Max != nil:
		b.WriteString(" <= " + formatBound(*p.Max))
	}
	switch {
	case withDefault && p.Required: // its default only holds the place: a script must set it
		b.WriteString(", required")
	case withDefault:
		b.WriteString(", default " + formatValue(p.Default))
	}
	if p.Doc != "" {
		b.WriteString(": " + p.Doc)
	}
	if p.Ref != "" {
		b.WriteString(" [" + p.Ref + "]")
	}
	if p.Paths {
		b.WriteString(" (relative paths: from the kernels root, the checkout)")
	}
	return b.String()
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// Closest returns ` (did you mean "x"?)` when one of names is a likely
// misspelling of name (a small edit distance for its length), else "".
func Closest(name string, names []string) string {
	best, bestDist := "", len(name)/3+1
	for _, n := range names {
		if d := editDistance(strings.ToLower(name), strings.ToLower(n)); d < bestDist {
			best, bestDist = n, d
		}
	}
	if best == "" {
		return ""
	}
	return fmt.Sprintf(" (did you mean %q?)", best)
}

// editDistance is the Levenshtein distance between a and b, in runes, with a
// swap of two neighbouring runes counting as one edit.
func editDistance(a, b string) int {
	x, y := []rune(a), []rune(b)
	prev2, prev, cur := make([]int, len(y)+1), make([]int, len(y)+1), make([]int, len(y)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(x); i++ {
		cur[0] = i
		for j := 1; j <= len(y); j++ {
			cost := 1
			if x[i-1] == y[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && x[i-1] == y[j-2] && x[i-2] == y[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(y)]
}
