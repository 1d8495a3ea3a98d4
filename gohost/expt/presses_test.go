package expt

import (
	"strings"
	"testing"
)

// pressSchema is the schema kernels_py publishes, presses included.
func pressSchema(t *testing.T) *Schema {
	t.Helper()
	s, err := LoadSchema("../../kernels_py/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Methods["kvpress"].Presses) == 0 {
		t.Fatal("the schema lists no kvpress presses: regenerate it where kvpress imports (`workbench schema`)")
	}
	return s
}

// kvpressJob is an experiment with one kvpress job of the given fields.
func kvpressJob(fields string) string {
	return `experiment(name = "a", methods = ["full"], extra = [{"method": "kvpress", ` + fields + `}], workloads = [` + vlmWorkload + `])`
}

// vlmWorkload is a workload a press can run on (a model runs in it).
const vlmWorkload = `workload("vlm", model = "m", images = "i.png", prompt = "p")`

// press_args that the knobs set, that set a name twice or that hold a value
// of the wrong type fail the plan: presses.make would override the knobs
// (while the results record them), keep the last of two, or fail in the job.
func TestPressArgsThatFailThePlan(t *testing.T) {
	s := pressSchema(t)
	tests := []struct{ name, fields, want string }{
		{"compression_ratio", `"press": "SnapKVPress", "press_args": "compression_ratio=0.9"`,
			`method "kvpress": press_args: set compression_ratio with the method's compression_ratio knob (compression_ratio = 0.9), not in press_args`},
		{"compression_ratio of a wrapper that takes one", `"press": "LUKVPress", "inner_press": "SnapKVPress", "press_args": "sink=2,compression_ratio=0.3"`,
			`press_args: set compression_ratio with the method's compression_ratio knob (compression_ratio = 0.3)`},
		{"a name twice", `"press": "SnapKVPress", "press_args": "window_size=32,window_size=64"`,
			`press_args "window_size=32,window_size=64" sets window_size twice: keep one`},
		{"a name twice, spaced", `"press": "SnapKVPress", "press_args": "window_size=32, kernel_size=3 ,window_size =64"`,
			`sets window_size twice: keep one`},
		{"a name twice without a press", `"press": "none", "press_args": "window_size=32,window_size=64"`,
			`sets window_size twice: keep one`},
		{"the wrapped press with inner_press", `"press": "AdaKVPress", "inner_press": "SnapKVPress", "press_args": "press=TOVAPress"`,
			`press_args: AdaKVPress's press is the press it wraps: name it with inner_press (e.g. inner_press = "SnapKVPress"), not in press_args`},
		{"the wrapped press without inner_press", `"press": "KeyRerotationPress", "press_args": "press=KnormPress"`,
			`press_args: KeyRerotationPress's press is the press it wraps: name it with inner_press`},
		{"the wrapped base_press", `"press": "DecodingPress", "inner_press": "SnapKVPress", "press_args": "base_press=KnormPress"`,
			`press_args: DecodingPress's base_press is the press it wraps`},
		{"the wrapped presses", `"press": "ComposedPress", "inner_press": "SnapKVPress", "press_args": "presses=KnormPress"`,
			`press_args: ComposedPress's presses are the presses it wraps: name them with inner_press (e.g. inner_press = "SnapKVPress, KnormPress")`},
		{"inner_press in press_args", `"press": "TOVAPress", "press_args": "inner_press=SnapKVPress"`,
			`press_args: TOVAPress takes no parameter "inner_press": inner_press is a knob of the method, set it there (inner_press = "SnapKVPress")`},
		{"press in press_args of a press that wraps none", `"press": "TOVAPress", "press_args": "press=SnapKVPress"`,
			`press_args: TOVAPress takes no parameter "press": press is a knob of the method, set it there (press = "SnapKVPress")`},
		{"an int that is not", `"press": "SnapKVPress", "press_args": "window_size=abc"`,
			`press_args: SnapKVPress's window_size takes an int, not "abc"`},
		{"an int that is a float", `"press": "SnapKVPress", "press_args": "kernel_size=5.0"`,
			`press_args: SnapKVPress's kernel_size takes an int, not "5.0"`},
		{"an int that is empty", `"press": "SnapKVPress", "press_args": "window_size="`,
			`press_args: SnapKVPress's window_size takes an int, not ""`},
		{"an int that is a list", `"press": "SnapKVPress", "press_args": "window_size=32;64"`,
			`press_args: SnapKVPress's window_size takes an int, not "32;64"`},
		{"none where it takes none", `"press": "SnapKVPress", "press_args": "window_size=none"`,
			`press_args: SnapKVPress's window_size takes an int, not "none"`},
		{"a float that is not", `"press": "AdaKVPress", "inner_press": "SnapKVPress", "press_args": "alpha_safeguard=high"`,
			`press_args: AdaKVPress's alpha_safeguard takes a float, not "high"`},
		{"a bool that is not", `"press": "ExpectedAttentionPress", "press_args": "use_covariance=yes"`,
			`press_args: ExpectedAttentionPress's use_covariance takes a bool (true or false), not "yes"`},
		{"a bool that is a number", `"press": "ExpectedAttentionPress", "press_args": "use_vnorm=1"`,
			`press_args: ExpectedAttentionPress's use_vnorm takes a bool (true or false), not "1"`},
		{"a str read as a number", `"press": "KVComposePress", "press_args": "agg_task=5"`,
			`press_args: KVComposePress's agg_task takes a str, not "5" (press_args reads it as an int)`},
		{"a str read as a bool", `"press": "KVComposePress", "press_args": "agg_head=True"`,
			`press_args: KVComposePress's agg_head takes a str, not "True" (press_args reads it as a bool)`},
		{"a str read as none", `"press": "KVComposePress", "press_args": "agg_head=none"`,
			`press_args: KVComposePress's agg_head takes a str, not "none" (press_args reads it as none)`},
		{"a nullable int that is not", `"press": "RandomPress", "press_args": "seed=x"`,
			`press_args: RandomPress's seed takes an int or none, not "x"`},
		{"a list of one", `"press": "PerLayerCompressionPress", "inner_press": "SnapKVPress", "press_args": "compression_ratios=0.5"`,
			`press_args: PerLayerCompressionPress's compression_ratios takes a list of floats (items separated by semicolons, e.g. 0.5;0.25), not "0.5"`},
		{"a list with an item that is not", `"press": "PerLayerCompressionPress", "inner_press": "SnapKVPress", "press_args": "compression_ratios=0.5;half"`,
			`compression_ratios takes a list of floats (items separated by semicolons, e.g. 0.5;0.25), not "0.5;half"`},
		{"a list with an empty item", `"press": "PerLayerCompressionPress", "inner_press": "SnapKVPress", "press_args": "compression_ratios=0.5;"`,
			`not "0.5;"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadSource("x.star", []byte(kvpressJob(tt.fields)), s)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %v\nwant  %s", err, tt.want)
			}
		})
	}
	// The grid's compression_ratio in press_args fails at the grid too.
	src := `experiment(name = "x", methods = ["kvpress"], grid = {"press": ["SnapKVPress"], "press_args": ["compression_ratio=0.9"]}, workloads = [` + vlmWorkload + `])`
	if _, err := LoadSource("x.star", []byte(src), s); err == nil || !strings.Contains(err.Error(), `x.star:1:47: experiment "x": method "kvpress" with press_args="compression_ratio=0.9": press_args: set compression_ratio`) {
		t.Errorf("err = %v", err)
	}
}

// Values of the parameters' types plan, as do parameters whose type the
// schema does not give, whatever their value.
func TestPressArgsThatPlan(t *testing.T) {
	s := pressSchema(t)
	for _, fields := range []string{
		`"press": "SnapKVPress", "compression_ratio": 0.9, "press_args": "window_size=32, kernel_size = 5"`,
		`"press": "SnapKVPress", "press_args": "window_size=+1_024,kernel_size=٣"`,
		`"press": "AdaKVPress", "inner_press": "SnapKVPress", "press_args": "alpha_safeguard=1"`,
		`"press": "CapPress", "press_args": "tau=2.5,epsilon=1e-6,n_sink=0"`,
		`"press": "CapPress", "press_args": "tau=.5,epsilon=1.E-6"`,
		`"press": "CapPress", "press_args": "tau=inf"`,
		`"press": "ExpectedAttentionPress", "press_args": "use_covariance=false,use_vnorm=True"`,
		`"press": "ExpectedAttentionStatsPress", "press_args": "dataset_name=kmfoda/booksum,stats_folder=none"`,
		`"press": "RandomPress", "press_args": "seed=none"`,
		`"press": "RandomPress", "press_args": "seed=-3"`,
		`"press": "FinchPress", "press_args": "chunk_length=None"`,
		`"press": "PerLayerCompressionPress", "inner_press": "SnapKVPress", "press_args": "compression_ratios=0.5;0.25"`,
		`"press": "PerLayerCompressionPress", "inner_press": "SnapKVPress", "press_args": "compression_ratios=1;0.25; 0"`,
		`"press": "KVzapPress", "press_args": "model_type=linear"`,                                 // a Literal: unchecked
		`"press": "PrefillDecodingPress", "press_args": "prefilling_press=none"`,                   // a press: unchecked
		`"press": "LUKVPress", "inner_press": "SnapKVPress", "press_args": "sink=2,window=8"`,      // a wrapper with a ratio of its own
		`"press": "ThinKPress", "press_args": "key_channel_compression_ratio=0.5,window_size=16"`,  // other ratios are the press's own
		`"press": "none", "press_args": "compression_ratio=0.9,window_size=abc,press=SnapKVPress"`, // no press reads them
	} {
		if _, err := LoadSource("x.star", []byte(kvpressJob(fields)), s); err != nil {
			t.Errorf("%s: %v", fields, err)
		}
	}
}

// pyValueKind reads values as presses._value does.
func TestPyValueKind(t *testing.T) {
	for raw, want := range map[string]string{
		"true": "bool", " False ": "bool", "TRUE": "bool", "none": "none", "None": "none",
		"0": "int", "-12": "int", "+7": "int", "1_000": "int", "٣": "int", "007": "int",
		"0.5": "float", "1.": "float", ".5": "float", "1e-6": "float", "1E+06": "float", "1_0.2_5": "float",
		"inf": "float", "-Infinity": "float", "nan": "float", "1e5_0": "float",
		"": "str", "abc": "str", "1__0": "str", "_1": "str", "1_": "str", "0x10": "str", "1e": "str", ".": "str",
		"1.5.2": "str", "e5": "str", "infinite": "str", "0.5;0.25": "str", "+": "str",
	} {
		if got := pyValueKind(raw); got != want {
			t.Errorf("pyValueKind(%q) = %q, want %q", raw, got, want)
		}
	}
}

// A schema whose press types Check cannot read is refused when loaded.
func TestPressTypesInTheSchema(t *testing.T) {
	press := func(entry string) string {
		return `{"methods": {"m": {"params": {` + pressParamsJSON + `}, "presses": {"P": ` + entry + `}}}, ` + oneWorkload + `}`
	}
	tests := []struct{ name, src, want string }{
		{"type of what it does not take", press(`{"params": ["a"], "types": {"b": "int"}}`), `P: type of "b", not one of its params`},
		{"unknown type", press(`{"params": ["a"], "types": {"a": "tensor"}}`), `P: "a" has type "tensor"; want one of bool, bools, float, floats, int, ints, str, strs`},
		{"nullable without a type", press(`{"params": ["a"], "nullable": ["a"]}`), `P: nullable "a" has no type`},
	}
	for _, tt := range tests {
		if _, err := ParseSchema([]byte(tt.src)); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: err = %v, want %s", tt.name, err, tt.want)
		}
	}
	if _, err := ParseSchema([]byte(press(`{"params": ["a", "b"], "types": {"a": "int", "b": "floats"}, "nullable": ["a"]}`))); err != nil {
		t.Error(err)
	}
}
