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

// Type is the type of a method or workload parameter.
type Type string

// The parameter types a schema may declare. Values are held in Go as bool,
// int64, float64 and string; an int given for a float parameter is stored
// as a float so that 1 and 1.0 make the same job.
const (
	TypeInt   Type = "int"
	TypeFloat Type = "float"
	TypeStr   Type = "str"
	TypeBool  Type = "bool"
)

// Schema is the method and workload parameter schema. The Python side owns
// it (kernels_py/policies/schema.json); Go only reads it, so that Go never
// needs to know what a method means, only which knobs it has.
type Schema struct {
	Methods  map[string]*Method
	Workload Params
}

// Method is one compression method and the parameters it accepts.
type Method struct {
	Name   string
	Doc    string
	Params Params
}

// Params maps parameter names to their declarations.
type Params map[string]*Param

// Param declares one parameter. Every parameter has a default, so that a
// job always carries the complete set of values and its id does not depend
// on which defaults a script happened to spell out.
type Param struct {
	Name    string
	Doc     string
	Type    Type
	Default any      // bool, int64, float64 or string, per Type
	Min     *float64 // inclusive; int and float only
	Max     *float64 // inclusive; int and float only
	Choices []any    // allowed values, converted to Type; nil means any
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
		Methods  map[string]methodJSON `json:"methods"`
		Workload *paramSetJSON         `json:"workload"`
	}
	methodJSON struct {
		Doc    string               `json:"doc"`
		Params map[string]paramJSON `json:"params"`
	}
	paramSetJSON struct {
		Doc    string               `json:"doc"`
		Params map[string]paramJSON `json:"params"`
	}
	paramJSON struct {
		Type    Type         `json:"type"`
		Doc     string       `json:"doc"`
		Default any          `json:"default"`
		Min     *json.Number `json:"min"`
		Max     *json.Number `json:"max"`
		Choices []any        `json:"choices"`
	}
)

// identRE is what a parameter name must look like: scripts pass parameters
// as keyword arguments, so a name must be a valid Starlark identifier.
var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// methodRE keeps method names to what reads well in a list and a path.
var methodRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// reservedParams are keys with a meaning of their own in an extra point.
var reservedParams = []string{"method", "workload"}

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
	s := &Schema{Methods: make(map[string]*Method, len(w.Methods)), Workload: Params{}}
	for _, name := range sortedKeys(w.Methods) { // sorted: the same schema always reports the same error
		mj := w.Methods[name]
		if !methodRE.MatchString(name) {
			return nil, fmt.Errorf("method name %q is not valid (want %s)", name, methodRE)
		}
		ps, err := parseParams(mj.Params)
		if err != nil {
			return nil, fmt.Errorf("method %q: %w", name, err)
		}
		for _, r := range reservedParams {
			if _, ok := ps[r]; ok {
				return nil, fmt.Errorf("method %q: param name %q is reserved", name, r)
			}
		}
		s.Methods[name] = &Method{Name: name, Doc: mj.Doc, Params: ps}
	}
	if w.Workload != nil {
		ps, err := parseParams(w.Workload.Params)
		if err != nil {
			return nil, fmt.Errorf("workload: %w", err)
		}
		s.Workload = ps
	}
	return s, nil
}

func parseParams(in map[string]paramJSON) (Params, error) {
	out := make(Params, len(in))
	for _, name := range sortedKeys(in) {
		pj := in[name]
		if !identRE.MatchString(name) {
			return nil, fmt.Errorf("param name %q is not an identifier", name)
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
	p := &Param{Name: name, Doc: pj.Doc, Type: pj.Type}
	switch pj.Type {
	case TypeInt, TypeFloat, TypeStr, TypeBool:
	case "":
		return nil, errors.New(`"type" is missing`)
	default:
		return nil, fmt.Errorf("type %q is unknown (known: bool, float, int, str)", pj.Type)
	}
	bound := func(key string, n *json.Number) (*float64, error) {
		if n == nil {
			return nil, nil
		}
		if pj.Type != TypeInt && pj.Type != TypeFloat {
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
	return p, nil
}

// fromJSON turns a decoded JSON scalar into the Go value check expects.
func fromJSON(v any) any {
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
	case nil:
		return "None"
	}
	return fmt.Sprint(v)
}

func formatBound(f float64) string {
	return strconv.FormatFloat(f, 'g', -1, 64)
}

// defaults returns a new map of every parameter's default.
func (ps Params) defaults() map[string]any {
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

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
