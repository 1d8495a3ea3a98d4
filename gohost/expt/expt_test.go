package expt

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

func testSchema(t *testing.T) *Schema {
	t.Helper()
	s, err := LoadSchema("testdata/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func mustLoad(t *testing.T, s *Schema, src string) *Plan {
	t.Helper()
	p, err := LoadSource("x.star", []byte(src), s)
	if err != nil {
		t.Fatalf("LoadSource: %v", err)
	}
	return p
}

// desc is a job in one line: method(params)@seed, params sorted.
func desc(j Job) string {
	var ps []string
	for _, k := range sortedKeys(j.Params) {
		ps = append(ps, k+"="+formatValue(j.Params[k]))
	}
	return fmt.Sprintf("%s(%s)@%v", j.Method, strings.Join(ps, ","), j.Workload["seed"])
}

func descs(jobs []Job) []string {
	out := make([]string, len(jobs))
	for i, j := range jobs {
		out[i] = desc(j)
	}
	return out
}

func TestExpansionOrder(t *testing.T) {
	s := testSchema(t)
	plan, err := Load(context.Background(), "testdata/seeds.star", s)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range plan.Experiments {
		got = append(got, e.Name)
	}
	if want := []string{"seeds", "layers-2", "layers-8"}; !slices.Equal(got, want) {
		t.Fatalf("experiments = %v, want %v", got, want)
	}

	var want []string
	for seed := range 3 { // workloads, then methods, then the grid, first key slowest
		want = append(want,
			fmt.Sprintf("full()@%d", seed),
			fmt.Sprintf(`snapkv(budget=0.1,pooling="max",window=16)@%d`, seed),
			fmt.Sprintf(`snapkv(budget=0.1,pooling="max",window=64)@%d`, seed),
			fmt.Sprintf(`snapkv(budget=0.5,pooling="max",window=16)@%d`, seed),
			fmt.Sprintf(`snapkv(budget=0.5,pooling="max",window=64)@%d`, seed),
		)
	}
	want = append(want, // extras last, on the first workload
		`snapkv(budget=0.1,pooling="avg",window=32)@0`,
		`snapkv(budget=0.5,pooling="avg",window=32)@0`,
	)
	seeds := plan.Experiments[0]
	if got := descs(seeds.Jobs); !slices.Equal(got, want) {
		t.Errorf("seeds jobs:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if seeds.Timeout != DefaultTimeout {
		t.Errorf("seeds timeout = %v, want the default %v", seeds.Timeout, DefaultTimeout)
	}
	for _, j := range seeds.Jobs {
		if j.Workload["dtype"] != "float16" {
			t.Errorf("%s: workload dtype = %v, want float16", desc(j), j.Workload["dtype"])
		}
	}

	l2 := plan.Experiments[1]
	if got, want := descs(l2.Jobs), []string{"streamingllm(budget=0.25,sinks=0)@0", "streamingllm(budget=0.25,sinks=4)@0"}; !slices.Equal(got, want) {
		t.Errorf("layers-2 jobs = %v, want %v", got, want)
	}
	for _, j := range l2.Jobs {
		if j.Workload["layers"] != int64(2) || j.Timeout != 60*time.Second || j.Experiment != "layers-2" {
			t.Errorf("layers-2 job %+v: want layers 2, timeout 60s", j)
		}
	}
}

func TestQuickstartFile(t *testing.T) {
	s := testSchema(t)
	plan, err := Load(context.Background(), "testdata/quickstart.star", s)
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("testdata/quickstart.star")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(src)
	if plan.File != "testdata/quickstart.star" || plan.Hash != hex.EncodeToString(sum[:]) {
		t.Errorf("plan file/hash = %s %s", plan.File, plan.Hash)
	}
	e := plan.Experiments[0]
	want := []string{
		"full()@0", // once: full has no budget
		"h2o(budget=0.1,recent=0.5)@0", "h2o(budget=0.25,recent=0.5)@0", "h2o(budget=0.5,recent=0.5)@0",
		`snapkv(budget=0.1,pooling="max",window=32)@0`, `snapkv(budget=0.25,pooling="max",window=32)@0`, `snapkv(budget=0.5,pooling="max",window=32)@0`,
		"streamingllm(budget=0.1,sinks=4)@0", "streamingllm(budget=0.25,sinks=4)@0", "streamingllm(budget=0.5,sinks=4)@0",
		"h2o(budget=1.0,recent=0.5)@0",
	}
	if got := descs(e.Jobs); !slices.Equal(got, want) {
		t.Errorf("jobs:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if e.Name != "quickstart" || e.Doc != "Budget sweep, one workload." || e.Timeout != 300*time.Second || e.Pos != "testdata/quickstart.star:4:1" {
		t.Errorf("experiment = %q %q %v %q", e.Name, e.Doc, e.Timeout, e.Pos)
	}
	for _, j := range e.Jobs {
		if j.Timeout != 300*time.Second || j.ID != j.ComputeID() || len(j.ID) != 16 {
			t.Errorf("job %s: timeout %v id %q", desc(j), j.Timeout, j.ID)
		}
	}
}

func TestFullNotMultipliedByGrid(t *testing.T) {
	s := testSchema(t)
	tests := []struct {
		name string
		src  string
		want []string
	}{
		{
			name: "full alone in a budget grid is an error-free single job per workload",
			src: `experiment(name = "a", methods = ["full", "h2o"], grid = {"budget": [0.1, 0.5]},
                workloads = [workload(seed = 1), workload(seed = 2)])`,
			want: []string{
				"full()@1", "h2o(budget=0.1,recent=0.5)@1", "h2o(budget=0.5,recent=0.5)@1",
				"full()@2", "h2o(budget=0.1,recent=0.5)@2", "h2o(budget=0.5,recent=0.5)@2",
			},
		},
		{
			name: "a param only some methods have varies only those",
			src:  `experiment(name = "a", methods = ["h2o", "snapkv"], grid = {"window": [8, 16], "budget": [0.5]})`,
			want: []string{
				"h2o(budget=0.5,recent=0.5)@0",
				`snapkv(budget=0.5,pooling="max",window=8)@0`,
				`snapkv(budget=0.5,pooling="max",window=16)@0`,
			},
		},
		{
			name: "repeats are dropped, first kept",
			src: `experiment(name = "a", methods = ["h2o", "full", "h2o"], grid = {"budget": [0.5, 0.1, 0.5]},
                extra = [{"method": "h2o", "budget": 0.1}, {"method": "h2o", "recent": 0.25}, {"method": "full"}])`,
			want: []string{
				"h2o(budget=0.5,recent=0.5)@0", "h2o(budget=0.1,recent=0.5)@0", "full()@0",
				"h2o(budget=0.25,recent=0.25)@0",
			},
		},
		{
			name: "an extra may name its own workload",
			src: `w = [workload(seed = 3), workload(seed = 4)]
experiment(name = "a", methods = ["full"], workloads = w, extra = [{"method": "full", "workload": workload(seed = 9)}])`,
			want: []string{"full()@3", "full()@4", "full()@9"},
		},
		{
			name: "range and tuples are lists too",
			src:  `experiment(name = "a", methods = ("streamingllm",), grid = {"sinks": range(2)})`,
			want: []string{"streamingllm(budget=0.25,sinks=0)@0", "streamingllm(budget=0.25,sinks=1)@0"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			plan := mustLoad(t, s, tt.src)
			if got := descs(plan.Experiments[0].Jobs); !slices.Equal(got, tt.want) {
				t.Errorf("jobs:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tt.want, "\n"))
			}
		})
	}
}

func TestDefaultsFilled(t *testing.T) {
	s := testSchema(t)
	plan := mustLoad(t, s, `experiment(name = "a", methods = ["snapkv"], workloads = [workload(layers = 2)])`)
	j := plan.Experiments[0].Jobs[0]
	wantParams := map[string]any{"budget": 0.25, "window": int64(32), "pooling": "max"}
	wantWorkload := map[string]any{"seed": int64(0), "layers": int64(2), "tokens_per_image": int64(576), "dtype": "float32", "causal": true}
	if fmt.Sprint(j.Params) != fmt.Sprint(wantParams) {
		t.Errorf("params = %v, want %v", j.Params, wantParams)
	}
	if fmt.Sprint(j.Workload) != fmt.Sprint(wantWorkload) {
		t.Errorf("workload = %v, want %v", j.Workload, wantWorkload)
	}
	for k, v := range wantParams { // fmt.Sprint hides int64 vs float64
		if fmt.Sprintf("%T", j.Params[k]) != fmt.Sprintf("%T", v) {
			t.Errorf("params[%s] is %T, want %T", k, j.Params[k], v)
		}
	}
	// Jobs must not share maps: one caller editing a job leaves others alone.
	plan = mustLoad(t, s, `experiment(name = "a", methods = ["h2o"], grid = {"budget": [0.1, 0.2]})`)
	jobs := plan.Experiments[0].Jobs
	jobs[0].Workload["seed"] = int64(99)
	jobs[0].Params["recent"] = 0.0
	if jobs[1].Workload["seed"] != int64(0) || jobs[1].Params["recent"] != 0.5 {
		t.Errorf("jobs share maps: %v %v", jobs[1].Workload, jobs[1].Params)
	}
}

func TestIDsStable(t *testing.T) {
	s := testSchema(t)
	ids := func(src string) []string {
		t.Helper()
		var out []string
		for _, j := range mustLoad(t, s, src).Experiments[0].Jobs {
			out = append(out, j.ID)
		}
		return out
	}
	base := `experiment(name = "a", methods = ["full", "h2o"], grid = {"budget": [0.1, 1.0]}, workloads = [workload()])`
	tests := []struct {
		name string
		src  string
	}{
		{"same script again", base},
		{"defaults spelt out", `experiment(name = "a", methods = ["full", "h2o"], grid = {"budget": [0.1, 1.0], "recent": [0.5]},
            workloads = [workload(seed = 0, layers = 4, tokens_per_image = 576, dtype = "float32", causal = True)], timeout = 5, doc = "x")`},
		{"int for a float param", `experiment(name = "a", methods = ["full", "h2o"], grid = {"budget": [0.1, 1]})`},
		{"built by code", `b = [x / 10 for x in [1, 10]]
experiment(name = "a", methods = ["full"] + ["h2o"], grid = grid(budget = b))`},
		{"the default workload named", `experiment(name = "a", methods = ["full", "h2o"], grid = {"budget": [0.1, 1.0]}, workloads = [workload("synthetic")])`},
		{"old word for methods", `experiment(name = "a", policies = ["full", "h2o"], grid = {"budget": [0.1, 1.0]})`},
		{"workload derived from another", `w = workload(seed = 5)
experiment(name = "a", methods = ["full", "h2o"], grid = {"budget": [0.1, 1.0]}, workloads = [workload(**dict(w, seed = 0))])`},
	}
	want := ids(base)
	if len(want) != 3 {
		t.Fatalf("base ids = %v, want 3", want)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ids(tt.src); !slices.Equal(got, want) {
				t.Errorf("ids = %v, want %v", got, want)
			}
		})
	}
	// Negative zero equals zero, so it is the same job.
	if a, b := ids(`experiment(name = "a", methods = ["h2o"], grid = {"budget": [0.0]})`),
		ids(`experiment(name = "a", methods = ["h2o"], grid = {"budget": [-0.0]})`); !slices.Equal(a, b) {
		t.Errorf("-0.0 and 0.0 give ids %v and %v", a, b)
	}
	// The experiment name is part of a job's identity; the timeout is not.
	if a, b := ids(`experiment(name = "a", methods = ["full"])`), ids(`experiment(name = "b", methods = ["full"])`); slices.Equal(a, b) {
		t.Errorf("experiments a and b share ids %v", a)
	}
	if a, b := ids(`experiment(name = "a", methods = ["full"], timeout = 1)`), ids(`experiment(name = "a", methods = ["full"], timeout = 2)`); !slices.Equal(a, b) {
		t.Errorf("timeouts change ids: %v vs %v", a, b)
	}
}

// A knob added with IDOmitsDefault keeps the ids of the jobs planned before
// it while it holds its default, and makes other jobs when set.
func TestKnobsAddedAtTheirDefaultKeepIDs(t *testing.T) {
	ids := func(s *Schema, src string) []string {
		t.Helper()
		var out []string
		for _, j := range mustLoad(t, s, src).Experiments[0].Jobs {
			out = append(out, j.ID)
		}
		return out
	}
	script := func(workload string) string {
		return `experiment(name = "a", methods = ["full", "h2o"], grid = {"budget": [0.1, 1.0]}, workloads = [` + workload + `])`
	}
	before := ids(testSchema(t), script("workload()"))

	s := testSchema(t)
	s.Workloads["synthetic"].Params["video"] = &Param{Name: "video", Type: TypeBool, Default: false, IDOmitsDefault: true}
	s.Workloads["synthetic"].Params["rho"] = &Param{Name: "rho", Type: TypeFloat, Default: 0.0, IDOmitsDefault: true}
	s.Methods["h2o"].Params["window"] = &Param{Name: "window", Type: TypeInt, Default: int64(0), IDOmitsDefault: true}
	for _, src := range []string{script("workload()"), script("workload(video = False, rho = 0)")} {
		if got := ids(s, src); !slices.Equal(got, before) {
			t.Errorf("%s: ids %v, want those before the knobs %v", src, got, before)
		}
	}
	plan := mustLoad(t, s, script("workload(video = True)"))
	job := plan.Experiments[0].Jobs[1]
	if job.Workload["rho"] != 0.0 || job.Params["window"] != int64(0) {
		t.Errorf("the job still carries every knob: params %v, workload %v", job.Params, job.Workload)
	}
	if !slices.Equal(job.OutOfID, []string{"params.window", "workload.rho"}) {
		t.Errorf("OutOfID = %v", job.OutOfID)
	}
	canonical := string(job.CanonicalJSON())
	if !strings.Contains(canonical, `"video":true`) || strings.Contains(canonical, "rho") || strings.Contains(canonical, "window") {
		t.Errorf("canonical JSON %s: want video, without rho and window", canonical)
	}
	if got := ids(s, script("workload(video = True)")); slices.Contains(before, got[0]) || slices.Contains(before, got[1]) {
		t.Errorf("video = True kept an id of the jobs without it: %v, %v", got, before)
	}
	if got := ids(s, `experiment(name = "a", methods = ["h2o"], grid = {"budget": [0.1], "window": [4]})`); slices.Contains(before, got[0]) {
		t.Errorf("window = 4 kept an id of the jobs without it: %v", got)
	}
}

func TestScriptFeatures(t *testing.T) {
	s := testSchema(t)
	plan := mustLoad(t, s, `
w = workload(seed = 7, dtype = "bfloat16")
print(w["seed"], w.layers, w.dtype, len(w), sorted(w.keys()) if hasattr(w, "keys") else list(w))
print(w == workload(dtype = "bfloat16", seed = 7), w != workload(), {w: 1}[workload(seed = 7, dtype = "bfloat16")])
print(product([1, 2], ["a"]))
print(product(x = [1], y = [2, 3]))
print(grid(budget = [0.1]), "%s-%d" % ("n", 3), "{}{}".format("a", 1))
experiment(name = "a", methods = ["full"], workloads = [w])
`)
	want := []string{
		`x.star:3:1: 7 4 bfloat16 5 ["causal", "dtype", "layers", "seed", "tokens_per_image"]`,
		`x.star:4:1: True True 1`,
		`x.star:5:1: [(1, "a"), (2, "a")]`,
		`x.star:6:1: [{"x": 1, "y": 2}, {"x": 1, "y": 3}]`,
		`x.star:7:1: {"budget": [0.1]} n-3 a1`,
	}
	if !slices.Equal(plan.Prints, want) {
		t.Errorf("prints:\n%s\nwant:\n%s", strings.Join(plan.Prints, "\n"), strings.Join(want, "\n"))
	}
}

// A script saved with a UTF-8 byte order mark (as some editors write one)
// reads as it does without: the same jobs, the same positions in errors.
func TestByteOrderMark(t *testing.T) {
	s := testSchema(t)
	tests := []struct {
		name, src string
		want      string // the error; "": the plan of the script without the mark
	}{
		{"plan", `experiment(name = "a", methods = ["h2o"], grid = {"budget": [0.1, 0.5]})`, ""},
		{"error on the first line", `experiment(name = "a", methods = ["h2oo"])`, `x.star:1:35: experiment "a": method "h2oo" is unknown`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			plain, plainErr := LoadSource("x.star", []byte(tc.src), s)
			marked, err := LoadSource("x.star", append([]byte("\ufeff"), tc.src...), s)
			if tc.want != "" {
				if plainErr == nil || err == nil || !strings.HasPrefix(err.Error(), tc.want) || err.Error() != plainErr.Error() {
					t.Fatalf("with the mark: %v\nwithout: %v\nwant both to start %q", err, plainErr, tc.want)
				}
				return
			}
			if plainErr != nil || err != nil {
				t.Fatalf("with the mark: %v; without: %v", err, plainErr)
			}
			if got, want := descs(marked.Experiments[0].Jobs), descs(plain.Experiments[0].Jobs); !slices.Equal(got, want) || len(got) != 2 {
				t.Errorf("jobs %v, want %v", got, want)
			}
			if marked.Hash == plain.Hash {
				t.Errorf("the hash is of the file as it is, mark included: both %s", marked.Hash)
			}
		})
	}
}

// A script that fails still shows what it printed before: print() is how
// one finds out why a list or a comprehension is not what was meant.
func TestPrintsBeforeAnError(t *testing.T) {
	s := testSchema(t)
	for _, tc := range []struct {
		name, src string
		want      []string
	}{
		{"a value the schema rejects", "B = [0.5, 2.0]\nprint(\"budgets\", B)\nexperiment(name = \"a\", methods = [\"h2o\"], grid = {\"budget\": B})",
			[]string{`x.star:2:1: budgets [0.5, 2.0]`}},
		{"a runtime error", "print(1)\nprint(2)\nx = [][0]", []string{"x.star:1:1: 1", "x.star:2:1: 2"}},
		{"no experiment", `print(product([1], [2]))`, []string{`x.star:1:1: [(1, 2)]`}},
		{"nothing printed", `x = [][0]`, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LoadSource("x.star", []byte(tc.src), s)
			var se *ScriptError
			if !errors.As(err, &se) {
				t.Fatalf("got %v, want a ScriptError", err)
			}
			if !slices.Equal(se.Prints, tc.want) {
				t.Errorf("prints %q, want %q", se.Prints, tc.want)
			}
		})
	}
}

