package pyrt

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// KernelsRoot is the directory put on the workers' PYTHONPATH: it holds kernels_py/.
type KernelsRoot struct {
	Dir    string `json:"dir"`
	Source string `json:"source"` // "--kernels", "checkout" or "embedded"
}

// Project is the Python project that pins the managed venv's dependencies.
type Project struct {
	Pyproject []byte
	Lock      []byte
	From      string // where the two files were read
}

// ResolveKernels picks the kernels root: --kernels DIR; else the checkout that
// cwd lies in (a directory with go.mod and kernels_py/), so edits are live;
// else the copy embedded in the binary, extracted under cacheDir.
func ResolveKernels(flag, cwd string, embedded fs.FS, cacheDir string) (KernelsRoot, error) {
	if flag != "" {
		dir, err := filepath.Abs(flag)
		if err != nil {
			return KernelsRoot{}, fmt.Errorf("--kernels %s: %w", flag, err)
		}
		if !hasKernels(dir) {
			return KernelsRoot{}, noKernelsError(flag, dir)
		}
		return KernelsRoot{Dir: dir, Source: "--kernels"}, nil
	}
	if dir, ok := findCheckout(cwd); ok {
		return KernelsRoot{Dir: dir, Source: "checkout"}, nil
	}
	dir, err := extractEmbedded(embedded, filepath.Join(cacheDir, "kernels"))
	if err != nil {
		return KernelsRoot{}, fmt.Errorf("extract embedded kernels_py: %w", err)
	}
	return KernelsRoot{Dir: dir, Source: "embedded"}, nil
}

// noKernelsError says why dir, given as --kernels flag, is no kernels root
// and what to give instead.
func noKernelsError(flag, dir string) error {
	want := filepath.Join(dir, "kernels_py", "__init__.py")
	if st, err := os.Stat(dir); err != nil {
		return fmt.Errorf("--kernels %s: no such directory; give the directory that holds kernels_py/ (a checkout's root)", flag)
	} else if !st.IsDir() {
		return fmt.Errorf("--kernels %s: not a directory; give the directory that holds kernels_py/ (a checkout's root)", flag)
	}
	if parent := filepath.Dir(dir); filepath.Base(dir) == "kernels_py" && hasKernels(parent) {
		return fmt.Errorf("--kernels %s is the kernels_py package itself: give the directory that holds it, --kernels %s", flag, parent)
	}
	return fmt.Errorf("--kernels %s: no kernels_py package there (want %s); give the directory that holds kernels_py/ (a checkout's root)", flag, want)
}

func hasKernels(dir string) bool {
	st, err := os.Stat(filepath.Join(dir, "kernels_py", "__init__.py"))
	return err == nil && st.Mode().IsRegular()
}

func findCheckout(cwd string) (string, bool) {
	dir, err := filepath.Abs(cwd)
	if err != nil {
		return "", false
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil && hasKernels(dir) {
			return dir, true
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", false
		}
		dir = parent
	}
}

// ProjectFor returns pyproject.toml and uv.lock from the kernels root when it
// has both (a checkout), else the copies embedded in the binary.
func ProjectFor(root KernelsRoot, embedded fs.FS) (Project, error) {
	if root.Source != "embedded" {
		py, err1 := os.ReadFile(filepath.Join(root.Dir, "pyproject.toml"))
		lock, err2 := os.ReadFile(filepath.Join(root.Dir, "uv.lock"))
		if err1 == nil && err2 == nil {
			return Project{Pyproject: py, Lock: lock, From: root.Dir}, nil
		}
	}
	py, err := fs.ReadFile(embedded, "pyproject.toml")
	if err != nil {
		return Project{}, fmt.Errorf("embedded pyproject.toml: %w", err)
	}
	lock, err := fs.ReadFile(embedded, "uv.lock")
	if err != nil {
		return Project{}, fmt.Errorf("embedded uv.lock: %w", err)
	}
	return Project{Pyproject: py, Lock: lock, From: "embedded"}, nil
}

// embeddedFiles lists the kernels_py sources of the embedded tree, leaving out
// bytecode caches a build may have swept in.
func embeddedFiles(embedded fs.FS) ([]string, error) {
	var files []string
	err := fs.WalkDir(embedded, "kernels_py", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "__pycache__" {
			return fs.SkipDir
		}
		if !d.IsDir() && !strings.HasSuffix(p, ".pyc") {
			files = append(files, p)
		}
		return nil
	})
	sort.Strings(files)
	return files, err
}

// extractEmbedded writes the embedded kernels_py to base/<content hash>, once:
// it is built in a temporary directory and renamed into place, so a
// half-written copy is never used.
func extractEmbedded(embedded fs.FS, base string) (string, error) {
	files, err := embeddedFiles(embedded)
	if err != nil {
		return "", err
	}
	if len(files) == 0 {
		return "", errors.New("the binary carries no kernels_py files")
	}
	h := sha256.New()
	for _, f := range files {
		data, err := fs.ReadFile(embedded, f)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s\x00%d\x00", f, len(data))
		h.Write(data)
	}
	dir := filepath.Join(base, hex.EncodeToString(h.Sum(nil))[:16])
	if hasKernels(dir) {
		return dir, nil
	}
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(base, ".extract-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	for _, f := range files {
		data, _ := fs.ReadFile(embedded, f)
		dst := filepath.Join(tmp, filepath.FromSlash(f))
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return "", err
		}
		if err := os.WriteFile(dst, data, 0o644); err != nil {
			return "", err
		}
	}
	if err := os.Rename(tmp, dir); err != nil {
		if hasKernels(dir) { // another process won the race
			return dir, nil
		}
		return "", err
	}
	return dir, nil
}
