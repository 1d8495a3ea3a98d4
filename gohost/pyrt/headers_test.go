package pyrt

import (
	"archive/tar"
	"archive/zip"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	"github.com/ulikunitz/xz"
)

func xzBytes(t *testing.T, data []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := xz.NewWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(data)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func tarBytes(t *testing.T, files map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, body := range files {
		tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg})
		tw.Write([]byte(body))
	}
	tw.Close()
	return buf.Bytes()
}

func arBytes(members map[string][]byte, order []string) []byte {
	var buf bytes.Buffer
	buf.WriteString("!<arch>\n")
	for _, name := range order {
		data := members[name]
		fmt.Fprintf(&buf, "%-16s%-12d%-6d%-6d%-8s%-10d`\n", name, 0, 0, 0, "100644", len(data))
		buf.Write(data)
		if len(data)%2 == 1 {
			buf.WriteByte('\n')
		}
	}
	return buf.Bytes()
}

// fakeDeb is a libpython3.13-dev .deb with Debian's pyconfig.h split.
func fakeDeb(t *testing.T) []byte {
	data := tarBytes(t, map[string]string{
		"./usr/include/python3.13/Python.h":                          "/* Python.h */",
		"./usr/include/python3.13/cpython/object.h":                  "/* object.h */",
		"./usr/include/python3.13/pyconfig.h":                        "#include <x86_64-linux-gnu/python3.13/pyconfig.h>",
		"./usr/include/x86_64-linux-gnu/python3.13/pyconfig.h":       "/* real pyconfig */",
		"./usr/include/aarch64-linux-gnu/python3.13/pyconfig.h":      "/* other arch */",
		"./usr/lib/python3.13/config-3.13-x86_64-linux-gnu/Makefile": "all:",
	})
	return arBytes(map[string][]byte{"debian-binary": []byte("2.0\n"), "control.tar.xz": xzBytes(t, tarBytes(t, nil)), "data.tar.xz": xzBytes(t, data)},
		[]string{"debian-binary", "control.tar.xz", "data.tar.xz"})
}

func TestDebHeaders(t *testing.T) {
	files, err := debHeaders(fakeDeb(t), "3.13", "x86_64-linux-gnu")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"Python.h": "/* Python.h */", "cpython/object.h": "/* object.h */", "pyconfig.h": "/* real pyconfig */"}
	if len(files) != len(want) {
		t.Fatalf("got files %v", keys(files))
	}
	for k, v := range want {
		if string(files[k]) != v {
			t.Errorf("%s = %q, want %q", k, files[k], v)
		}
	}
}

func TestDebHeadersRejectsBadArchives(t *testing.T) {
	deb := fakeDeb(t)
	tests := []struct {
		name, want string
		data       []byte
	}{
		{"not ar", "not a .deb", []byte("PK\x03\x04")},
		{"truncated member", "truncated", deb[:len(deb)-40]},
		{"no data member", "no data.tar", arBytes(map[string][]byte{"debian-binary": []byte("2.0\n")}, []string{"debian-binary"})},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := debHeaders(tc.data, "3.13", "x86_64-linux-gnu"); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
		})
	}
}

func TestFindPackage(t *testing.T) {
	index := "Package: libpython3.13\nFilename: pool/a.deb\nSHA256: aaa\n\nPackage: libpython3.13-dev\nVersion: 3.13.5\nFilename: pool/b.deb\nSHA256: bbb\n"
	f, sum, err := findPackage(strings.NewReader(index), "libpython3.13-dev")
	if err != nil || f != "pool/b.deb" || sum != "bbb" {
		t.Fatalf("got %q %q %v", f, sum, err)
	}
	if _, _, err := findPackage(strings.NewReader(index), "libpython3.99-dev"); err == nil {
		t.Fatal("found a package that is not there")
	}
}

func TestEnsureHeadersFromMirror(t *testing.T) {
	if _, gnu, _ := debianArch("amd64"); gnu != "x86_64-linux-gnu" {
		t.Fatal("unexpected arch mapping")
	}
	deb := fakeDeb(t)
	sum := sha256.Sum256(deb)
	good := hex.EncodeToString(sum[:])
	for _, tc := range []struct {
		name    string
		sha     string
		wantErr string
	}{
		{"checksum verified", good, ""},
		{"checksum mismatch", strings.Repeat("0", 64), "checksum mismatch"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mux := http.NewServeMux()
			mux.HandleFunc("/dists/trixie/main/binary-amd64/Packages.xz", func(w http.ResponseWriter, r *http.Request) {
				w.Write(xzBytes(t, []byte("Package: libpython3.13-dev\nFilename: pool/main/p/libpython3.13-dev_3.13.5_amd64.deb\nSHA256: "+tc.sha+"\n\n")))
			})
			mux.HandleFunc("/pool/main/p/libpython3.13-dev_3.13.5_amd64.deb", func(w http.ResponseWriter, r *http.Request) { w.Write(deb) })
			srv := httptest.NewServer(mux)
			defer srv.Close()
			t.Setenv("VLKV_DEBIAN_MIRROR", srv.URL)
			if runtime.GOARCH != "amd64" {
				t.Skip("fixture is for amd64")
			}
			base := t.TempDir()
			rt := &Runtime{Kind: Managed, Base: base}
			err := EnsureHeaders(context.Background(), rt, ManagedConfig{Log: zerolog.Nop()})
			if tc.wantErr != "" {
				if rt.Headers || err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, %v; want error %q", rt.Headers, err, tc.wantErr)
				}
				if _, err := os.Stat(filepath.Join(base, "include", "python3.13")); err == nil {
					t.Error("a failed fetch left an include directory")
				}
				return
			}
			if !rt.Headers || err != nil {
				t.Fatalf("got %v, %v", rt.Headers, err)
			}
			got, err := os.ReadFile(filepath.Join(base, "include", "python3.13", "pyconfig.h"))
			if err != nil || string(got) != "/* real pyconfig */" {
				t.Errorf("pyconfig.h = %q, %v", got, err)
			}
			// Present headers are not fetched again.
			srv.Close()
			again := &Runtime{Kind: Managed, Base: base, Headers: isFile(headerPath(base))}
			if err := EnsureHeaders(context.Background(), again, ManagedConfig{Log: zerolog.Nop()}); !again.Headers || err != nil {
				t.Errorf("second call: %v, %v", again.Headers, err)
			}
		})
	}
}