func TestErrors(t *testing.T) {
	s := testSchema(t)
	tests := []struct {
		name string
		src  string
		want string // the complete message, position first
	}{
		// Syntax, resolution and runtime errors from Starlark itself.
		{"syntax", "experiment(name = \"a\",\n    methods = [\"full\"]\n", `x.star:3:1: got end of file, want ')'`},
		// Python that Starlark lacks: what to write instead, beside the parser's words.
		{"f-string", "b = 1\nexperiment(name = f\"abl_{b}\", methods = [\"full\"])", `x.star:2:29: got string literal, want ',' (Starlark has no f-strings: write "abl_%s" % x or "abl_{}".format(x))`},
		{"adjacent strings are no f-string", `x = "a" "b"`, `x.star:1:12: got string literal, want newline`},
		{"power", `x = 2 ** 3`, `x.star:1:9: got '**', want newline (Starlark has no ** operator: multiply, or write the number, e.g. 1e-3)`},
		{"import", "import math", `x.star:1:1: got import, want primary expression (Starlark has no import: a script has the built-ins experiment, workload, grid and product, and Starlark's own, such as range, len and sorted)`},
		{"raise", `raise ValueError("no")`, `x.star:1:1: got raise, want primary expression (Starlark has no raise: fail("why") stops the script with a message)`},
		{"assert", `assert 1 == 1`, `x.star:1:9: got int literal, want newline (Starlark has no assert: write if not ...: fail("why"))`},
		{"try", "try:\n    pass\nexcept:\n    pass", `x.star:1:1: got try, want primary expression (Starlark has no try; see https://github.com/bazelbuild/starlark/blob/master/spec.md)`},
		{"undefined name", `experimnt(name = "a")`, `x.star:1:1: undefined: experimnt`},
		{"runtime", "def f(x):\n    return x // 0\nf(1)\n", `x.star:2:14: floored division by zero`},
		{"runtime in a built-in", `experiment(name = "a", methods = ["full"], doc = len(3))`, `x.star:1:50: len: value of type int has no len`},
		{"load", `load("other.star", "x")`, `x.star:1:6: load is not allowed: an experiment script must be self-contained`},
		{"no experiment", `x = 1`, `x.star:1:1: the script declares no experiment (call experiment(name=..., methods=[...]))`},

		// experiment() arguments.
		{"unknown method", "wl = workload(seed=0)\n\nexperiment(\n    name = \"q\",\n    methods = [\"full\", \"h2oo\"],\n)\n",
			`x.star:5:24: experiment "q": method "h2oo" is unknown (did you mean "h2o"?) (known: full, h2o, snapkv, streamingllm)`},
		{"unknown method via a variable", "M = [\"h2oo\"]\nexperiment(\n    name = \"q\",\n    methods = M,\n)\n",
			`x.star:4:5: experiment "q": method "h2oo" is unknown (did you mean "h2o"?) (known: full, h2o, snapkv, streamingllm)`},
		{"method not a string", `experiment(name = "q", methods = ["full", 3])`, `x.star:1:43: experiment "q": methods[1]: want a method name (str), got int 3`},
		{"methods a string", `experiment(name = "q", methods = "full")`, `x.star:1:24: experiment "q": methods: want a list of method names, got string "full"`},
		{"empty methods", `experiment(name = "q", methods = [])`, `x.star:1:24: experiment "q": methods is empty`},
		{"missing methods", `experiment(name = "q")`, `x.star:1:1: experiment "q": methods is required`},
		{"missing name", "\nexperiment(methods = [\"full\"])", `x.star:2:1: experiment: name is required`},
		{"bad name", `experiment(name = "Q!", methods = ["full"])`, `x.star:1:12: experiment "Q!": name must match [a-z0-9_-]+`},
		{"name not a string", `experiment(name = 1, methods = ["full"])`, `x.star:1:12: experiment: name: want str, got int 1`},
		{"duplicate name", "experiment(name = \"a\", methods = [\"full\"])\nexperiment(name = \"a\", methods = [\"h2o\"])",
			`x.star:2:12: experiment "a": name already used by the experiment at x.star:1:1`},
		{"unknown argument", `experiment(name = "a", methods = ["full"], grids = {})`,
			`x.star:1:44: experiment: unknown argument "grids" (known: doc, extra, grid, methods, name, protocol, timeout, workloads)`},
		{"positional argument", `experiment("a", ["full"])`, `x.star:1:1: experiment: takes keyword arguments only, e.g. experiment(name="q", methods=["full"])`},
		{"repeated argument", `experiment(name = "a", methods = ["full"], **{"name": "b"})`, `x.star:1:12: experiment: argument "name" given twice`},
		{"timeout zero", `experiment(name = "a", methods = ["full"], timeout = 0)`, `x.star:1:44: experiment "a": timeout: 0 seconds is out of range (want 1 to 9223372036)`},
		{"timeout float", `experiment(name = "a", methods = ["full"], timeout = 1.5)`, `x.star:1:44: experiment "a": timeout: want whole seconds (int), got float 1.5`},
		{"doc not a string", `experiment(name = "a", methods = ["full"], doc = 1)`, `x.star:1:44: experiment "a": doc: want str, got int 1`},

		// Grid.
		{"grid param of no listed method", "experiment(\n    name = \"a\",\n    methods = [\"full\", \"h2o\"],\n    grid = {\"budgte\": [0.1]},\n)",
			`x.star:4:13: experiment "a": grid param "budgte" is not a param of any listed method (did you mean "budget"?) (full: none; h2o: budget, recent)`},
		{"grid workload param", `experiment(name = "a", methods = ["h2o"], grid = {"seed": [0, 1]})`,
			`x.star:1:51: experiment "a": grid param "seed" is a workload param, not a method param: use workloads=[workload(seed=v) for v in ...]`},
		// As compare --by names it.
		{"grid workload param by its column's name", `experiment(name = "a", methods = ["h2o"], grid = {"workload.seed": [0, 1]})`,
			`x.star:1:51: experiment "a": grid param "workload.seed" is a workload param, not a method param: use workloads=[workload(seed=v) for v in ...]`},
		{"grid param of a workload other than the default", `experiment(name = "a", methods = ["h2o"], grid = {"path": ["t.safetensors"]})`,
			`x.star:1:51: experiment "a": grid param "path" is a workload param (of trace), not a method param: use workloads=[workload(wl, path=v) for v in ...] with wl your workload("trace", ...)`},
		{"grid wrong type", `experiment(name = "a", methods = ["snapkv"], grid = {"window": [16, "big"]})`,
			`x.star:1:69: experiment "a": grid["window"][1]: want int, got str "big" (method "snapkv"; window: int in [1, 1024], default 32)`},
		{"grid float for int", `experiment(name = "a", methods = ["snapkv"], grid = grid(window = [16.0]))`,
			`x.star:1:68: experiment "a": grid["window"][0]: want int, got float 16.0 (method "snapkv"; window: int in [1, 1024], default 32)`},
		{"grid out of range", "experiment(\n    name = \"a\",\n    methods = [\"h2o\"],\n    grid = {\"budget\": [0.5,\n                       1.5]},\n)",
			`x.star:5:24: experiment "a": grid["budget"][1]: 1.5 is above the maximum 1 (method "h2o"; budget: float in [0, 1], default 0.25: fraction of the cache kept [H2O section 5])`},
		{"grid choices", `experiment(name = "a", methods = ["snapkv"], grid = {"pooling": ["max", "mean"]})`,
			`x.star:1:73: experiment "a": grid["pooling"][1]: "mean" is not one of "max", "avg" (method "snapkv"; pooling: str in {"max", "avg"}, default "max")`},
		{"grid nan", `experiment(name = "a", methods = ["h2o"], grid = {"budget": [float("nan")]})`,
			`x.star:1:62: experiment "a": grid["budget"][0]: nan is not a finite number (method "h2o"; budget: float in [0, 1], default 0.25: fraction of the cache kept [H2O section 5])`},
		{"grid scalar", `experiment(name = "a", methods = ["h2o"], grid = {"budget": 0.5})`,
			`x.star:1:51: experiment "a": grid["budget"]: want a list of values, got float 0.5 (write [x] for a single value)`},
		{"grid empty list", `experiment(name = "a", methods = ["h2o"], grid = {"budget": []})`, `x.star:1:51: experiment "a": grid["budget"] is empty`},
		{"grid not a dict", `experiment(name = "a", methods = ["h2o"], grid = [0.5])`,
			`x.star:1:43: experiment "a": grid: want a dict of param name to list of values, got list [0.5]`},

		// Workloads.
		{"unknown workload param", "wl = workload(\n    seeds = 1)", `x.star:2:5: workload: param "seeds" is unknown (did you mean "seed"?) (known: causal, dtype, layers, seed, tokens_per_image)`},
		{"workload float for int", `workload(layers = 2.5)`, `x.star:1:10: workload: param "layers": want int, got float 2.5 (layers: int >= 1, default 4)`},
		{"workload bool for int", `workload(seed = True)`, `x.star:1:10: workload: param "seed": want int, got bool True (seed: int, default 0)`},
		{"workload below min", `workload(layers = 0)`, `x.star:1:10: workload: param "layers": 0 is below the minimum 1 (layers: int >= 1, default 4)`},
		{"workload choices", `workload(dtype = "fp8")`, `x.star:1:10: workload: param "dtype": "fp8" is not one of "float32", "float16", "bfloat16" (dtype: str in {"float32", "float16", "bfloat16"}, default "float32")`},
		{"workload huge int", `workload(seed = 1 << 70)`, `x.star:1:10: workload: param "seed": integer 1180591620717411303424 does not fit in 64 bits (seed: int, default 0)`},
		{"workload list", `workload(seed = [1])`, `x.star:1:10: workload: param "seed": want int, got list [1] (seed: int, default 0)`},
		{"workload positional", `workload(1)`, `x.star:1:10: workload: the first argument names the workload (str) or is a workload to start from, got int 1; knobs are keyword arguments, e.g. workload("synthetic", seed=0)`},
		{"workloads of dicts", `experiment(name = "a", methods = ["full"], workloads = [{"seed": 1}])`,
			`x.star:1:57: experiment "a": workloads[0]: want a workload(...) value, got dict {"seed": 1} (wrap a dict d as workload(**d))`},
		{"workloads empty", `experiment(name = "a", methods = ["full"], workloads = [])`,
			`x.star:1:44: experiment "a": workloads is empty (leave it out for the default workload)`},

		// Extras.
		{"extra unknown param", "experiment(\n    name = \"a\",\n    methods = [\"h2o\"],\n    extra = [{\"method\": \"full\", \"budget\": 1.0}],\n)",
			`x.star:4:33: experiment "a": extra[0]: param "budget" is unknown for method "full" (known: none)`},
		{"extra workload param", `experiment(name = "a", methods = ["h2o"], extra = [{"method": "h2o", "seed": 1}])`,
			`x.star:1:70: experiment "a": extra[0]: param "seed" is a workload param, not a param of method "h2o": ` +
				`give the point a workload of its own, "workload": workload(wl, seed=...) with wl the synthetic workload it varies`},
		{"extra unknown method", `experiment(name = "a", methods = ["h2o"], extra = [dict(method = "h3o")])`,
			`x.star:1:57: experiment "a": extra[0]: method "h3o" is unknown (did you mean "h2o"?) (known: full, h2o, snapkv, streamingllm)`},
		{"extra without method", `experiment(name = "a", methods = ["h2o"], extra = [{"budget": 0.5}])`,
			`x.star:1:52: experiment "a": extra[0]: "method" is required`},
		{"extra out of range", `experiment(name = "a", methods = ["h2o"], extra = [{"method": "h2o", "recent": -1}])`,
			`x.star:1:70: experiment "a": extra[0]: param "recent" of method "h2o": -1 is below the minimum 0 (recent: float in [0, 1], default 0.5)`},
		{"extra bad workload", `experiment(name = "a", methods = ["h2o"], extra = [{"method": "h2o", "workload": 1}])`,
			`x.star:1:70: experiment "a": extra[0]: workload: want a workload(...) value, got int 1`},

		// Errors raised inside a def point at the call inside the def.
		{"inside a function", "def add(n):\n    experiment(name = n, methods = [\"nope\"])\n\nadd(\"a\")\n",
			`x.star:2:37: experiment "a": method "nope" is unknown (known: full, h2o, snapkv, streamingllm)`},

		// Helpers.
		{"product mixed", `product([1], x = [2])`, `x.star:1:1: product: give the lists either all positionally (tuples) or all by keyword (dicts)`},
		{"product not a list", `product([1], 2)`, `x.star:1:14: product: want lists, got int 2`},
		{"product too big", `r = list(range(1000))
product(r, r)`, `x.star:2:1: product: 100001 combinations, more than the limit of 100000`},
		{"grid helper not a list", `grid(budget = 0.5)`, `x.star:1:6: grid: "budget": want a list of values, got float 0.5`},
		{"too many jobs", `experiment(name = "a", methods = ["snapkv"], grid = {"budget": [x / 1000 for x in range(1000)], "window": range(1, 102)})`,
			`x.star:1:1: experiment "a": expands to more than 100000 jobs in this plan (the limit)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			plan, err := LoadSource("x.star", []byte(tt.src), s)
			if err == nil {
				t.Fatalf("LoadSource succeeded with %d experiments, want error %q", len(plan.Experiments), tt.want)
			}
			var se *ScriptError
			if !errors.As(err, &se) {
				t.Fatalf("error %v (%T) is not a *ScriptError", err, err)
			}
			if err.Error() != tt.want {
				t.Errorf("error:\n got %s\nwant %s", err, tt.want)
			}
			if pos, _, _ := strings.Cut(tt.want, ": "); se.Pos != pos {
				t.Errorf("Pos = %q, want %q", se.Pos, pos)
			}
		})
	}
}

func TestEndlessLoopIsBounded(t *testing.T) {
	s := testSchema(t)
	tests := []struct {
		name string
		src  string
		pos  string
	}{
		{"while", "experiment(name = \"a\", methods = [\"full\"])\nn = 0\nwhile True:\n    n += 1\n", "x.star:4:"},
		{"huge for", "n = 0\nfor i in range(1 << 40):\n    n += i\n", "x.star:2:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			_, err := LoadSource("x.star", []byte(tt.src), s)
			var se *ScriptError
			if !errors.As(err, &se) {
				t.Fatalf("err = %v, want a *ScriptError", err)
			}
			if !strings.HasPrefix(se.Pos, tt.pos) || se.Msg != "script ran for more than 10000000 steps (an endless loop?)" {
				t.Errorf("err = %v", err)
			}
			t.Logf("stopped after %v: %v", time.Since(start), err)
		})
	}
}

func TestContextCancel(t *testing.T) {
	s := testSchema(t)
	dir := t.TempDir()
	script := dir + "/loop.star"
	if err := os.WriteFile(script, []byte("experiment(name = \"a\", methods = [\"full\"])\nn = 0\nwhile True:\n    n += 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(10*time.Millisecond, cancel)
	_, err := Load(ctx, script, s)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	// Not the position: Starlark's position table places some loop
	// instructions at the last positioned statement before the loop.
	var se *ScriptError
	if !errors.As(err, &se) || se.Msg != "evaluation cancelled: context canceled" {
		t.Errorf("err = %v, want a *ScriptError saying it was cancelled", err)
	}

	// Already cancelled: nothing runs.
	if _, err := Load(ctx, "testdata/quickstart.star", s); !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", err)
	}
}

func TestLoadErrors(t *testing.T) {
	s := testSchema(t)
	if _, err := Load(context.Background(), "testdata/missing.star", s); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: err = %v, want ErrNotExist", err)
	}
	if _, err := LoadSource("x.star", []byte(`experiment(name = "a", methods = ["full"])`), nil); err == nil {
		t.Error("nil schema: no error")
	}
	_, err := Load(context.Background(), "testdata/bad_method.star", s)
	if want := `testdata/bad_method.star:5:24: experiment "q": method "h2oo" is unknown (did you mean "h2o"?) (known: full, h2o, snapkv, streamingllm)`; err == nil || err.Error() != want {
		t.Errorf("err = %v, want %s", err, want)
	}
}

func TestWorkloadsByName(t *testing.T) {
	s := testSchema(t)
	plan := mustLoad(t, s, `experiment(name = "a", methods = ["full"], workloads = [workload(), workload("trace", path = "b.safetensors")],
    extra = [{"method": "full", "workload": workload("trace")}])`)
	jobs := plan.Experiments[0].Jobs
	if len(jobs) != 3 {
		t.Fatalf("%d jobs, want 3", len(jobs))
	}
	if jobs[0].WorkloadName != "synthetic" || jobs[1].WorkloadName != "trace" || jobs[2].WorkloadName != "trace" {
		t.Errorf("workload names %q %q %q", jobs[0].WorkloadName, jobs[1].WorkloadName, jobs[2].WorkloadName)
	}
	if fmt.Sprint(jobs[1].Workload) != "map[path:b.safetensors seed:0]" || fmt.Sprint(jobs[2].Workload) != "map[path:t.safetensors seed:0]" {
		t.Errorf("trace workloads %v, %v", jobs[1].Workload, jobs[2].Workload)
	}
	// The synthetic workload's jobs keep the ids they had before workloads had
	// names; any other workload's name is part of the id.
	unnamed := jobs[0]
	unnamed.WorkloadName = ""
	if unnamed.ComputeID() != jobs[0].ID || strings.Contains(string(jobs[0].CanonicalJSON()), "workload_name") {
		t.Errorf("synthetic job %s: %s", jobs[0].ID, jobs[0].CanonicalJSON())
	}
	renamed := jobs[1]
	renamed.WorkloadName = "other"
	if !strings.Contains(string(jobs[1].CanonicalJSON()), `"workload_name":"trace"`) || renamed.ComputeID() == jobs[1].ID {
		t.Errorf("trace job: %s", jobs[1].CanonicalJSON())
	}
	// A workload derived from another keeps its kind and knobs.
	derived := mustLoad(t, s, `base = workload("trace", path = "c.safetensors")
experiment(name = "a", methods = ["full"], workloads = [workload(base, seed = 2)])`).Experiments[0].Jobs[0]
	if derived.WorkloadName != "trace" || fmt.Sprint(derived.Workload) != "map[path:c.safetensors seed:2]" {
		t.Errorf("derived workload %s %v", derived.WorkloadName, derived.Workload)
	}
	// Same knobs on two workloads are two values.
	if p := mustLoad(t, s, `print(workload("trace") == workload("trace"), workload("trace", seed = 1) == workload(seed = 1))
experiment(name = "a", methods = ["full"])`); !slices.Equal(p.Prints, []string{"x.star:1:1: True False"}) {
		t.Errorf("prints %v", p.Prints)
	}

	for src, want := range map[string]string{
		`workload("trac")`:                        `x.star:1:10: workload: "trac" is unknown (did you mean "trace"?) (known: synthetic, trace)`,
		`workload("trace", layers = 2)`:           `x.star:1:19: workload: param "layers" is unknown (known: path, seed)`,
		`workload("synthetic", "trace")`:          `x.star:1:1: workload: takes the workload's name and keyword arguments, e.g. workload("synthetic", seed=0)`,
		`workload(workload("trace"), layers = 2)`: `x.star:1:29: workload: param "layers" is unknown (known: path, seed)`,
	} {
		_, err := LoadSource("x.star", []byte(src), s)
		if err == nil || err.Error() != want {
			t.Errorf("%s: err = %v\nwant %s", src, err, want)
		}
	}
}

func TestOldWordsWarn(t *testing.T) {
	s := testSchema(t)
	old := mustLoad(t, s, `experiment(
    name = "a",
    policies = ["h2o"],
    extra = [{"policy": "full"}, {"method": "h2o", "budget": 0.5}],
)`)
	current := mustLoad(t, s, `experiment(name = "a", methods = ["h2o"], extra = [{"method": "full"}, {"method": "h2o", "budget": 0.5}])`)
	if got, want := descs(old.Experiments[0].Jobs), descs(current.Experiments[0].Jobs); !slices.Equal(got, want) {
		t.Errorf("old words give %v, want %v", got, want)
	}
	want := []string{
		`x.star:3:5: experiment: "policies" is the old word for methods; write methods=[...]`,
		`x.star:4:15: experiment "a": extra[0]: "policy" is the old word; write "method"`,
	}
	if !slices.Equal(old.Warnings, want) || len(current.Warnings) != 0 {
		t.Errorf("warnings:\n%s\nwant:\n%s (and none for the current words: %v)", strings.Join(old.Warnings, "\n"), strings.Join(want, "\n"), current.Warnings)
	}
	for src, want := range map[string]string{
		`experiment(name = "a", methods = ["h2o"], policies = ["full"])`:                          `x.star:1:43: experiment: give methods only (policies is its old name)`,
		`experiment(name = "a", methods = ["h2o"], extra = [{"method": "h2o", "policy": "h2o"}])`: `x.star:1:70: experiment "a": extra[0]: give "method" only ("policy" is its old name)`,
	} {
		_, err := LoadSource("x.star", []byte(src), s)
		if err == nil || err.Error() != want {
			t.Errorf("%s: err = %v\nwant %s", src, err, want)
		}
	}
}

// Constraints between knobs are in the schema: plan rejects a job that
// breaks one, at the place in the script that made it, before any Python.
func TestRulesFailThePlan(t *testing.T) {
	s, err := LoadSchema("../../kernels_py/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct{ name, src, want string }{
		{"heads % kv_heads", "experiment(name = \"a\", methods = [\"full\"],\n    workloads = [workload(heads = 6, kv_heads = 4)])",
			`x.star:2:18: workload "synthetic": heads=6 must be a multiple of kv_heads=4`},
		{"odd head_dim", `w = workload(head_dim = 63)`, `x.star:1:5: workload "synthetic": head_dim=63 must be even (RoPE rotates channel pairs)`},
		{"groups in a grid", `experiment(name = "a", methods = ["attentionpack"], grid = {"groups": ["1:1", "0.5:1,0.4:0.25"]})`,
			`x.star:1:53: experiment "a": method "attentionpack": groups="0.5:1,0.4:0.25": the token fractions must sum to 1`},
		{"groups rank order", `experiment(name = "a", methods = ["attentionpack"], extra = [{"method": "attentionpack", "groups": "0.5:0.5,0.5:1"}])`,
			`x.star:1:62: experiment "a": extra[0]: method "attentionpack": groups="0.5:0.5,0.5:1": rank fractions must start at 1 (full rank for the most important group) and never increase`},
		{"groups form", `experiment(name = "a", methods = ["attentionpack"], grid = {"groups": ["0.5,0.5"]})`,
			`x.star:1:72: experiment "a": grid["groups"][0]: "0.5,0.5" is not well-formed (method "attentionpack"; groups: str`},
		{"cross-field on a method", `experiment(name = "a", methods = ["zipvl"], grid = {"probe_recent": [0], "probe_random": [0]})`,
			`x.star:1:45: experiment "a": method "zipvl" with probe_random=0 probe_recent=0: probe_recent + probe_random must be at least 1`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadSource("x.star", []byte(tt.src), s)
			if err == nil || !strings.HasPrefix(err.Error(), tt.want) {
				t.Errorf("err = %v\nwant  %s", err, tt.want)
			}
		})
	}
	// The paper's groups pass.
	if _, err := LoadSource("x.star", []byte(`experiment(name = "a", methods = ["attentionpack"], grid = {"groups": ["0.25:1,0.75:0.25", ".5:1,.5:.25"]})`), s); err != nil {
		t.Error(err)
	}
}

