package worker

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestParseDevice(t *testing.T) {
	tests := []struct {
		in      string
		want    Device
		wantErr bool
	}{
		{"cpu", CPU, false},
		{"CUDA", CUDA, false},
		{" auto ", Auto, false},
		{"gpu", "", true},
		{"", "", true},
	}
	for _, tc := range tests {
		got, err := ParseDevice(tc.in)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("ParseDevice(%q) = %q, %v; want %q, error %v", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
}

func TestResolveDevice(t *testing.T) {
	withGPU := t.TempDir()
	if err := os.MkdirAll(filepath.Join(withGPU, "dev"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(withGPU, "dev", "nvidia0"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	noGPU := t.TempDir()
	env := func(m map[string]string) func(string) (string, bool) {
		return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
	}
	tests := []struct {
		name string
		dev  Device
		env  map[string]string
		root string
		want Device
	}{
		{"explicit cpu on a GPU host", CPU, nil, withGPU, CPU},
		{"explicit cuda is kept", CUDA, nil, noGPU, CUDA},
		{"auto with a GPU", Auto, nil, withGPU, CUDA},
		{"auto without a GPU", Auto, nil, noGPU, CPU},
		{"auto with GPUs hidden", Auto, map[string]string{"CUDA_VISIBLE_DEVICES": ""}, withGPU, CPU},
		{"auto with GPUs disabled", Auto, map[string]string{"CUDA_VISIBLE_DEVICES": "-1"}, withGPU, CPU},
		{"auto with one GPU visible", Auto, map[string]string{"CUDA_VISIBLE_DEVICES": "0"}, withGPU, CUDA},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := ResolveDevice(tc.dev, env(tc.env), tc.root); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestEnvironment(t *testing.T) {
	env := Environment([]string{"HOME=/h", "PYTHONPATH=/user/lib", "TRITON_INTERPRET=0", "VLKV_DEVICE=cuda"}, "/kr", CPU)
	want := map[string]bool{"HOME=/h": true, "PYTHONPATH=/kr:/user/lib": true, "VLKV_DEVICE=cpu": true, "TRITON_INTERPRET=1": true, "PYTHONUNBUFFERED=1": true}
	if len(env) != len(want) {
		t.Fatalf("got %v", env)
	}
	for _, kv := range env {
		if !want[kv] {
			t.Errorf("unexpected %q in %v", kv, env)
		}
	}
	cuda := Environment([]string{"TRITON_INTERPRET=1"}, "/kr", CUDA) // a user's interpreter setting does not reach it
	if !slices.Contains(cuda, "VLKV_DEVICE=cuda") || !slices.Contains(cuda, "PYTHONPATH=/kr") {
		t.Errorf("a cuda worker's environment lacks its device or kernels root: %v", cuda)
	}
	for _, kv := range cuda {
		if strings.HasPrefix(kv, "TRITON_INTERPRET=") {
			t.Error("cuda workers must not run the interpreter")
		}
	}
}
