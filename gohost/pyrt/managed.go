package pyrt

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/gofrs/flock"
	"github.com/kluctl/go-embed-python/python"
	"github.com/rs/zerolog"
)

const (
	// PythonVersion is the CPython that go-embed-python carries (see go.mod);
	// PyPI has torch 2.11 and triton 3.6 wheels for it.
	PythonVersion = "3.13.1"
	// UVVersion installs the locked dependencies; its wheel is pinned in uv.go.
	UVVersion = "0.13.9"

	readyMarker = ".vlkv-ready"
)

// ManagedConfig says where the managed runtime lives and what it must hold.
type ManagedConfig struct {
	CacheDir string  // e.g. ~/.cache/vlkv
	Project  Project // pyproject.toml + uv.lock
	Log      zerolog.Logger
	Progress io.Writer // receives the installers' progress output; nil discards it
	HTTP     *http.Client
}

// CacheDirEnv overrides CacheDir: a cache on a filesystem a cluster's
// nodes share, so the managed runtime is built once for all of them (its
// file lock keeps two nodes from building it at once).
const CacheDirEnv = "VLKV_CACHE_DIR"

// CacheDir is $VLKV_CACHE_DIR, else $XDG_CACHE_HOME/vlkv, else ~/.cache/vlkv.
func CacheDir() (string, error) {
	if dir := os.Getenv(CacheDirEnv); dir != "" {
		return filepath.Abs(dir)
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("find the user cache dir (set XDG_CACHE_HOME or HOME): %w", err)
	}
	return filepath.Join(base, "vlkv"), nil
}