// A protocol sets its params on every job of the experiment, under what
// the grid and extra give; without one, jobs are at the methods' defaults.
func TestProtocolSetsParams(t *testing.T) {
	s, err := LoadSchema("../../kernels_py/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	src := `experiment(name = "p", protocol = "vlcache", methods = ["h2o"], grid = {"budget": [0.1]},
    extra = [{"method": "h2o", "recent_fraction": 0.3}, {"method": "snapkv"}])
experiment(name = "q", methods = ["h2o"])
`
	plan, err := LoadSource("x.star", []byte(src), s)
	if err != nil {
		t.Fatal(err)
	}
	p, q := plan.Experiments[0], plan.Experiments[1]
	if p.Protocol != "vlcache" || q.Protocol != DefaultProtocol {
		t.Fatalf("protocols %q and %q", p.Protocol, q.Protocol)
	}
	want := []map[string]any{
		{"budget": 0.1, "recent_fraction": 0.1, "evict_while_decoding": true},
		{"budget": 0.2, "recent_fraction": 0.3, "evict_while_decoding": true}, // extra's own value wins
		{"window": int64(0), "evict_while_decoding": true},
	}
	for i, w := range want {
		for k, v := range w {
			if got := p.Jobs[i].Params[k]; got != v {
				t.Errorf("job %d (%s): %s = %v, want %v", i, p.Jobs[i].Method, k, got, v)
			}
		}
	}
	if got := q.Jobs[0].Params; got["recent_fraction"] != 0.5 || got["evict_while_decoding"] != true {
		t.Errorf("without a protocol: %v", got)
	}
	_, err = LoadSource("x.star", []byte(`experiment(name = "a", methods = ["h2o"], protocol = "vlcahe")`), s)
	if err == nil || !strings.Contains(err.Error(), `protocol "vlcahe" is unknown (did you mean "vlcache"?) (known: paper, vlcache)`) {
		t.Errorf("misspelt protocol: %v", err)
	}
}

// A renamed method is refused with what it is now.
func TestRenamedMethodSaysWhatItIsNow(t *testing.T) {
	s, err := LoadSchema("../../kernels_py/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, src := range []string{`experiment(name = "a", methods = ["zipcache"])`,
		`experiment(name = "a", methods = ["full"], extra = [{"method": "zipcache"}])`} {
		_, err := LoadSource("x.star", []byte(src), s)
		if err == nil || !strings.Contains(err.Error(), `method "zipcache" is now "zipvl_fixed": it is ZipVL's fixed-ratio baseline`) {
			t.Errorf("%s: %v", src, err)
		}
	}
}

