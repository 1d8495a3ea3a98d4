package expt

import (
	"math"
	"testing"
)

// The expected strings below were produced by CPython's
// json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False),
// the contract the canonical form promises.

func TestAppendFloatMatchesPython(t *testing.T) {
	tests := []struct {
		in   float64
		want string
	}{
		{1, "1.0"},
		{0.1, "0.1"},
		{1e16, "1e+16"},
		{1e15, "1000000000000000.0"},
		{123456789, "123456789.0"},
		{1e-5, "1e-05"},
		{0.0001, "0.0001"},
		{1.5e-7, "1.5e-07"},
		{-2.5, "-2.5"},
		{1e22, "1e+22"},
		{5e-324, "5e-324"},
		{math.MaxFloat64, "1.7976931348623157e+308"},
		{100, "100.0"},
		{1234.5678, "1234.5678"},
		{math.Copysign(0, -1), "-0.0"},
		{0, "0.0"},
		{0.30000000000000004, "0.30000000000000004"},
		{2.5e-5, "2.5e-05"},
		{9999999999999998, "9999999999999998.0"},
	}
	for _, tt := range tests {
		if got := string(appendFloat(nil, tt.in)); got != tt.want {
			t.Errorf("appendFloat(%v) = %s, want %s", tt.in, got, tt.want)
		}
	}
}

func TestAppendStringMatchesPython(t *testing.T) {
	got := string(appendString(nil, "a\"b\\c\n\t\x01\x7fé\u2028<>&"))
	want := "\"a\\\"b\\\\c\\n\\t\\u0001\x7fé\u2028<>&\""
	if got != want {
		t.Errorf("appendString = %s, want %s", got, want)
	}
}

func TestJobCanonicalJSONAndID(t *testing.T) {
	wl := map[string]any{"causal": true, "dtype": "float32", "layers": int64(4), "seed": int64(0), "tokens_per_image": int64(576)}
	tests := []struct {
		name      string
		job       Job
		canonical string
		id        string
	}{
		{
			name:      "h2o",
			job:       Job{Experiment: "quickstart", Method: "h2o", Params: map[string]any{"recent": 0.5, "budget": 0.1}, Workload: wl},
			canonical: `{"experiment":"quickstart","method":"h2o","params":{"budget":0.1,"recent":0.5},"workload":{"causal":true,"dtype":"float32","layers":4,"seed":0,"tokens_per_image":576}}`,
			id:        "8b6ea66bba89447c",
		},
		{
			name:      "no params is {} not null",
			job:       Job{Experiment: "quickstart", Method: "full", Workload: wl, Timeout: 123},
			canonical: `{"experiment":"quickstart","method":"full","params":{},"workload":{"causal":true,"dtype":"float32","layers":4,"seed":0,"tokens_per_image":576}}`,
			id:        "6d53b47b8634bf9d",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := string(tt.job.CanonicalJSON()); got != tt.canonical {
				t.Errorf("CanonicalJSON =\n%s\nwant\n%s", got, tt.canonical)
			}
			if got := tt.job.ComputeID(); got != tt.id {
				t.Errorf("ComputeID = %s, want %s", got, tt.id)
			}
		})
	}
}
