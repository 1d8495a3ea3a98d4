package pyrt

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// The embedded CPython ships no C headers, but Triton compiles its GPU kernel
// launcher as a CPython extension. Headers of the same minor version are
// API/ABI compatible, so they are taken from Debian's libpython3.X-dev (a
// registry reachable where PyPI is) and unpacked into the extracted CPython's
// include/python3.X, which is where sysconfig and Triton look.

// DebianMirror is where headers come from; VLKV_DEBIAN_MIRROR overrides it.
const DebianMirror = "https://deb.debian.org/debian"

// debianSuite is the Debian release whose python3.X matches PythonVersion.
var debianSuite = map[string]string{"3.13": "trixie"}

func minorVersion(v string) string {
	parts := strings.SplitN(v, ".", 3)
	return parts[0] + "." + parts[1]
}

func headerPath(base string) string {
	return filepath.Join(base, "include", "python"+minorVersion(PythonVersion), "Python.h")
}

// fetchHeaders unpacks libpython3.X-dev's headers into base/include/python3.X.
func fetchHeaders(ctx context.Context, base string, cfg ManagedConfig) error {
	minor := minorVersion(PythonVersion)
	include := filepath.Dir(headerPath(base))
	suite, ok := debianSuite[minor]
	if !ok {
		return fmt.Errorf("%w: Python %s", errNoHeaders, minor)
	}
	debArch, gnuArch, ok := debianArch(runtime.GOARCH)
	if !ok {
		return fmt.Errorf("%w: architecture %s", errNoHeaders, runtime.GOARCH)
	}
	mirror := DebianMirror
	if m := os.Getenv("VLKV_DEBIAN_MIRROR"); m != "" {
		mirror = strings.TrimRight(m, "/")
	}
	client := cfg.client()
	pkg := "libpython" + minor + "-dev"
	cfg.Log.Info().Str("package", pkg).Str("suite", suite).Msg("fetching C headers for the managed Python (used by Triton's GPU launcher)")

	index, err := fetch(ctx, client, fmt.Sprintf("%s/dists/%s/main/binary-%s/Packages.xz", mirror, suite, debArch))
	if err != nil {
		return err
	}
	xr, err := xz.NewReader(bytes.NewReader(index))
	if err != nil {
		return fmt.Errorf("read Debian package index: %w", err)
	}
	filename, sum, err := findPackage(xr, pkg)
	if err != nil {
		return err
	}
	deb, err := fetch(ctx, client, mirror+"/"+filename)
	if err != nil {
		return err
	}
	if got := sha256.Sum256(deb); hex.EncodeToString(got[:]) != sum {
		return fmt.Errorf("%s: checksum mismatch (index says %s)", filename, sum)
	}
	files, err := debHeaders(deb, minor, gnuArch)
	if err != nil {
		return fmt.Errorf("%s: %w", path.Base(filename), err)
	}
	if _, ok := files["Python.h"]; !ok {
		return fmt.Errorf("%s holds no Python.h", path.Base(filename))
	}
	if err := installTree(include, files, 0o644); err != nil {
		return err
	}
	return nil
}

func debianArch(goarch string) (deb, gnu string, ok bool) {
	switch goarch {
	case "amd64":
		return "amd64", "x86_64-linux-gnu", true
	case "arm64":
		return "arm64", "aarch64-linux-gnu", true
	}
	return "", "", false
}

func fetch(ctx context.Context, client *http.Client, url string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("fetch %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("fetch %s: %s", url, resp.Status)
	}
	return io.ReadAll(io.LimitReader(resp.Body, 256<<20))
}

// findPackage scans a Debian Packages index for pkg's Filename and SHA256.
func findPackage(r io.Reader, pkg string) (filename, sum string, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	in := false
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if in && filename != "" && sum != "" {
				return filename, sum, nil
			}
			in = false
		case strings.HasPrefix(line, "Package: "):
			in = strings.TrimPrefix(line, "Package: ") == pkg
			filename, sum = "", ""
		case in && strings.HasPrefix(line, "Filename: "):
			filename = strings.TrimPrefix(line, "Filename: ")
		case in && strings.HasPrefix(line, "SHA256: "):
			sum = strings.TrimPrefix(line, "SHA256: ")
		}
	}
	if in && filename != "" && sum != "" {
		return filename, sum, nil
	}
	if err := sc.Err(); err != nil {
		return "", "", fmt.Errorf("read Debian package index: %w", err)
	}
	return "", "", fmt.Errorf("Debian package index has no %s", pkg)
}

