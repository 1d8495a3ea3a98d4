package pyrt

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"
)

// EnsureGroup syncs the group into the managed venv with the pinned uv,
// adding packages and removing none, once.
func TestEnsureGroup(t *testing.T) {
	cache := t.TempDir()
	calls := filepath.Join(cache, "calls")
	uv := filepath.Join(cache, "tools", "uv-"+UVVersion, "uv")
	os.MkdirAll(filepath.Dir(uv), 0o755)
	script := "#!/bin/sh\necho \"$* UV_PROJECT_ENVIRONMENT=$UV_PROJECT_ENVIRONMENT\" >> " + calls + "\n"
	if err := os.WriteFile(uv, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	venv := filepath.Join(cache, "venvs", "abc")
	os.MkdirAll(venv, 0o755)
	rt := &Runtime{Kind: Managed, Python: filepath.Join(venv, "bin", "python"), Venv: venv}
	cfg := ManagedConfig{CacheDir: cache, Project: Project{Pyproject: []byte("[project]\n"), Lock: []byte("version = 1\n")},
		Log: zerolog.Nop()}
	for i := 0; i < 2; i++ {
		if err := EnsureGroup(context.Background(), cfg, rt, "jupyter"); err != nil {
			t.Fatal(err)
		}
	}
	data, _ := os.ReadFile(calls)
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	if len(lines) != 1 {
		t.Fatalf("uv ran %d times, want once:\n%s", len(lines), data)
	}
	for _, want := range []string{"sync --frozen --no-config --inexact --group jupyter", "--python " + rt.Python,
		"UV_PROJECT_ENVIRONMENT=" + venv} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("uv %s: want %q", lines[0], want)
		}
	}
	if err := EnsureGroup(context.Background(), cfg, &Runtime{Kind: External, Python: "/usr/bin/python3"}, "jupyter"); err == nil {
		t.Error("a runtime of the user's own got the group installed")
	}
}
