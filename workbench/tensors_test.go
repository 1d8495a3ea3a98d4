package main

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vlkv/vlkv/gohost/tensor"
	"github.com/vlkv/vlkv/gohost/testpy"
)

func writeSample(t *testing.T, path string) {
	t.Helper()
	ar, err := tensor.NewArena(1, "sample", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer ar.Close()
	k, _ := ar.NewTensor(tensor.Float32, 2, 3)
	kv, _ := k.Float32()
	for i := range kv {
		kv[i] = float32(i) / 2
	}
	v, _ := ar.NewTensor(tensor.BFloat16, 4)
	vv, _ := v.BFloat16()
	for i := range vv {
		vv[i] = tensor.Float32ToBFloat16(float32(i) + 0.5)
	}
	k2, _ := ar.NewTensor(tensor.Float32, 1)
	if err := tensor.WriteSafetensors(path, map[string]*tensor.Tensor{"attn/k": k, "attn_k": k2, "attn.v": v}, map[string]string{"layer": "3"}); err != nil {
		t.Fatal(err)
	}
}

func TestTensorsInspectAndToNPY(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "trace.safetensors")
	writeSample(t, file)

	code, stdout, stderr := runCLI(t, "tensors", "inspect", "--json", file)
	if code != 0 {
		t.Fatalf("inspect: exit %d: %s", code, stderr)
	}
	var got struct {
		Tensors []struct {
			Name, DType string
			Shape       []int64
		}
		Metadata map[string]string
	}
	if err := json.Unmarshal([]byte(stdout), &got); err != nil || len(got.Tensors) != 3 || got.Metadata["layer"] != "3" {
		t.Fatalf("inspect --json: %v\n%s", err, stdout)
	}

	out := filepath.Join(dir, "npy")
	code, stdout, stderr = runCLI(t, "tensors", "to-npy", file, out)
	if code != 0 || !strings.Contains(stdout, "wrote 3 tensors") {
		t.Fatalf("to-npy: exit %d: %s%s", code, stdout, stderr)
	}
	// "attn/k" and "attn_k" once collided in one file; each has its own now,
	// and tensors.json maps names to files.
	var index map[string]string
	data, _ := os.ReadFile(filepath.Join(out, "tensors.json"))
	if err := json.Unmarshal(data, &index); err != nil || len(index) != 3 || index["attn/k"] != "attn%2Fk.npy" || index["attn_k"] != "attn_k.npy" {
		t.Fatalf("tensors.json: %v %s", err, data)
	}
	// The header's metadata (a trace's spans and tokens) comes along, as tensors inspect --json gives it.
	var meta map[string]string
	data, _ = os.ReadFile(filepath.Join(out, "metadata.json"))
	if err := json.Unmarshal(data, &meta); err != nil || len(meta) != 1 || meta["layer"] != "3" ||
		!strings.Contains(stdout, "its metadata: "+filepath.Join(out, "metadata.json")) {
		t.Fatalf("metadata.json: %v %s\n%s", err, data, stdout)
	}
	if npys, _ := filepath.Glob(filepath.Join(out, "*.npy")); len(npys) != 3 {
		t.Errorf("%d .npy files for 3 tensors", len(npys))
	}
	for name, want := range map[string]string{"attn%2Fk.npy": "<f4 [2 3]", "attn_k.npy": "<f4 [1]", "attn.v.npy": "<f4 [4]"} {
		f, err := os.Open(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		descr, shape, err := tensor.ReadNPYHeader(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		if got := descr + " " + fmtInts(shape); got != want {
			t.Errorf("%s: header %q, want %q", name, got, want)
		}
	}

	// Files written here are read by the Python side's own libraries.
	if os.Getenv("VLKV_TEST_PYTHON") != "" || os.Getenv("CI") != "" {
		py := testpy.Python(t)
		check := `
import sys, numpy as np, torch
from safetensors import safe_open
from safetensors.torch import load_file
d = load_file(sys.argv[1])
assert d["attn/k"].tolist() == [[0, .5, 1], [1.5, 2, 2.5]], d["attn/k"]
assert d["attn.v"].dtype == torch.bfloat16 and d["attn.v"].float().tolist() == [.5, 1.5, 2.5, 3.5], d["attn.v"]
with safe_open(sys.argv[1], "pt") as f:
    assert f.metadata() == {"layer": "3"}, f.metadata()
k = np.load(sys.argv[2] + "/attn%2Fk.npy"); v = np.load(sys.argv[2] + "/attn.v.npy")
assert (k == d["attn/k"].numpy()).all() and v.tolist() == [.5, 1.5, 2.5, 3.5], v
print("ok")
`
		res, err := exec.Command(py, "-c", check, file, out).CombinedOutput()
		if err != nil || strings.TrimSpace(string(res)) != "ok" {
			t.Fatalf("python could not read what Go wrote: %v\n%s", err, res)
		}
	}
}

func fmtInts(xs []int64) string {
	b, _ := json.Marshal(xs)
	return strings.NewReplacer(",", " ").Replace(string(b))
}

func TestTensorsBadFiles(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.safetensors")
	writeSample(t, good)
	data, _ := os.ReadFile(good)
	truncated := filepath.Join(dir, "truncated.safetensors")
	os.WriteFile(truncated, data[:len(data)-3], 0o644)
	garbage := filepath.Join(dir, "garbage.safetensors")
	os.WriteFile(garbage, []byte("\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"), 0o644)
	npy := filepath.Join(dir, "rel_err.npy") // what a run's tensors/<job>/ hold
	os.WriteFile(npy, []byte("\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"), 0o644)
	tests := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"truncated data", []string{"tensors", "inspect", truncated}, 1, "truncated"},
		{"not json", []string{"tensors", "inspect", garbage}, 1, "safetensors header"},
		{"a .npy file", []string{"tensors", "inspect", npy}, 1, "is a NumPy .npy file, not a .safetensors file: read it with numpy.load"},
		{"missing file", []string{"tensors", "inspect", filepath.Join(dir, "nope")}, 1, "no such file"},
		{"a directory", []string{"tensors", "inspect", dir}, 1, dir + " is a directory: give a .safetensors file"},
		{"a directory to trace inspect", []string{"trace", "inspect", dir}, 1, dir + " is a directory: give a .safetensors file"},
		{"truncated to-npy", []string{"tensors", "to-npy", truncated, filepath.Join(dir, "out")}, 1, "truncated"},
		{"a .npy file to-npy", []string{"tensors", "to-npy", npy, filepath.Join(dir, "out")}, 1, "is a NumPy .npy file, not a .safetensors file: read it with numpy.load"},
		{"a directory to-npy", []string{"tensors", "to-npy", dir, filepath.Join(dir, "out")}, 1, dir + " is a directory: give a .safetensors file"},
		{"no argument", []string{"tensors", "inspect"}, 2, "accepts 1 arg"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := runCLI(t, tc.args...)
			if code != tc.code || !strings.Contains(stderr, tc.want) {
				t.Fatalf("exit %d, stderr %q; want %d and %q", code, stderr, tc.code, tc.want)
			}
		})
	}
	if _, err := os.Stat(filepath.Join(dir, "out")); err == nil {
		entries, _ := os.ReadDir(filepath.Join(dir, "out"))
		if len(entries) != 0 {
			t.Errorf("a failed export left files: %v", entries)
		}
	}
}