func TestRunawayMemoryIsBounded(t *testing.T) {
	s := testSchema(t)
	// A value doubled 22 to 26 times is 64 MiB: far over this budget, yet
	// small enough that the test stays cheap where nothing stops it. The
	// loop after it holds the value while the heap is read, however late
	// the watch gets a core (GOMAXPROCS=1 preempts only every 10ms); the
	// doubling line is where a script that never stops growing is caught.
	t.Setenv(MaxMemoryEnv, "8")
	const hold = "for i in range(3000000):\n    pass\n"
	tests := []struct {
		name string
		src  string
		pos  []string
	}{
		{"string", "s = \"a\"\nfor i in range(26):\n    s = s + s\n" + hold, []string{"x.star:3:", "x.star:4:", "x.star:5:"}},
		{"list", "experiment(name = \"a\", methods = [\"full\"])\nl = [0]\nfor i in range(22):\n    l = l + l\n" + hold, []string{"x.star:4:", "x.star:5:", "x.star:6:"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadSource("x.star", []byte(tt.src), s)
			var se *ScriptError
			if !errors.As(err, &se) {
				t.Fatalf("err = %v, want a *ScriptError", err)
			}
			want := "script used more than 8 MiB of memory (a value that grows without bound?); VLKV_SCRIPT_MEMORY=MiB sets the limit"
			if !slices.ContainsFunc(tt.pos, func(p string) bool { return strings.HasPrefix(se.Pos, p) }) || se.Msg != want {
				t.Errorf("err = %v, want at %v: %s", err, tt.pos, want)
			}
		})
	}
}

