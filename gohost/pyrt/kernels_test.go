package pyrt

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/fstest"
)

func mkKernels(t *testing.T, dir string, withGoMod bool) {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(dir, "kernels_py"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "kernels_py", "__init__.py"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if withGoMod {
		if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module x\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

var embedded = fstest.MapFS{
	"kernels_py/__init__.py":               {Data: []byte("")},
	"kernels_py/worker.py":                 {Data: []byte("print('hi')\n")},
	"kernels_py/__pycache__/x.cpython.pyc": {Data: []byte("junk")},
	"pyproject.toml":                       {Data: []byte("[project]\n")},
	"uv.lock":                              {Data: []byte("version = 1\n")},
}

func TestResolveKernels(t *testing.T) {
	checkout := t.TempDir()
	mkKernels(t, checkout, true)
	deep := filepath.Join(checkout, "a", "b")
	if err := os.MkdirAll(deep, 0o755); err != nil {
		t.Fatal(err)
	}
	flagDir := t.TempDir()
	mkKernels(t, flagDir, false)
	outside := t.TempDir()
	noGoMod := t.TempDir() // kernels_py but no go.mod: not a checkout
	mkKernels(t, noGoMod, false)
	cache := t.TempDir()

	tests := []struct {
		name       string
		flag, cwd  string
		wantDir    string
		wantSource string
		wantErr    string
	}{
		{name: "flag wins", flag: flagDir, cwd: checkout, wantDir: flagDir, wantSource: "--kernels"},
		{name: "flag without kernels_py", flag: outside, cwd: checkout, wantErr: "no kernels_py package there"},
		{name: "flag naming the package itself", flag: filepath.Join(flagDir, "kernels_py"), cwd: checkout,
			wantErr: "is the kernels_py package itself: give the directory that holds it, --kernels " + flagDir},
		{name: "flag naming no directory", flag: filepath.Join(outside, "nope"), cwd: checkout, wantErr: "nope: no such directory"},
		{name: "checkout root", cwd: checkout, wantDir: checkout, wantSource: "checkout"},
		{name: "inside a checkout", cwd: deep, wantDir: checkout, wantSource: "checkout"},
		{name: "outside any checkout", cwd: outside, wantSource: "embedded"},
		{name: "kernels_py without go.mod is not a checkout", cwd: noGoMod, wantSource: "embedded"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ResolveKernels(tc.flag, tc.cwd, embedded, cache)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, want error %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Source != tc.wantSource || (tc.wantDir != "" && got.Dir != tc.wantDir) {
				t.Fatalf("got %+v", got)
			}
			if got.Source == "embedded" {
				if !strings.HasPrefix(got.Dir, filepath.Join(cache, "kernels")) {
					t.Errorf("embedded copy at %s, outside the cache", got.Dir)
				}
				data, err := os.ReadFile(filepath.Join(got.Dir, "kernels_py", "worker.py"))
				if err != nil || string(data) != "print('hi')\n" {
					t.Errorf("extracted worker.py: %q, %v", data, err)
				}
				if _, err := os.Stat(filepath.Join(got.Dir, "kernels_py", "__pycache__")); err == nil {
					t.Error("bytecode cache was extracted")
				}
			}
		})
	}
}

func TestEmbeddedExtractionIsStableAndContentAddressed(t *testing.T) {
	cache := t.TempDir()
	a, err := extractEmbedded(embedded, cache)
	if err != nil {
		t.Fatal(err)
	}
	b, err := extractEmbedded(embedded, cache)
	if err != nil || a != b {
		t.Fatalf("second extraction: %s, %v; want %s", b, err, a)
	}
	changed := fstest.MapFS{"kernels_py/__init__.py": {Data: []byte("# edited\n")}}
	c, err := extractEmbedded(changed, cache)
	if err != nil || c == a {
		t.Fatalf("changed content extracted to %s (%v); want a new directory", c, err)
	}
	leftovers, _ := filepath.Glob(filepath.Join(cache, ".extract-*"))
	if len(leftovers) != 0 {
		t.Errorf("temporary directories left behind: %v", leftovers)
	}
}

func TestProjectFor(t *testing.T) {
	checkout := t.TempDir()
	mkKernels(t, checkout, true)
	os.WriteFile(filepath.Join(checkout, "pyproject.toml"), []byte("checkout"), 0o644)
	os.WriteFile(filepath.Join(checkout, "uv.lock"), []byte("checkout lock"), 0o644)
	bare := t.TempDir()
	mkKernels(t, bare, false)

	tests := []struct {
		name     string
		root     KernelsRoot
		wantFrom string
		wantPy   string
	}{
		{"checkout files", KernelsRoot{Dir: checkout, Source: "checkout"}, checkout, "checkout"},
		{"--kernels dir without a project", KernelsRoot{Dir: bare, Source: "--kernels"}, "embedded", "[project]\n"},
		{"embedded root", KernelsRoot{Dir: checkout, Source: "embedded"}, "embedded", "[project]\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := ProjectFor(tc.root, embedded)
			if err != nil {
				t.Fatal(err)
			}
			if p.From != tc.wantFrom || string(p.Pyproject) != tc.wantPy {
				t.Errorf("got from %q pyproject %q", p.From, p.Pyproject)
			}
		})
	}
}

func TestVenvKey(t *testing.T) {
	base := Project{Pyproject: []byte("a"), Lock: []byte("b")}
	if VenvKey(base) != VenvKey(Project{Pyproject: []byte("a"), Lock: []byte("b"), From: "elsewhere"}) {
		t.Error("key depends on where the files were read")
	}
	for _, p := range []Project{{Pyproject: []byte("a2"), Lock: []byte("b")}, {Pyproject: []byte("a"), Lock: []byte("b2")}, {Pyproject: []byte("ab"), Lock: nil}} {
		if VenvKey(p) == VenvKey(base) {
			t.Errorf("key of %q/%q equals the base key", p.Pyproject, p.Lock)
		}
	}
}

// PythonVersion must name the CPython that go.mod's go-embed-python carries.
func TestPythonVersionMatchesGoMod(t *testing.T) {
	gomod, err := os.ReadFile("../../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(gomod), "github.com/kluctl/go-embed-python v0.0.0-"+PythonVersion+"-") {
		t.Fatalf("go.mod's go-embed-python does not carry CPython %s", PythonVersion)
	}
}
