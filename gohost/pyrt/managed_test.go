package pyrt

import (
	"context"
	"io"
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

// A venv directory without its ready marker is never trusted: the build
// replaces it, where the rename into place failed on every bootstrap.
func TestBuildVenvReplacesAnUnfinishedOne(t *testing.T) {
	cache := t.TempDir()
	uv := filepath.Join(cache, "tools", "uv-"+UVVersion, "uv")
	os.MkdirAll(filepath.Dir(uv), 0o755)
	// "uv venv ... DIR" makes DIR; "uv sync" installs nothing.
	script := "#!/bin/sh\nif [ \"$1\" = venv ]; then for a; do last=$a; done; mkdir -p \"$last/bin\"; fi\n"
	if err := os.WriteFile(uv, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	venv := filepath.Join(cache, "venvs", "abc")
	if err := os.MkdirAll(filepath.Join(venv, "lib", "half-installed"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := ManagedConfig{CacheDir: cache, Project: Project{Pyproject: []byte("[project]\n"), Lock: []byte("version = 1\n"), From: "test"},
		Log: zerolog.Nop(), Progress: io.Discard}
	if err := buildVenv(context.Background(), cfg, "/usr/bin/python3", venv); err != nil {
		t.Fatal(err)
	}
	if !isFile(filepath.Join(venv, readyMarker)) {
		t.Error("the built venv has no ready marker")
	}
	if _, err := os.Stat(filepath.Join(venv, "lib", "half-installed")); !os.IsNotExist(err) {
		t.Errorf("the unfinished venv's files are still there: %v", err)
	}
	if stale, _ := filepath.Glob(venv + ".build-*"); len(stale) != 0 {
		t.Errorf("build directories left: %v", stale)
	}
}