func TestMaxMemoryEnv(t *testing.T) {
	tests := []struct {
		env     string
		want    uint64
		wantErr bool
	}{
		{"", DefaultMaxMemory, false},
		{"64", 64 << 20, false},
		{"0", 0, true},
		{"1GiB", 0, true},
		{"-1", 0, true},
	}
	for _, tt := range tests {
		t.Setenv(MaxMemoryEnv, tt.env)
		got, err := maxMemory()
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("%s=%q: got %d, %v; want %d (error %v)", MaxMemoryEnv, tt.env, got, err, tt.want, tt.wantErr)
		}
	}
	// A bad value fails the plan rather than running without a limit.
	t.Setenv(MaxMemoryEnv, "lots")
	if _, err := LoadSource("x.star", []byte(`experiment(name = "a", methods = ["full"])`), testSchema(t)); err == nil || !strings.Contains(err.Error(), MaxMemoryEnv) {
		t.Errorf("err = %v, want one naming %s", err, MaxMemoryEnv)
	}
}

// kvpress's press, press_args and inner_press are checked against the
// presses' constructors in the schema: what presses.make refuses in the job
// fails the plan, at the grid or extra that made it.
func TestPressesFailThePlan(t *testing.T) {
	s, err := LoadSchema("../../kernels_py/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Methods["kvpress"].Presses) == 0 {
		t.Fatal("the schema lists no kvpress presses: regenerate it where kvpress imports (`workbench schema`)")
	}
	// A press runs inside a model: the experiments run on a vlm workload,
	// given last so that the columns of the errors before it hold.
	extra := func(fields string) string {
		return `experiment(name = "a", methods = ["full"], extra = [{"method": "kvpress", ` + fields + `}], workloads = [` + vlmWorkload + `])`
	}
	tests := []struct{ name, src, want string }{
		{"unknown press", `experiment(name = "a", methods = ["kvpress"], grid = {"press": ["SnapKVPress", "SnapKVPres"]}, workloads = [` + vlmWorkload + `])`,
			`x.star:1:47: experiment "a": method "kvpress" with press="SnapKVPres": press "SnapKVPres" is unknown (did you mean "SnapKVPress"?) (known: AdaKVPress, `},
		{"unknown parameter", extra(`"press": "SnapKVPress", "press_args": "window=32"`),
			`x.star:1:53: experiment "a": extra[0]: method "kvpress": press_args: SnapKVPress takes no parameter "window"; it takes: compression_ratio, window_size, kernel_size`},
		{"misspelt parameter", extra(`"press": "SnapKVPress", "press_args": "windowsize=32"`),
			`press_args: SnapKVPress takes no parameter "windowsize" (did you mean "window_size"?); it takes: compression_ratio, window_size, kernel_size`},
		{"not pairs", extra(`"press": "SnapKVPress", "press_args": "window_size"`),
			`method "kvpress": press_args "window_size": want name=value pairs separated by commas`},
		{"wrapper without inner", extra(`"press": "AdaKVPress"`),
			`AdaKVPress wraps another press: name it with inner_press (e.g. inner_press = "SnapKVPress")`},
		{"unknown inner", extra(`"press": "AdaKVPress", "inner_press": "SnapKVPress, TOVAPres"`),
			`inner_press: press "TOVAPres" is unknown (did you mean "TOVAPress"?)`},
		{"inner on a press that wraps none", extra(`"press": "TOVAPress", "inner_press": "SnapKVPress"`),
			`TOVAPress wraps no press: inner_press = "SnapKVPress" does not apply`},
		{"required parameter", extra(`"press": "PerLayerCompressionPress", "inner_press": "SnapKVPress"`),
			`PerLayerCompressionPress needs compression_ratios: set them in press_args`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadSource("x.star", []byte(tt.src), s)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %v\nwant  %s", err, tt.want)
			}
		})
	}
	// What presses.make builds passes: the defaults, parameters it takes, a
	// wrapper with its inner presses, and no press whatever press_args say
	// (a grid may set them for the presses beside it).
	for _, src := range []string{
		`experiment(name = "a", methods = ["kvpress"], workloads = [` + vlmWorkload + `])`,
		extra(`"press": "SnapKVPress", "press_args": "window_size=32, kernel_size=5"`),
		extra(`"press": "AdaKVPress", "inner_press": "SnapKVPress", "press_args": "alpha_safeguard=0.1"`),
		extra(`"press": "ComposedPress", "inner_press": "SnapKVPress, KnormPress"`),
		extra(`"press": "PerLayerCompressionPress", "inner_press": "SnapKVPress", "press_args": "compression_ratios=0.5;0.25"`),
		`experiment(name = "a", methods = ["kvpress"], grid = {"press": ["none", "SnapKVPress"], "press_args": ["window_size=8"]}, workloads = [` + vlmWorkload + `])`,
	} {
		if _, err := LoadSource("x.star", []byte(src), s); err != nil {
			t.Errorf("%s: %v", src, err)
		}
	}
}