// An export into a directory that holds an earlier one leaves nothing of
// the earlier one beside it: another file's metadata.json once stayed there,
// passing for this file's, and so did .npy files of tensors it does not have.
func TestTensorsToNPYReplacesAnEarlierExport(t *testing.T) {
	dir := t.TempDir()
	trace := filepath.Join(dir, "trace.safetensors")
	writeSample(t, trace) // three tensors and metadata
	plain := filepath.Join(dir, "plain.safetensors")
	ar, err := tensor.NewArena(1, "plain", 1<<12)
	if err != nil {
		t.Fatal(err)
	}
	defer ar.Close()
	x, _ := ar.NewTensor(tensor.Float32, 2)
	if err := tensor.WriteSafetensors(plain, map[string]*tensor.Tensor{"attn_k": x, "w": x}, nil); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "npy")
	mine := filepath.Join(out, "notes.npy") // a file no export wrote stays
	for _, file := range []string{trace, plain} {
		code, stdout, stderr := runCLI(t, "tensors", "to-npy", file, out)
		if code != 0 {
			t.Fatalf("to-npy %s: exit %d: %s%s", file, code, stdout, stderr)
		}
		if file == trace {
			if err := os.WriteFile(mine, nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	entries, err := os.ReadDir(out)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range entries {
		got = append(got, e.Name())
	}
	if want := []string{"attn_k.npy", "notes.npy", "tensors.json", "w.npy"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("files after the second export: %v, want %v", got, want)
	}
}

// inspect --json gives a file without metadata an empty object, as it gives
// one without tensors an empty list: it gave null, which a reader indexing
// or iterating the metadata fails on.
func TestTensorsInspectJSONWithoutMetadata(t *testing.T) {
	file := filepath.Join(t.TempDir(), "plain.safetensors")
	if err := tensor.WriteSafetensors(file, map[string]*tensor.Tensor{}, nil); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := runCLI(t, "tensors", "inspect", "--json", file)
	var got map[string]json.RawMessage
	if code != 0 || json.Unmarshal([]byte(stdout), &got) != nil {
		t.Fatalf("exit %d: %s%s", code, stdout, stderr)
	}
	if string(got["metadata"]) != "{}" || string(got["tensors"]) != "[]" {
		t.Errorf("metadata %s, tensors %s; want {} and []", got["metadata"], got["tensors"])
	}
}

// A tensor name of 240 characters fits a file name with its ".npy", and so
// must the temporary file the atomic write goes through.
func TestTensorsToNPYLongName(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "long.safetensors")
	ar, err := tensor.NewArena(1, "long", 1<<12)
	if err != nil {
		t.Fatal(err)
	}
	defer ar.Close()
	x, _ := ar.NewTensor(tensor.Float32, 2)
	name := strings.Repeat("w", 240)
	if err := tensor.WriteSafetensors(file, map[string]*tensor.Tensor{name: x}, nil); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "npy")
	code, stdout, stderr := runCLI(t, "tensors", "to-npy", file, out)
	if code != 0 || !strings.Contains(stdout, "wrote 1 tensors") {
		t.Fatalf("to-npy: exit %d: %s%s", code, stdout, stderr)
	}
	if _, err := os.Stat(filepath.Join(out, name+".npy")); err != nil {
		t.Error(err)
	}
}

