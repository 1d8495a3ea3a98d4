package expt

import (
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
)

func TestParseSchema(t *testing.T) {
	s := testSchema(t)
	if got := strings.Join(s.MethodNames(), ","); got != "full,h2o,snapkv,streamingllm" {
		t.Errorf("methods = %s", got)
	}
	budget := s.Methods["h2o"].Params["budget"]
	if budget.Type != TypeFloat || budget.Default != 0.25 || *budget.Min != 0 || *budget.Max != 1 || budget.Doc == "" {
		t.Errorf("h2o budget = %+v", budget)
	}
	// A float declared with an int default holds a float; an int holds int64.
	if v := s.Methods["h2o"].Params["recent"]; v.Default != 0.5 {
		t.Errorf("recent default = %#v", v.Default)
	}
	if budget.Ref != "H2O section 5" || budget.Describe() != "float in [0, 1], default 0.25: fraction of the cache kept [H2O section 5]" {
		t.Errorf("h2o budget ref %q, described as %q", budget.Ref, budget.Describe())
	}
	if s.DefaultWorkload != "synthetic" || strings.Join(s.WorkloadNames(), ",") != "synthetic,trace" {
		t.Errorf("workloads %v, default %q", s.WorkloadNames(), s.DefaultWorkload)
	}
	synthetic := s.Workloads["synthetic"].Params
	if v := synthetic["layers"]; v.Default != int64(4) {
		t.Errorf("layers default = %#v, want int64(4)", v.Default)
	}
	if got := strings.Join(synthetic.Names(), ","); got != "causal,dtype,layers,seed,tokens_per_image" {
		t.Errorf("workload params = %s", got)
	}
	tiny := s.Benchmarks["tiny"]
	if lengths := tiny.Params["lengths"]; lengths.Type != TypeInts || !slices.Equal(lengths.Default.([]int64), []int64{64, 128}) {
		t.Errorf("benchmark lengths = %+v", lengths)
	}
	if len(tiny.Columns) != 2 || tiny.Columns[1] != (Column{Name: "ms", Unit: "ms", Doc: "time", Label: "time", Show: true}) {
		t.Errorf("benchmark = %+v", tiny)
	}
	if op := s.Ops["attention_stats"]; op == nil || op.Benchmark != "tiny" || strings.Join(s.OpNames(), ",") != "attention_stats" {
		t.Errorf("ops = %v", s.Ops)
	}

	// What kernels_py/params.py writes for a str param: explicit null bounds.
	p, err := ParseSchema([]byte(`{"methods": {"m": {"params": {"x": {"type": "float", "default": 1, "doc": "d", "min": 0, "max": null}}}}, ` + oneWorkload + `}`))
	if err != nil {
		t.Fatal(err)
	}
	if x := p.Methods["m"].Params["x"]; x.Default != 1.0 || x.Max != nil || len(p.Benchmarks) != 0 {
		t.Errorf("x = %+v, benchmarks = %v", x, p.Benchmarks)
	}
}

// pressParamsJSON are the params a method that runs presses names them through.
const pressParamsJSON = `"press": {"type": "str", "default": "P"}, "press_args": {"type": "str", "default": ""}, "inner_press": {"type": "str", "default": ""}`

// oneWorkload completes a schema that tests something else.
const oneWorkload = `"workloads": {"w": {"params": {}}}, "default_workload": "w"`

func TestParamCheckLists(t *testing.T) {
	lengths := testSchema(t).Benchmarks["tiny"].Params["lengths"]
	tests := []struct {
		v       any
		wantErr string
	}{
		{[]int64{1, 4096}, ""},
		{[]int64{0}, "0 is below the minimum 1"},
		{[]int64{64, 5000}, "5000 is above the maximum 4096"},
		{int64(64), "want ints, got int 64"},
	}
	for _, tt := range tests {
		_, err := lengths.Check(tt.v)
		if (err == nil) != (tt.wantErr == "") || (err != nil && err.Error() != tt.wantErr) {
			t.Errorf("Check(%v) = %v, want %q", tt.v, err, tt.wantErr)
		}
	}
}

func TestClosest(t *testing.T) {
	names := []string{"budget", "recent_fraction", "sink_tokens", "window"}
	tests := []struct{ name, want string }{
		{"budgett", ` (did you mean "budget"?)`},
		{"budegt", ` (did you mean "budget"?)`},
		{"Window", ` (did you mean "window"?)`},
		{"sink_token", ` (did you mean "sink_tokens"?)`},
		{"alpha", ""},
		{"b", ""},
	}
	for _, tt := range tests {
		if got := Closest(tt.name, names); got != tt.want {
			t.Errorf("Closest(%q) = %q, want %q", tt.name, got, tt.want)
		}
	}
}