func TestWheelLookupAndScript(t *testing.T) {
	var whl bytes.Buffer
	zw := zip.NewWriter(&whl)
	f, _ := zw.Create("uv-0.13.9.data/scripts/uv")
	f.Write([]byte("\x7fELF binary"))
	zw.Create("uv/__init__.py")
	zw.Close()

	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Accept") != "application/vnd.pypi.simple.v1+json" {
			http.Error(w, "want JSON", http.StatusNotAcceptable)
			return
		}
		fmt.Fprint(w, `{"files": [{"filename": "uv-other.whl", "url": "https://x/other"}, {"filename": "uv-0.13.9-py3-none-any.whl", "url": "../../files/uv.whl"}]}`)
	}))
	defer srv.Close()
	url, err := wheelURL(context.Background(), srv.Client(), srv.URL+"/simple", "uv", "uv-0.13.9-py3-none-any.whl")
	if err != nil || url != srv.URL+"/files/uv.whl" {
		t.Fatalf("got %q, %v", url, err)
	}
	if _, err := wheelURL(context.Background(), srv.Client(), srv.URL+"/simple", "uv", "missing.whl"); err == nil {
		t.Error("found a wheel that is not listed")
	}
	bin, err := wheelScript(whl.Bytes(), "uv")
	if err != nil || string(bin) != "\x7fELF binary" {
		t.Fatalf("got %q, %v", bin, err)
	}
	if _, err := wheelScript([]byte("not a zip"), "uv"); err == nil {
		t.Error("read a script from a non-wheel")
	}
}

func keys(m map[string][]byte) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// ensureUV installs uv executable, and installs again a uv it finds that
// cannot be run (left by a bootstrap killed between the rename and the
// chmod), instead of handing it to every later bootstrap.
func TestEnsureUVInstallsAnExecutable(t *testing.T) {
	body := []byte("#!/bin/sh\necho uv\n")
	var whl bytes.Buffer
	zw := zip.NewWriter(&whl)
	f, _ := zw.Create("uv-" + UVVersion + ".data/scripts/uv")
	f.Write(body)
	zw.Close()
	sum := sha256.Sum256(whl.Bytes())
	name := "uv-" + UVVersion + "-test.whl"
	old, had := uvWheels[runtime.GOARCH]
	uvWheels[runtime.GOARCH] = pinnedWheel{name, hex.EncodeToString(sum[:])}
	t.Cleanup(func() {
		if had {
			uvWheels[runtime.GOARCH] = old
		} else {
			delete(uvWheels, runtime.GOARCH)
		}
	})
	fetches := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/files/uv.whl" {
			fetches++
			w.Write(whl.Bytes())
			return
		}
		fmt.Fprintf(w, `{"files": [{"filename": %q, "url": "/files/uv.whl"}]}`, name)
	}))
	defer srv.Close()
	t.Setenv("VLKV_PYPI_INDEX", srv.URL+"/simple")

	for _, tc := range []struct {
		name        string
		stale       os.FileMode // mode of a uv already there; 0: none
		wantFetches int
	}{
		{"none yet", 0, 1},
		{"left unexecutable", 0o644, 1},
		{"ready", 0o755, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cache := t.TempDir()
			uv := filepath.Join(cache, "tools", "uv-"+UVVersion, "uv")
			if tc.stale != 0 {
				os.MkdirAll(filepath.Dir(uv), 0o755)
				if err := os.WriteFile(uv, body, tc.stale); err != nil {
					t.Fatal(err)
				}
				os.Chmod(uv, tc.stale)
			}
			fetches = 0
			got, err := ensureUV(context.Background(), ManagedConfig{CacheDir: cache, Log: zerolog.Nop(), HTTP: srv.Client()})
			if err != nil || got != uv {
				t.Fatalf("got %q, %v", got, err)
			}
			if st, err := os.Stat(uv); err != nil || st.Mode().Perm()&0o100 == 0 {
				t.Errorf("uv is not executable: %v, %v", st.Mode(), err)
			}
			if fetches != tc.wantFetches {
				t.Errorf("fetched the wheel %d times, want %d", fetches, tc.wantFetches)
			}
		})
	}
}