// VenvKey identifies a venv by what determines its contents.
func VenvKey(p Project) string {
	h := sha256.New()
	for _, part := range [][]byte{p.Pyproject, p.Lock, []byte(PythonVersion), []byte(runtime.GOOS + "/" + runtime.GOARCH)} {
		fmt.Fprintf(h, "%d\x00", len(part))
		h.Write(part)
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// EnsureManaged returns the managed runtime, building what is missing: the
// extracted CPython, its C headers, and the venv for this project's lock.
// A venv is built in a temporary directory and renamed into place only when
// complete, so an interrupted bootstrap is never mistaken for a finished one.
func EnsureManaged(ctx context.Context, cfg ManagedConfig) (*Runtime, error) {
	if cfg.Progress == nil {
		cfg.Progress = io.Discard
	}
	ep, err := python.NewEmbeddedPythonWithTmpDir(filepath.Join(cfg.CacheDir, "python", "cpython-"+PythonVersion), true)
	if err != nil {
		return nil, fmt.Errorf("extract the embedded CPython %s: %w", PythonVersion, err)
	}
	base := ep.GetExtractedPath()
	basePython := filepath.Join(base, "bin", "python3")

	venv := filepath.Join(cfg.CacheDir, "venvs", VenvKey(cfg.Project))
	rt := &Runtime{Kind: Managed, Source: "managed", Python: filepath.Join(venv, "bin", "python"),
		Base: base, Venv: venv, Headers: isFile(headerPath(base))}
	if isFile(filepath.Join(venv, readyMarker)) {
		return rt, nil
	}

	// First bootstrap: fetch the headers too. A failure only matters on a GPU
	// (see EnsureHeaders), so it is a warning here and later runs do not retry.
	if !rt.Headers {
		if err := fetchHeaders(ctx, base, cfg); err != nil {
			cfg.Log.Warn().Err(err).Msg("no Python headers for the managed runtime: CPU runs are unaffected, " +
				"but Triton cannot build its GPU launcher; on a GPU pass --python with an interpreter that has them")
		}
		rt.Headers = isFile(headerPath(base))
	}

	if err := os.MkdirAll(filepath.Dir(venv), 0o755); err != nil {
		return nil, err
	}
	lock := flock.New(venv + ".lock")
	if err := lockContext(ctx, lock); err != nil {
		return nil, fmt.Errorf("wait for another bootstrap of %s: %w", venv, err)
	}
	defer lock.Unlock()
	if isFile(filepath.Join(venv, readyMarker)) { // built while we waited
		return rt, nil
	}
	if err := buildVenv(ctx, cfg, basePython, venv); err != nil {
		return nil, err
	}
	return rt, nil
}

func buildVenv(ctx context.Context, cfg ManagedConfig, basePython, venv string) error {
	started := time.Now()
	cfg.Log.Info().Str("venv", venv).Msg("building the managed Python environment " +
		"(first run: downloads torch, triton and the CUDA libraries, several GB; later runs reuse it)")
	// Leftovers of interrupted builds: never trusted, removed now that we hold the lock.
	stale, _ := filepath.Glob(venv + ".build-*")
	for _, dir := range stale {
		os.RemoveAll(dir)
	}
	build, err := os.MkdirTemp(filepath.Dir(venv), filepath.Base(venv)+".build-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(build)

	uv, err := ensureUV(ctx, cfg)
	if err != nil {
		return err
	}
	project := filepath.Join(build, "project")
	tmpVenv := filepath.Join(build, "venv")
	if err := os.MkdirAll(project, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(project, "pyproject.toml"), cfg.Project.Pyproject, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(project, "uv.lock"), cfg.Project.Lock, 0o644); err != nil {
		return err
	}
	env := append(os.Environ(), "UV_PYTHON_DOWNLOADS=never", "UV_PROJECT_ENVIRONMENT="+tmpVenv, "VIRTUAL_ENV=")
	steps := [][]string{
		{uv, "venv", "--relocatable", "--no-project", "--no-config", "--python", basePython, tmpVenv},
		{uv, "sync", "--frozen", "--no-config", "--project", project, "--python", filepath.Join(tmpVenv, "bin", "python")},
	}
	for _, args := range steps {
		cmd := exec.CommandContext(ctx, args[0], args[1:]...)
		cmd.Env = env
		cmd.Stdout = cfg.Progress
		cmd.Stderr = cfg.Progress
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("bootstrap the managed runtime: %s: %w", strings.Join(args[:2], " "), err)
		}
	}
	if err := os.WriteFile(filepath.Join(tmpVenv, readyMarker), []byte(cfg.Project.From+"\n"), 0o644); err != nil {
		return err
	}
	// A venv without its marker (a copy cut short, an install of another
	// version) is never used; left there, the rename fails on every bootstrap.
	if err := os.RemoveAll(venv); err != nil {
		return fmt.Errorf("remove the unfinished venv %s: %w", venv, err)
	}
	if err := os.Rename(tmpVenv, venv); err != nil {
		return fmt.Errorf("move the finished venv into place: %w", err)
	}
	cfg.Log.Info().Str("took", time.Since(started).Round(time.Second).String()).Msg("managed Python environment ready")
	return nil
}

func lockContext(ctx context.Context, l *flock.Flock) error {
	for {
		ok, err := l.TryLock()
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}

// EnsureHeaders makes sure a managed runtime has Python.h, fetching it if an
// earlier bootstrap could not; GPU runs call it before starting workers.
func EnsureHeaders(ctx context.Context, rt *Runtime, cfg ManagedConfig) error {
	if rt.Kind != Managed || rt.Headers {
		return nil
	}
	if err := fetchHeaders(ctx, rt.Base, cfg); err != nil {
		return err
	}
	rt.Headers = true
	return nil
}

var errNoHeaders = errors.New("no Debian package carries headers for this Python")

func resolveURL(base, ref string) (string, error) {
	b, err := url.Parse(base)
	if err != nil {
		return "", err
	}
	r, err := url.Parse(ref)
	if err != nil {
		return "", err
	}
	return b.ResolveReference(r).String(), nil
}

// EnsureGroup installs a dependency group of the project's lock (one the
// runtime leaves out, as jupyter) into the managed venv, once: later calls
// find its marker. It adds packages and removes none, under the venv's
// bootstrap lock, so workers already running on the venv are unaffected.
func EnsureGroup(ctx context.Context, cfg ManagedConfig, rt *Runtime, group string) error {
	if rt.Kind != Managed {
		return fmt.Errorf("the %s group is installed only into the managed runtime, not %s", group, rt.Python)
	}
	if cfg.Progress == nil {
		cfg.Progress = io.Discard
	}
	marker := filepath.Join(rt.Venv, ".vlkv-group-"+group)
	if isFile(marker) {
		return nil
	}
	lock := flock.New(rt.Venv + ".lock")
	if err := lockContext(ctx, lock); err != nil {
		return fmt.Errorf("wait for another install into %s: %w", rt.Venv, err)
	}
	defer lock.Unlock()
	if isFile(marker) {
		return nil
	}
	uv, err := ensureUV(ctx, cfg)
	if err != nil {
		return err
	}
	project, err := os.MkdirTemp(filepath.Dir(rt.Venv), filepath.Base(rt.Venv)+".group-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(project)
	if err := os.WriteFile(filepath.Join(project, "pyproject.toml"), cfg.Project.Pyproject, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(project, "uv.lock"), cfg.Project.Lock, 0o644); err != nil {
		return err
	}
	cfg.Log.Info().Str("group", group).Str("venv", rt.Venv).Msg("installing the locked " + group +
		" dependency group into the managed runtime (first use only)")
	cmd := exec.CommandContext(ctx, uv, "sync", "--frozen", "--no-config", "--inexact", "--group", group,
		"--project", project, "--python", rt.Python)
	cmd.Env = append(os.Environ(), "UV_PYTHON_DOWNLOADS=never", "UV_PROJECT_ENVIRONMENT="+rt.Venv, "VIRTUAL_ENV=")
	cmd.Stdout, cmd.Stderr = cfg.Progress, cfg.Progress
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("install the %s group into the managed runtime: uv sync: %w", group, err)
	}
	return os.WriteFile(marker, []byte(group+"\n"), 0o644)
}