func TestParseSchemaErrors(t *testing.T) {
	method := func(params string) string {
		return `{"methods": {"m": {"params": {` + params + `}}}, ` + oneWorkload + `}`
	}
	tests := []struct {
		name, json, want string
	}{
		{"not json", `{`, "expt: schema: unexpected EOF"},
		{"trailing", `{"methods": {"m": {}}} {}`, "expt: schema: trailing data after the JSON object"},
		{"no methods", `{` + oneWorkload + `}`, `expt: schema: "methods" is missing or empty`},
		{"no workloads", `{"methods": {"m": {}}}`, `expt: schema: "workloads" is missing or empty`},
		{"unknown default workload", `{"methods": {"m": {}}, "workloads": {"w": {}}, "default_workload": "x"}`, `expt: schema: default_workload "x" is not one of the workloads (w)`},
		{"list for a method", method(`"x": {"type": "ints", "default": [1]}`), `expt: schema: method "m": param "x": type "ints" is only for benchmarks (job params are scalars)`},
		{"unknown field", `{"methods": {"m": {"parms": {}}}}`, `expt: schema: json: unknown field "parms"`},
		{"bad method name", `{"methods": {"a b": {}}}`, `expt: schema: method name "a b" is not valid (want ^[A-Za-z0-9][A-Za-z0-9_.-]*$)`},
		{"bad param name", method(`"x-y": {"type": "int", "default": 1}`), `expt: schema: method "m": param name "x-y" is not an identifier`},
		{"reserved", method(`"workload": {"type": "int", "default": 1}`), `expt: schema: method "m": param name "workload" is reserved`},
		{"no type", method(`"x": {"default": 1}`), `expt: schema: method "m": param "x": "type" is missing`},
		{"bad type", method(`"x": {"type": "double", "default": 1}`), `expt: schema: method "m": param "x": type "double" is unknown (known: bool, float, int, ints, str)`},
		{"no default", method(`"x": {"type": "int"}`), `expt: schema: method "m": param "x": "default" is missing`},
		{"null default", method(`"x": {"type": "int", "default": null}`), `expt: schema: method "m": param "x": "default" is missing`},
		{"default type", method(`"x": {"type": "int", "default": 1.5}`), `expt: schema: method "m": param "x": default: want int, got float 1.5`},
		{"default range", method(`"x": {"type": "float", "default": 2, "max": 1}`), `expt: schema: method "m": param "x": default: 2 is above the maximum 1`},
		{"min above max", method(`"x": {"type": "float", "default": 0, "min": 1, "max": 0}`), `expt: schema: method "m": param "x": min 1 is above max 0`},
		{"bound on str", method(`"x": {"type": "str", "default": "a", "min": 1}`), `expt: schema: method "m": param "x": "min" is only for int and float params`},
		{"empty choices", method(`"x": {"type": "str", "default": "a", "choices": []}`), `expt: schema: method "m": param "x": "choices" is empty`},
		{"choice type", method(`"x": {"type": "str", "default": "a", "choices": ["a", 1]}`), `expt: schema: method "m": param "x": choices[1]: want str, got int 1`},
		{"default not a choice", method(`"x": {"type": "str", "default": "c", "choices": ["a", "b"]}`), `expt: schema: method "m": param "x": default: "c" is not one of "a", "b"`},
		{"workload", `{"methods": {"m": {}}, "workloads": {"w": {"params": {"seed": {"type": "int", "default": true}}}}, "default_workload": "w"}`, `expt: schema: workload "w": param "seed": default: want int, got bool True`},
		{"benchmark flag taken", `{"methods": {"m": {}}, ` + oneWorkload + `, "benchmarks": {"b": {"params": {"json": {"type": "bool", "default": false}}}}}`, `expt: schema: benchmark "b": param name "json" is taken by a flag every benchmark has`},
		{"op without its benchmark", `{"methods": {"m": {}}, ` + oneWorkload + `, "ops": {"o": {"benchmark": "b"}}}`, `expt: schema: op "o": its benchmark "b" is not one of the benchmarks`},
		{"rule syntax", `{"methods": {"m": {"params": {"x": {"type": "int", "default": 1}}, "rules": [{"check": "x %", "message": "m"}]}}, ` + oneWorkload + `}`, `expt: schema: method "m": rules[0]: "x %": rule:1:4: got end of file, want primary expression`},
		{"rule unknown name", `{"methods": {"m": {"params": {"x": {"type": "int", "default": 1}}, "rules": [{"check": "y > 0", "message": "m"}]}}, ` + oneWorkload + `}`, `expt: schema: method "m": rules[0]: rule "y > 0": rule:1:1: undefined: y`},
		{"rule not bool", `{"methods": {"m": {"params": {"x": {"type": "int", "default": 1}}, "rules": [{"check": "x + 1", "message": "m"}]}}, ` + oneWorkload + `}`, `expt: schema: method "m": rules[0]: rule "x + 1": gives int, not a bool`},
		{"rule broken by defaults", `{"methods": {"m": {"params": {"x": {"type": "int", "default": 1}}, "rules": [{"check": "x % 2 == 0", "message": "x={x} must be even"}]}}, ` + oneWorkload + `}`, `expt: schema: method "m": rules[0]: the defaults break it: x=1 must be even`},
		{"rule message names an unknown param", `{"methods": {"m": {"params": {"x": {"type": "int", "default": 2}}, "rules": [{"check": "x % 2 == 0", "message": "x={y} must be even"}]}}, ` + oneWorkload + `}`, `expt: schema: method "m": rules[0]: rule message "x={y} must be even": format: keyword y not found`},
		{"rule message with a format spec", `{"methods": {"m": {"params": {"x": {"type": "int", "default": 2}}, "rules": [{"check": "x % 2 == 0", "message": "x={x:3d} must be even"}]}}, ` + oneWorkload + `}`, `expt: schema: method "m": rules[0]: rule message "x={x:3d} must be even": format spec features not supported in replacement fields: 3d`},
		{"rule without message", `{"methods": {"m": {"rules": [{"check": "True"}]}}, ` + oneWorkload + `}`, `expt: schema: method "m": rules[0]: want a check and a message`},
		{"pattern on int", method(`"x": {"type": "int", "default": 1, "pattern": "[0-9]+"}`), `expt: schema: method "m": param "x": "pattern" is only for str params`},
		{"paths on float", method(`"x": {"type": "float", "default": 1, "paths": true}`), `expt: schema: method "m": param "x": "paths" is only for str params`},
		{"bad pattern", method(`"x": {"type": "str", "default": "a", "pattern": "(a"}`), "expt: schema: method \"m\": param \"x\": pattern: error parsing regexp: missing closing ): `^(?:(a)$`"},
		{"default breaks pattern", method(`"x": {"type": "str", "default": "b", "pattern": "a+"}`), `expt: schema: method "m": param "x": default: "b" is not well-formed`},
		{"unknown protocol", `{"methods": {"m": {"params": {"x": {"type": "int", "default": 1}}, "protocols": {"q": {"x": 2}}}}, "protocols": {"p": "d"}, ` + oneWorkload + `}`, `expt: schema: method "m": protocol "q" is not one of the schema's protocols (p)`},
		{"protocol sets an unknown param", `{"methods": {"m": {"protocols": {"p": {"x": 2}}}}, "protocols": {"p": "d"}, ` + oneWorkload + `}`, `expt: schema: method "m": protocol "p" sets param "x", which the method does not have`},
		{"protocol value", `{"methods": {"m": {"params": {"x": {"type": "int", "default": 1, "max": 4}}, "protocols": {"p": {"x": 5}}}}, "protocols": {"p": "d"}, ` + oneWorkload + `}`, `expt: schema: method "m": protocol "p": param "x": 5 is above the maximum 4`},
		{"presses without a press param", `{"methods": {"m": {"presses": {"P": {"params": []}}}}, ` + oneWorkload + `}`, `expt: schema: method "m": presses: the method has no str param "press" to name a press through`},
		{"press requires what it does not take", `{"methods": {"m": {"params": {` + pressParamsJSON + `}, "presses": {"P": {"params": ["a"], "required": ["b"]}}}}, ` + oneWorkload + `}`, `expt: schema: method "m": presses: P: required "b" is not one of its params`},
		{"press wraps through what it does not take", `{"methods": {"m": {"params": {` + pressParamsJSON + `}, "presses": {"P": {"params": ["a"], "wraps": "press"}}}}, ` + oneWorkload + `}`, `expt: schema: method "m": presses: P: wraps through "press", not one of its params`},
		{"default press unknown", `{"methods": {"m": {"params": {` + pressParamsJSON + `}, "presses": {"Q": {"params": []}}}}, ` + oneWorkload + `}`, `expt: schema: method "m": presses: the defaults break it: press "P" is unknown (known: Q, none)`},
		{"benchmark list default", `{"methods": {"m": {}}, ` + oneWorkload + `, "benchmarks": {"b": {"params": {"n": {"type": "ints", "default": [1, "x"]}}}}}`, `expt: schema: benchmark "b": param "n": default: want ints, got []interface {} [1 x]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseSchema([]byte(tt.json))
			if err == nil || err.Error() != tt.want {
				t.Errorf("err = %v\nwant  %s", err, tt.want)
			}
		})
	}
}

func TestLoadSchemaFileErrors(t *testing.T) {
	if _, err := LoadSchema("testdata/nope.json"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("err = %v, want ErrNotExist", err)
	}
	path := t.TempDir() + "/s.json"
	if err := os.WriteFile(path, []byte(`{"methods": {}, `+oneWorkload+`}`), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := LoadSchema(path)
	if want := "expt: schema " + path + `: "methods" is missing or empty`; err == nil || err.Error() != want {
		t.Errorf("err = %v, want %s", err, want)
	}
}