// A bfloat16 tensor that is most of its file is widened to float32 as well:
// the widened copy, twice its size, does not have to fit beside the loaded
// file in the file's arena.
func TestTensorsToNPYLargeBFloat16(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "weights.safetensors")
	ar, err := tensor.NewArena(1, "weights", 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer ar.Close()
	const n = 2 << 20 // 4 MiB of bfloat16
	w, err := ar.NewTensor(tensor.BFloat16, n)
	if err != nil {
		t.Fatal(err)
	}
	bits, _ := w.BFloat16()
	for i := range bits {
		bits[i] = tensor.Float32ToBFloat16(float32(i % 256))
	}
	if err := tensor.WriteSafetensors(file, map[string]*tensor.Tensor{"w": w}, nil); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "npy")
	code, stdout, stderr := runCLI(t, "tensors", "to-npy", file, out)
	if code != 0 || !strings.Contains(stdout, "wrote 1 tensors") {
		t.Fatalf("to-npy: exit %d: %s%s", code, stdout, stderr)
	}
	f, err := os.Open(filepath.Join(out, "w.npy"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	descr, shape, err := tensor.ReadNPYHeader(f)
	if err != nil || descr != "<f4" || len(shape) != 1 || shape[0] != n {
		t.Fatalf("w.npy: %s %v %v", descr, shape, err)
	}
	v := make([]float32, n)
	if err := binary.Read(f, binary.LittleEndian, v); err != nil {
		t.Fatal(err)
	}
	for _, i := range []int{0, 1, 255, 256, n - 1} {
		if v[i] != float32(i%256) {
			t.Fatalf("w[%d] = %v, want %v", i, v[i], i%256)
		}
	}
}
