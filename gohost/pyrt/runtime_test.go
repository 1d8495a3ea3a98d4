package pyrt

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestResolveOrder(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "python3")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "venv-python")
	if err := os.Symlink(exe, link); err != nil {
		t.Fatal(err)
	}
	plain := filepath.Join(dir, "notexec")
	if err := os.WriteFile(plain, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	managed := &Runtime{Kind: Managed, Source: "managed", Python: "/cache/venv/bin/python"}
	managedFn := func(context.Context) (*Runtime, error) { return managed, nil }

	tests := []struct {
		name       string
		flag       string
		env        map[string]string
		managed    func(context.Context) (*Runtime, error)
		wantPython string
		wantKind   Kind
		wantSource string
		wantErr    string
	}{
		{name: "flag wins over env", flag: exe, env: map[string]string{EnvPython: "/elsewhere"}, managed: managedFn,
			wantPython: exe, wantKind: External, wantSource: "--python"},
		{name: "env when no flag", env: map[string]string{EnvPython: exe}, managed: managedFn,
			wantPython: exe, wantKind: External, wantSource: EnvPython},
		{name: "symlinked venv interpreter kept as named", flag: link, managed: managedFn,
			wantPython: link, wantKind: External, wantSource: "--python"},
		{name: "empty env falls through to managed", env: map[string]string{EnvPython: ""}, managed: managedFn,
			wantPython: managed.Python, wantKind: Managed, wantSource: "managed"},
		{name: "managed by default", managed: managedFn,
			wantPython: managed.Python, wantKind: Managed, wantSource: "managed"},
		{name: "nonexistent flag", flag: "/nonexistent", managed: managedFn, wantErr: "/nonexistent (from --python) does not exist"},
		{name: "nonexistent env", env: map[string]string{EnvPython: "/nope/python"}, wantErr: "(from WORKBENCH_PYTHON) does not exist"},
		{name: "directory", flag: dir, wantErr: "is a directory"},
		{name: "not executable", flag: plain, wantErr: "is not executable"},
		{name: "nothing at all", wantErr: "pass --python"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rt, err := Resolve(context.Background(), Options{
				PythonFlag: tc.flag,
				LookupEnv:  func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok },
				Managed:    tc.managed,
			})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, want an error containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if rt.Python != tc.wantPython || rt.Kind != tc.wantKind || rt.Source != tc.wantSource {
				t.Errorf("got %+v", rt)
			}
		})
	}
}