// debHeaders returns the header files of a libpython3.X-dev package, keyed by
// their path under include/python3.X. Debian splits pyconfig.h into a wrapper
// and a per-architecture file; the architecture's file replaces the wrapper.
func debHeaders(deb []byte, minor, gnuArch string) (map[string][]byte, error) {
	member, name, err := arMember(deb, "data.tar")
	if err != nil {
		return nil, err
	}
	var r io.Reader
	switch {
	case strings.HasSuffix(name, ".xz"):
		if r, err = xz.NewReader(bytes.NewReader(member)); err != nil {
			return nil, err
		}
	case strings.HasSuffix(name, ".zst"):
		zr, err := zstd.NewReader(bytes.NewReader(member))
		if err != nil {
			return nil, err
		}
		defer zr.Close()
		r = zr
	case strings.HasSuffix(name, ".gz"):
		if r, err = gzip.NewReader(bytes.NewReader(member)); err != nil {
			return nil, err
		}
	case name == "data.tar":
		r = bytes.NewReader(member)
	default:
		return nil, fmt.Errorf("unsupported compression of %s", name)
	}
	prefix := "usr/include/python" + minor + "/"
	archConfig := "usr/include/" + gnuArch + "/python" + minor + "/pyconfig.h"
	files := map[string][]byte{}
	var config []byte
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", name, err)
		}
		if hdr.Typeflag != tar.TypeReg {
			continue
		}
		p := strings.TrimPrefix(path.Clean(hdr.Name), "./")
		rel, under := strings.CutPrefix(p, prefix)
		if !under && p != archConfig {
			continue
		}
		if under && (rel == "" || strings.HasPrefix(rel, "../") || path.IsAbs(rel)) {
			return nil, fmt.Errorf("unsafe path %q in %s", hdr.Name, name)
		}
		data, err := io.ReadAll(io.LimitReader(tr, 16<<20))
		if err != nil {
			return nil, err
		}
		if p == archConfig {
			config = data
		} else {
			files[rel] = data
		}
	}
	if config != nil {
		files["pyconfig.h"] = config
	}
	return files, nil
}

// arMember returns the first member of an ar archive (a .deb) whose name
// starts with prefix.
func arMember(data []byte, prefix string) ([]byte, string, error) {
	const magic = "!<arch>\n"
	if !bytes.HasPrefix(data, []byte(magic)) {
		return nil, "", fmt.Errorf("not a .deb (ar) archive")
	}
	off := len(magic)
	for off+60 <= len(data) {
		hdr := data[off : off+60]
		name := strings.TrimRight(strings.TrimSpace(string(hdr[0:16])), "/")
		var size int
		if _, err := fmt.Sscanf(strings.TrimSpace(string(hdr[48:58])), "%d", &size); err != nil || size < 0 {
			return nil, "", fmt.Errorf("corrupt ar header for %q", name)
		}
		start := off + 60
		if start+size > len(data) {
			return nil, "", fmt.Errorf("ar member %q is truncated", name)
		}
		if strings.HasPrefix(name, prefix) {
			return data[start : start+size], name, nil
		}
		off = start + size + size%2
	}
	return nil, "", fmt.Errorf("no %s* member in the archive", prefix)
}

// installTree writes files into dir atomically, each with mode perm: a
// sibling temporary directory is filled and renamed into place, so a file
// found there is whole and has its mode (a chmod after the rename, cut
// short, left a uv that every later bootstrap found and could not run).
func installTree(dir string, files map[string][]byte, perm os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), ".headers-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	for rel, data := range files {
		dst := filepath.Join(tmp, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(dst, data, 0o644); err != nil {
			return err
		}
		if err := os.Chmod(dst, perm); err != nil { // WriteFile's mode is masked by the umask
			return err
		}
	}
	if installed(dir, files, perm) { // another process installed them meanwhile: it may be using them
		return nil
	}
	os.RemoveAll(dir) // an earlier, incomplete directory (no Python.h) is not kept
	if err := os.Rename(tmp, dir); err != nil {
		if installed(dir, files, perm) {
			return nil
		}
		return fmt.Errorf("install %s: %w", dir, err)
	}
	return nil
}

// installed says whether dir holds every one of files, whole and with mode perm.
func installed(dir string, files map[string][]byte, perm os.FileMode) bool {
	for rel, data := range files {
		st, err := os.Stat(filepath.Join(dir, filepath.FromSlash(rel)))
		if err != nil || !st.Mode().IsRegular() || st.Size() != int64(len(data)) || st.Mode().Perm() != perm {
			return false
		}
	}
	return true
}