// A job that could only fail when it runs fails the plan instead: a
// workload without the model or prompt it needs, a method that runs inside
// a model on a workload without one, and a knob the plan itself sets.
func TestJobsThatCouldOnlyFailAreRefused(t *testing.T) {
	s, err := LoadSchema("../../kernels_py/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct{ name, src, want string }{
		{"lmms without a model", `experiment(name = "a", methods = ["full"], workloads = [workload("lmms", tasks = "chartqa")])`,
			`x.star:1:57: experiment "a": workloads[0]: workload "lmms" needs model= (local model directory`},
		{"lmms without tasks", `experiment(name = "a", methods = ["full"], workloads = [workload("lmms", model = "m")])`,
			`workloads[0]: workload "lmms" needs tasks= (lmms-eval task names`},
		{"vlm without model and prompt", `experiment(name = "a", methods = ["full"], workloads = [workload(), workload("vlm")])`,
			`workloads[1]: workload "vlm" needs model= (local model directory (config.json, weights, processor files; nothing is downloaded)); prompt= (the prompt`},
		{"a trace without its file in an extra", `experiment(name = "a", methods = ["full"], extra = [{"method": "h2o", "workload": workload("trace")}])`,
			`x.star:1:53: experiment "a": extra[0]: workload "trace" needs path=`},
		{"a press on the default workload", `experiment(name = "a", methods = ["full", "kvpress"])`,
			`experiment "a": workloads[0]: method "kvpress" runs only inside a model, and workload "synthetic" runs none: give it one that does ("lmms", "vlm")`},
		{"a press in an extra on a trace", `experiment(name = "a", methods = ["full"], workloads = [workload("trace", path = "t.safetensors")], extra = [{"method": "kvpress"}])`,
			`extra[0]: method "kvpress" runs only inside a model, and workload "trace" runs none`},
		{"the shard the plan sets", `experiment(name = "a", methods = ["full"], workloads = [workload("lmms", model = "m", tasks = "t", shards = 2, shard = 1)])`,
			`x.star:1:112: workload: param "shard" is set by the plan from shards (one job for each of 0..shards-1): leave it out`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadSource("x.star", []byte(tt.src), s)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %v\nwant  %s", err, tt.want)
			}
		})
	}
	for _, src := range []string{
		`experiment(name = "a", methods = ["full", "kvpress"], workloads = [` + vlmWorkload + `, workload("lmms", model = "m", tasks = "t", shards = 2)])`,
		`experiment(name = "a", methods = ["full"], extra = [{"method": "kvpress", "workload": ` + vlmWorkload + `}])`,
		// a base workload may leave its model to the ones built from it
		"base = workload(\"vlm\", prompt = \"p\")\n" +
			`experiment(name = "a", methods = ["full"], workloads = [workload(base, model = "m", images = "i.png")])`,
	} {
		if _, err := LoadSource("x.star", []byte(src), s); err != nil {
			t.Errorf("%s: %v", src, err)
		}
	}
}

