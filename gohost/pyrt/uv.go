package pyrt

import (
	"archive/zip"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// The embedded CPython has no pip, so uv (which installs the locked
// dependencies) comes straight from its PyPI wheel: looked up in the simple
// index, checked against the pinned digest, and its binary unpacked.

// PyPIIndex is the simple index uv's wheel is looked up in; VLKV_PYPI_INDEX overrides it.
const PyPIIndex = "https://pypi.org/simple"

type pinnedWheel struct{ filename, sha256 string }

var uvWheels = map[string]pinnedWheel{
	"amd64": {"uv-0.13.9-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19"},
	"arm64": {"uv-0.13.9-py3-none-manylinux_2_28_aarch64.whl", "ecb6028d79dc96fbeafffe5c8af62a7099487ebc05a701e76714eebcffd06375"},
}

// ensureUV puts the pinned uv binary in the cache, once.
func ensureUV(ctx context.Context, cfg ManagedConfig) (string, error) {
	dir := filepath.Join(cfg.CacheDir, "tools", "uv-"+UVVersion)
	uv := filepath.Join(dir, "uv")
	if isExecutable(uv) {
		return uv, nil
	}
	pin, ok := uvWheels[runtime.GOARCH]
	if !ok || runtime.GOOS != "linux" {
		return "", fmt.Errorf("no pinned uv wheel for %s/%s; pass --python with an interpreter that has torch and triton", runtime.GOOS, runtime.GOARCH)
	}
	cfg.Log.Info().Str("version", UVVersion).Msg("fetching uv from PyPI")
	index := PyPIIndex
	if v := os.Getenv("VLKV_PYPI_INDEX"); v != "" {
		index = strings.TrimRight(v, "/")
	}
	url, err := wheelURL(ctx, cfg.client(), index, "uv", pin.filename)
	if err != nil {
		return "", err
	}
	whl, err := fetch(ctx, cfg.client(), url)
	if err != nil {
		return "", err
	}
	if sum := sha256.Sum256(whl); hex.EncodeToString(sum[:]) != pin.sha256 {
		return "", fmt.Errorf("%s: sha256 %x does not match the pinned %s", pin.filename, sum, pin.sha256)
	}
	bin, err := wheelScript(whl, "uv")
	if err != nil {
		return "", fmt.Errorf("%s: %w", pin.filename, err)
	}
	if err := installTree(dir, map[string][]byte{"uv": bin}, 0o755); err != nil {
		return "", err
	}
	return uv, nil
}

// isExecutable says whether p is a regular file its owner may run; one
// that is not (written by an earlier version, whose chmod came after the
// rename) is installed again.
func isExecutable(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o100 != 0
}

func (cfg ManagedConfig) client() *http.Client {
	if cfg.HTTP != nil {
		return cfg.HTTP
	}
	// Bounded, so an unreachable registry fails instead of hanging a command.
	return &http.Client{Timeout: 10 * time.Minute}
}

// wheelURL finds filename among a project's files in a PEP 691 (JSON) simple index.
func wheelURL(ctx context.Context, client *http.Client, index, project, filename string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, index+"/"+project+"/", nil)
	if err != nil {
		return "", err
	}
	req.Header.Set("Accept", "application/vnd.pypi.simple.v1+json")
	resp, err := client.Do(req)
	if err != nil {
		return "", fmt.Errorf("look up %s on %s: %w", project, index, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("look up %s on %s: %s", project, index, resp.Status)
	}
	var page struct {
		Files []struct {
			Filename string `json:"filename"`
			URL      string `json:"url"`
		} `json:"files"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&page); err != nil {
		return "", fmt.Errorf("read the %s index page: %w", project, err)
	}
	for _, f := range page.Files {
		if f.Filename == filename {
			if strings.HasPrefix(f.URL, "/") || !strings.Contains(f.URL, "://") {
				return resolveURL(index+"/"+project+"/", f.URL)
			}
			return f.URL, nil
		}
	}
	return "", fmt.Errorf("%s is not in the %s index at %s", filename, project, index)
}

// wheelScript extracts <name>-<version>.data/scripts/<script> from a wheel.
func wheelScript(whl []byte, script string) ([]byte, error) {
	zr, err := zip.NewReader(bytes.NewReader(whl), int64(len(whl)))
	if err != nil {
		return nil, fmt.Errorf("not a wheel: %w", err)
	}
	for _, f := range zr.File {
		if strings.Contains(f.Name, ".data/scripts/") && filepath.Base(f.Name) == script {
			rc, err := f.Open()
			if err != nil {
				return nil, err
			}
			defer rc.Close()
			return io.ReadAll(io.LimitReader(rc, 512<<20))
		}
	}
	return nil, fmt.Errorf("no scripts/%s in the wheel", script)
}