// A job spelt twice is planned once; where the grid makes it twice (a
// repeated value or workload) the plan says which, where an extra repeats a
// grid point (figures sharing points) it does not.
func TestRepeatedJobsArePlannedOnceWithAWarning(t *testing.T) {
	s := testSchema(t)
	for _, tc := range []struct {
		src, warning string
		jobs         int
	}{
		{`experiment(name = "a", methods = ["h2o"], grid = {"budget": [0.25, 0.5]})`, "", 2},
		{`experiment(name = "a", methods = ["h2o"], grid = {"budget": [0.25, 0.25]}, extra = [{"method": "h2o", "budget": 0.25}])`,
			`x.star:1:1: experiment "a": its grid and workloads make a job more than once (a repeated value, or two workloads alike), planned once: h2o at its defaults`, 1},
		{`experiment(name = "a", methods = ["h2o"], grid = {"budget": [0.25, 0.5]}, extra = [{"method": "h2o", "budget": 0.5}, {"method": "h2o", "budget": 0.75}])`,
			"", 3},
		{`experiment(name = "a", methods = ["h2o"], workloads = [workload(layers = 2), workload(layers = 2)])`,
			`x.star:1:1: experiment "a": its grid and workloads make a job more than once (a repeated value, or two workloads alike), planned once: h2o at its defaults`, 1},
		{`experiment(name = "a", methods = ["h2o"], grid = {"budget": [0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4, 0.4]})`,
			`x.star:1:1: experiment "a": its grid and workloads make 4 jobs more than once (a repeated value, or two workloads alike), each planned once: h2o with budget=0.1; h2o with budget=0.2; h2o with budget=0.3, and 1 more`, 4},
	} {
		plan := mustLoad(t, s, tc.src)
		if got := len(plan.Experiments[0].Jobs); got != tc.jobs {
			t.Errorf("%s: %d jobs, want %d", tc.src, got, tc.jobs)
		}
		var want []string
		if tc.warning != "" {
			want = []string{tc.warning}
		}
		if !slices.Equal(plan.Warnings, want) {
			t.Errorf("%s: warnings %q, want %q", tc.src, plan.Warnings, want)
		}
	}
}
