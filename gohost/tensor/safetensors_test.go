package tensor

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// stFile is a safetensors file with the given header, its length prefix
// right, followed by data zero bytes.
func stFile(header string, data int) []byte {
	return stFileLen(uint64(len(header)), header+string(make([]byte, data)))
}

// stFileLen is a length prefix of n followed by rest, whatever n says.
func stFileLen(n uint64, rest string) []byte {
	return append(binary.LittleEndian.AppendUint64(nil, n), rest...)
}

// viewCase makes fill and check functions for one dtype from its typed view
// and the value element i should hold.
func viewCase[T comparable](view func(*Tensor) ([]T, error), value func(i int) T) (fill, check func(*testing.T, *Tensor)) {
	fill = func(t *testing.T, x *Tensor) {
		t.Helper()
		v, err := view(x)
		if err != nil {
			t.Fatal(err)
		}
		for i := range v {
			v[i] = value(i)
		}
	}
	check = func(t *testing.T, x *Tensor) {
		t.Helper()
		v, err := view(x)
		if err != nil {
			t.Fatal(err)
		}
		for i := range v {
			if v[i] != value(i) {
				t.Fatalf("element %d is %v, want %v", i, v[i], value(i))
			}
		}
	}
	return fill, check
}

type dtypeCase struct {
	name        string
	dt          DType
	shape       []int64
	fill, check func(*testing.T, *Tensor)
}

func dtypeCases() []dtypeCase {
	c := func(name string, dt DType, shape []int64, fill, check func(*testing.T, *Tensor)) dtypeCase {
		return dtypeCase{name, dt, shape, fill, check}
	}
	f64f, f64c := viewCase((*Tensor).Float64, func(i int) float64 { return float64(i)*1.5 - 7 })
	f32f, f32c := viewCase((*Tensor).Float32, func(i int) float32 { return float32(i)*0.25 - 3 })
	f16f, f16c := viewCase((*Tensor).Float16, func(i int) uint16 { return Float32ToHalf(float32(i) - 2.5) })
	bf16f, bf16c := viewCase((*Tensor).BFloat16, func(i int) uint16 { return Float32ToBFloat16(float32(i)*-0.5 + 1) })
	i8f, i8c := viewCase((*Tensor).Int8, func(i int) int8 { return int8(i*37 - 100) })
	i16f, i16c := viewCase((*Tensor).Int16, func(i int) int16 { return int16(i*1000 - 3000) })
	i32f, i32c := viewCase((*Tensor).Int32, func(i int) int32 { return int32(i) * -100003 })
	i64f, i64c := viewCase((*Tensor).Int64, func(i int) int64 { return int64(i)*-1_000_000_000_000 + 5 })
	u8f, u8c := viewCase((*Tensor).UInt8, func(i int) uint8 { return uint8(i*13 + 200) })
	boolf, boolc := viewCase((*Tensor).UInt8, func(i int) uint8 { return uint8(i % 2) })
	return []dtypeCase{
		c("f64", Float64, []int64{3}, f64f, f64c),
		c("f32", Float32, []int64{2, 3}, f32f, f32c),
		c("f32.scalar", Float32, []int64{}, f32f, f32c),
		c("f32.empty", Float32, []int64{0, 4}, f32f, f32c),
		c("f16", Float16, []int64{4, 1, 2}, f16f, f16c),
		c("bf16", BFloat16, []int64{5}, bf16f, bf16c),
		c("i8", Int8, []int64{7}, i8f, i8c),
		c("i16", Int16, []int64{2, 2}, i16f, i16c),
		c("i32", Int32, []int64{3, 1}, i32f, i32c),
		c("i64", Int64, []int64{2}, i64f, i64c),
		c("u8", UInt8, []int64{9}, u8f, u8c),
		c("bool", Bool, []int64{6}, boolf, boolc),
	}
}

func TestSafetensorsRoundTrip(t *testing.T) {
	src, dst := newArena(t, 1<<20), newArena(t, 1<<20)
	cases := dtypeCases()
	tensors := map[string]*Tensor{}
	for _, tc := range cases {
		x, err := src.NewTensor(tc.dt, tc.shape...)
		if err != nil {
			t.Fatal(err)
		}
		tc.fill(t, x)
		tensors["layers.0."+tc.name] = x
	}
	path := filepath.Join(t.TempDir(), "model.safetensors")
	md := map[string]string{"format": "pt", "note": "<&> \"quoted\" ünïcode"}
	if err := WriteSafetensors(path, tensors, md); err != nil {
		t.Fatal(err)
	}
	// Writing again replaces the file and leaves no temporary behind.
	if err := WriteSafetensors(path, tensors, md); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(filepath.Dir(path)); len(ents) != 1 {
		t.Fatalf("directory holds %d entries, want only the file", len(ents))
	}

	loaded, h, err := LoadSafetensors(path, dst)
	if err != nil {
		t.Fatal(err)
	}
	if h.DataStart%8 != 0 {
		t.Errorf("data starts at %d, not 8-byte aligned", h.DataStart)
	}
	if !reflect.DeepEqual(h.Metadata, md) {
		t.Errorf("metadata %v, want %v", h.Metadata, md)
	}
	// Data follows in name order, back to back.
	var names []string
	end := int64(0)
	for _, e := range h.Entries {
		names = append(names, e.Name)
		if e.Begin != end {
			t.Errorf("%s begins at %d, want %d", e.Name, e.Begin, end)
		}
		end = e.End
	}
	if !sort.StringsAreSorted(names) || len(names) != len(cases) {
		t.Errorf("entries %v", names)
	}
	if fi, err := os.Stat(path); err != nil {
		t.Error(err)
	} else if fi.Size() != h.DataStart+end {
		t.Errorf("file size %d, want %d", fi.Size(), h.DataStart+end)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			x := loaded["layers.0."+tc.name]
			if x == nil {
				t.Fatal("missing")
			}
			if x.DType() != tc.dt || !slices.Equal(x.Shape(), tc.shape) || x.Arena() != dst {
				t.Fatalf("loaded %s %v in arena %d", x.DType(), x.Shape(), x.Arena().ID())
			}
			tc.check(t, x)
		})
	}
	for _, x := range loaded {
		if err := x.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if dst.Used() != 0 {
		t.Errorf("used %d after freeing the loaded tensors", dst.Used())
	}
}

func TestSafetensorsMetadata(t *testing.T) {
	a := newArena(t, 4096)
	x, _ := a.NewTensor(Float32, 2)
	tests := []struct {
		name string
		md   map[string]string
		want map[string]string
	}{
		{"none", nil, nil},
		{"empty is omitted", map[string]string{}, nil},
		{"some", map[string]string{"format": "pt", "": "empty key", "b": ""}, map[string]string{"format": "pt", "": "empty key", "b": ""}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "m.safetensors")
			if err := WriteSafetensors(path, map[string]*Tensor{"x": x}, tc.md); err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			fi, _ := f.Stat()
			h, err := ParseSafetensorsHeader(f, fi.Size())
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(h.Metadata, tc.want) {
				t.Errorf("metadata %#v, want %#v", h.Metadata, tc.want)
			}
		})
	}
	// Only tensors come back; the metadata is not one.
	path := filepath.Join(t.TempDir(), "m.safetensors")
	if err := WriteSafetensors(path, map[string]*Tensor{}, map[string]string{"k": "v"}); err != nil {
		t.Fatal(err)
	}
	got, h, err := LoadSafetensors(path, a)
	if err != nil || len(got) != 0 || len(h.Entries) != 0 || h.Metadata["k"] != "v" {
		t.Fatalf("metadata-only file: %v %+v %v", got, h, err)
	}
}

func TestWriteSafetensorsErrors(t *testing.T) {
	a := newArena(t, 4096)
	x, _ := a.NewTensor(Float32, 2, 3)
	transposed, err := a.Tensor(Descriptor{Arena: a.ID(), Offset: x.Desc().Offset, DType: Float32, Shape: []int64{3, 2}, Strides: []int64{1, 3}, Device: CPU})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		tensors map[string]*Tensor
		md      map[string]string
		want    []string
	}{
		{"not contiguous", map[string]*Tensor{"t": transposed}, nil, []string{`"t"`, "not contiguous"}},
		{"nil tensor", map[string]*Tensor{"n": nil}, nil, []string{`"n"`, "nil"}},
		{"reserved name", map[string]*Tensor{"__metadata__": x}, nil, []string{"reserved"}},
		{"invalid UTF-8 name", map[string]*Tensor{"\xff": x}, nil, []string{"UTF-8"}},
		{"invalid UTF-8 metadata", map[string]*Tensor{"x": x}, map[string]string{"k": "\xfe"}, []string{"UTF-8"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			err := WriteSafetensors(filepath.Join(dir, "bad.safetensors"), tc.tensors, tc.md)
			wantErr(t, err, tc.want...)
			if ents, _ := os.ReadDir(dir); len(ents) != 0 {
				t.Errorf("a failed write left %v behind", ents[0].Name())
			}
		})
	}
}

func wantErr(t *testing.T, err error, want ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("no error, want one mentioning %q", want)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not mention %q", err, w)
		}
	}
}

func TestParseSafetensorsMalformed(t *testing.T) {
	entry := func(name, dtype, shape, offsets string) string {
		return `"` + name + `":{"dtype":"` + dtype + `","shape":` + shape + `,"data_offsets":` + offsets + `}`
	}
	tests := []struct {
		name string
		file []byte
		want []string
	}{
		{"shorter than the length", []byte{1, 2, 3}, []string{"truncated"}},
		{"header length larger than the file", stFileLen(1000, "{}"), []string{"truncated", "header length 1000"}},
		{"header length 0", stFileLen(0, "{}"), []string{"header length is 0"}},
		{"header length over 100 MiB", stFileLen(200<<20, "{}"), []string{"exceeds"}},
		{"a text file", []byte("import json\nprint(json.dumps({}))\n"), []string{"exceeds", `it starts with the text "import j", not a header length: not a .safetensors file`}},
		{"header not JSON", stFile("not json", 0), []string{"not valid JSON"}},
		{"header cut JSON", stFile(`{"w":{"dtype":"F32"`, 0), []string{"not valid JSON"}},
		{"trailing comma", stFile(`{"a":{},}`, 0), []string{"not valid JSON"}},
		{"JSON array", stFile(`[1, 2]`, 0), []string{"not a JSON object", "array"}},
		{"JSON string", stFile(`"{}"`, 0), []string{"not a JSON object", "string"}},
		{"data after the object", stFile(`{} {}`, 0), []string{"after the JSON object"}},
		{"invalid UTF-8", stFile("{\"\xff\":{}}", 0), []string{"UTF-8"}},
		{"duplicate tensor", stFile(`{`+entry("w", "F32", "[1]", "[0,4]")+`,`+entry("w", "F32", "[1]", "[4,8]")+`}`, 8), []string{`duplicate key "w"`}},
		{"entry not an object", stFile(`{"w":5}`, 0), []string{`"w"`, "not a JSON object"}},
		{"unknown dtype", stFile(`{`+entry("w", "F8_E4M3", "[2]", "[0,2]")+`}`, 2), []string{`"w"`, `unsupported dtype "F8_E4M3"`}},
		{"negative shape", stFile(`{`+entry("w", "F32", "[-1,2]", "[0,0]")+`}`, 0), []string{`"w"`, "negative size -1"}},
		{"fractional shape", stFile(`{`+entry("w", "F32", "[1.5]", "[0,4]")+`}`, 4), []string{`"w"`, "shape", "1.5"}},
		{"shape overflows", stFile(`{`+entry("w", "F32", "[4294967296,4294967296]", "[0,0]")+`}`, 0), []string{`"w"`, "overflow"}},
		{"empty shape overflows", stFile(`{`+entry("w", "U8", "[0,4294967296,4294967296]", "[0,0]")+`}`, 0), []string{`"w"`, "overflow"}},
		{"rank over 16", stFile(`{`+entry("w", "U8", "[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]", "[0,1]")+`}`, 1), []string{`"w"`, "rank 17"}},
		{"data_offsets length mismatch with shape", stFile(`{`+entry("w", "F32", "[2,3]", "[0,20]")+`}`, 24), []string{`"w"`, "span 20 bytes", "needs 24"}},
		{"data_offsets not a pair", stFile(`{`+entry("w", "F32", "[1]", "[4]")+`}`, 4), []string{`"w"`, "data_offsets [4] has 1 values"}},
		{"data_offsets reversed", stFile(`{`+entry("w", "F32", "[1]", "[8,4]")+`}`, 8), []string{`"w"`, "0 <= begin <= end"}},
		{"data_offsets negative", stFile(`{`+entry("w", "U8", "[1]", "[-1,0]")+`}`, 8), []string{`"w"`, "0 <= begin <= end"}},
		{"overlapping tensors", stFile(`{`+entry("a", "F32", "[4]", "[0,16]")+`,`+entry("b", "F32", "[2]", "[8,16]")+`}`, 16), []string{"overlap", `"a"`, `"b"`}},
		{"data beyond EOF", stFile(`{`+entry("w", "F32", "[4]", "[0,16]")+`}`, 8), []string{`"w"`, "truncated"}},
		{"offsets past int64", stFile(`{`+entry("w", "U8", "[1]", "[9223372036854775807,9223372036854775808]")+`}`, 8), []string{`"w"`, "data_offsets"}},
		{"unknown field", stFile(`{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"offset":3}}`, 4), []string{`"w"`, `unknown field "offset"`}},
		{"field name in another case", stFile(`{"w":{"DType":"F32","shape":[1],"data_offsets":[0,4]}}`, 4), []string{`"w"`, `unknown field "DType"`}},
		{"missing field", stFile(`{"w":{"dtype":"F32","shape":[1]}}`, 4), []string{`"w"`, "missing data_offsets"}},
		{"null field", stFile(`{"w":{"dtype":"F32","shape":null,"data_offsets":[0,4]}}`, 4), []string{`"w"`, "shape is null"}},
		{"metadata not a map", stFile(`{"__metadata__":["a"]}`, 0), []string{"__metadata__", "not a JSON object"}},
		{"metadata value not a string", stFile(`{"__metadata__":{"epoch":3}}`, 0), []string{"__metadata__", "epoch"}},
	}
	a := newArena(t, 1<<16)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "bad.safetensors")
			if err := os.WriteFile(path, tc.file, 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := ParseSafetensorsHeader(bytes.NewReader(tc.file), int64(len(tc.file)))
			wantErr(t, err, tc.want...)
			tensors, h, err := LoadSafetensors(path, a)
			wantErr(t, err, append(tc.want, path)...)
			if tensors != nil || h != nil || a.Used() != 0 {
				t.Errorf("failed load returned %v, %v and holds %d arena bytes", tensors, h, a.Used())
			}
		})
	}
}

func TestParseSafetensorsAccepts(t *testing.T) {
	tests := []struct {
		name    string
		file    []byte
		entries []SafetensorsEntry
	}{
		{"empty header", stFile(`{}`, 0), nil},
		{"padded header", stFile(`{"__metadata__":null}    `, 0), nil},
		{"gap between tensors", stFile(`{"b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]},"a":{"dtype":"I16","shape":[],"data_offsets":[0,2]}}`, 8),
			[]SafetensorsEntry{{"a", Int16, []int64{}, 0, 2}, {"b", UInt8, []int64{2}, 6, 8}}},
		// Empty tensors hold no bytes, so they overlap nothing wherever they sit.
		{"empty tensors inside others", stFile(`{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F64","shape":[3,0],"data_offsets":[4,4]},"f":{"dtype":"BOOL","shape":[0],"data_offsets":[8,8]}}`, 8),
			[]SafetensorsEntry{{"x", Float32, []int64{2}, 0, 8}, {"e", Float64, []int64{3, 0}, 4, 4}, {"f", Bool, []int64{0}, 8, 8}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, err := ParseSafetensorsHeader(bytes.NewReader(tc.file), int64(len(tc.file)))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(h.Entries, tc.entries) {
				t.Errorf("entries %+v, want %+v", h.Entries, tc.entries)
			}
			if want := 8 + int64(binary.LittleEndian.Uint64(tc.file)); h.DataStart != want {
				t.Errorf("data start %d, want %d", h.DataStart, want)
			}
		})
	}
}

// A load that fails half way frees what it had allocated.
func TestLoadSafetensorsFreesOnError(t *testing.T) {
	path := filepath.Join(t.TempDir(), "big.safetensors")
	file := stFile(`{"a":{"dtype":"U8","shape":[3000],"data_offsets":[0,3000]},"b":{"dtype":"U8","shape":[3000],"data_offsets":[3000,6000]}}`, 6000)
	if err := os.WriteFile(path, file, 0o644); err != nil {
		t.Fatal(err)
	}
	a := newArena(t, 4096) // room for one of the two
	_, _, err := LoadSafetensors(path, a)
	wantErr(t, err, `tensor "b"`, "no room")
	if a.Used() != 0 {
		t.Errorf("used %d after a failed load", a.Used())
	}
	if _, _, err := LoadSafetensors(filepath.Join(t.TempDir(), "missing"), a); err == nil {
		t.Error("loaded a missing file")
	}
	if _, _, err := LoadSafetensors(t.TempDir(), a); err == nil || !strings.Contains(err.Error(), "regular file") {
		t.Errorf("loading a directory: %v", err)
	}
}

// A header that parses describes only bytes inside the file, each tensor's
// exactly the size the arena will give it, sorted and disjoint.
func FuzzParseSafetensorsHeader(f *testing.F) {
	f.Add(stFile(`{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}}`, 22))
	f.Add(stFile(`{"e":{"dtype":"I64","shape":[0,5],"data_offsets":[8,8]},"s":{"dtype":"BOOL","shape":[],"data_offsets":[0,1]}}   `, 8))
	f.Add(stFile(`{}`, 0))
	f.Fuzz(func(t *testing.T, file []byte) {
		size := int64(len(file))
		h, err := ParseSafetensorsHeader(bytes.NewReader(file), size)
		if err != nil {
			return
		}
		if h.DataStart <= 8 || h.DataStart > size || int64(binary.LittleEndian.Uint64(file))+8 != h.DataStart {
			t.Fatalf("data start %d in a file of %d bytes", h.DataStart, size)
		}
		for i, e := range h.Entries {
			if e.Begin < 0 || e.End < e.Begin || h.DataStart+e.End > size {
				t.Fatalf("%q: [%d, %d) after %d in a file of %d bytes", e.Name, e.Begin, e.End, h.DataStart, size)
			}
			d := Descriptor{DType: e.DType, Shape: e.Shape, Strides: ContiguousStrides(e.Shape), Device: CPU}
			if _, n, err := d.Span(); err != nil || n != e.End-e.Begin {
				t.Fatalf("%q: %s %v spans %d bytes (%v), entry holds %d", e.Name, e.DType, e.Shape, n, err, e.End-e.Begin)
			}
			if i > 0 {
				p := h.Entries[i-1]
				if p.Begin > e.Begin || p.Begin == e.Begin && p.Name >= e.Name {
					t.Fatalf("entries out of order: %q then %q", p.Name, e.Name)
				}
			}
			for _, o := range h.Entries[:i] {
				if e.Begin < o.End && o.Begin < e.End {
					t.Fatalf("%q [%d, %d) overlaps %q [%d, %d)", o.Name, o.Begin, o.End, e.Name, e.Begin, e.End)
				}
			}
		}
	})
}

// npyValues sets a tensor's elements from float64s through its typed view.
func npyValues(t *testing.T, x *Tensor, vals []float64) {
	t.Helper()
	var err error
	switch x.DType() {
	case Float64:
		var v []float64
		if v, err = x.Float64(); err == nil {
			copy(v, vals)
		}
	case Float32:
		var v []float32
		if v, err = x.Float32(); err == nil {
			for i := range v {
				v[i] = float32(vals[i])
			}
		}
	case Int64:
		var v []int64
		if v, err = x.Int64(); err == nil {
			for i := range v {
				v[i] = int64(vals[i])
			}
		}
	case Int8:
		var v []int8
		if v, err = x.Int8(); err == nil {
			for i := range v {
				v[i] = int8(vals[i])
			}
		}
	case Float16:
		var v []uint16
		if v, err = x.Float16(); err == nil {
			for i := range v {
				v[i] = Float32ToHalf(float32(vals[i]))
			}
		}
	case Bool, UInt8:
		var v []uint8
		if v, err = x.UInt8(); err == nil {
			for i := range v {
				v[i] = uint8(vals[i])
			}
		}
	default:
		t.Fatalf("no setter for %s", x.DType())
	}
	if err != nil {
		t.Fatal(err)
	}
}

func TestWriteNPY(t *testing.T) {
	a := newArena(t, 1<<16)
	tests := []struct {
		name   string
		dt     DType
		shape  []int64
		values []float64
		descr  string
		dict   string // the header dict exactly, when given
	}{
		{"float32", Float32, []int64{2, 3}, []float64{0, 1.5, -2.25, 3, 1e6, -0.125}, "<f4",
			"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"},
		{"int64", Int64, []int64{4}, []float64{-5, 0, 1 << 40, 7}, "<i8",
			"{'descr': '<i8', 'fortran_order': False, 'shape': (4,), }"},
		{"float64 scalar", Float64, []int64{}, []float64{math.Pi}, "<f8",
			"{'descr': '<f8', 'fortran_order': False, 'shape': (), }"},
		{"float16", Float16, []int64{1, 2}, []float64{0.5, -65504}, "<f2", ""},
		{"int8", Int8, []int64{2, 1, 2}, []float64{-128, 127, 0, -1}, "|i1", ""},
		{"bool", Bool, []int64{3}, []float64{1, 0, 1}, "|b1", ""},
		{"empty", Float32, []int64{0, 3}, nil, "<f4", ""},
	}
	python := numpyPython()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			x, err := a.NewTensor(tc.dt, tc.shape...)
			if err != nil {
				t.Fatal(err)
			}
			defer x.Free()
			npyValues(t, x, tc.values)
			path := filepath.Join(t.TempDir(), "x.npy")
			if err := WriteNPY(path, x); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.HasPrefix(b, []byte("\x93NUMPY\x01\x00")) {
				t.Fatalf("preamble %q", b[:min(len(b), 8)])
			}
			pre := 10 + int(binary.LittleEndian.Uint16(b[8:]))
			if pre%64 != 0 || pre > len(b) || b[pre-1] != '\n' {
				t.Fatalf("preamble of %d bytes: %q", pre, b[:min(len(b), pre)])
			}
			if tc.dict != "" && strings.TrimRight(string(b[10:pre]), " \n") != tc.dict {
				t.Errorf("header %q, want %q", b[10:pre], tc.dict)
			}
			r := bytes.NewReader(b)
			descr, shape, err := ReadNPYHeader(r)
			if err != nil {
				t.Fatal(err)
			}
			if descr != tc.descr || !slices.Equal(shape, tc.shape) {
				t.Errorf("header says %s %v, want %s %v", descr, shape, tc.descr, tc.shape)
			}
			if r.Len() != len(b)-pre || !bytes.Equal(b[pre:], x.Bytes()) {
				t.Errorf("data differs from the tensor's bytes")
			}
			t.Run("numpy", func(t *testing.T) {
				if python == "" {
					t.Skip("python3 with numpy not found")
				}
				checkWithNumpy(t, python, path, tc.descr, tc.shape, tc.values)
			})
		})
	}
}

// numpyPython is the interpreter scripts/test resolved (VLKV_TEST_PYTHON),
// else python3 from PATH, when it can import numpy; else "".
func numpyPython() string {
	python := os.Getenv("VLKV_TEST_PYTHON")
	if python == "" {
		var err error
		if python, err = exec.LookPath("python3"); err != nil {
			return ""
		}
	}
	if err := exec.Command(python, "-c", "import numpy").Run(); err != nil {
		return ""
	}
	return python
}

func checkWithNumpy(t *testing.T, python, path, descr string, shape []int64, values []float64) {
	const script = `import json, sys, numpy
a = numpy.load(sys.argv[1])
print(json.dumps({"descr": a.dtype.str, "shape": list(a.shape), "values": a.ravel().astype(float).tolist()}))`
	var stderr bytes.Buffer
	cmd := exec.Command(python, "-c", script, path)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("numpy.load: %v\n%s", err, stderr.Bytes())
	}
	var got struct {
		Descr  string
		Shape  []int64
		Values []float64
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if got.Descr != descr || !slices.Equal(got.Shape, shape) || !slices.Equal(got.Values, values) {
		t.Errorf("numpy read %s %v %v, want %s %v %v", got.Descr, got.Shape, got.Values, descr, shape, values)
	}
}

func TestWriteNPYErrors(t *testing.T) {
	a := newArena(t, 4096)
	bf, _ := a.NewTensor(BFloat16, 4)
	x, _ := a.NewTensor(Float32, 2, 3)
	transposed, err := a.Tensor(Descriptor{Arena: a.ID(), Offset: x.Desc().Offset, DType: Float32, Shape: []int64{3, 2}, Strides: []int64{1, 3}, Device: CPU})
	if err != nil {
		t.Fatal(err)
	}
	y, _ := a.NewTensor(BFloat16, 2, 3)
	bfTransposed, err := a.Tensor(Descriptor{Arena: a.ID(), Offset: y.Desc().Offset, DType: BFloat16, Shape: []int64{3, 2}, Strides: []int64{1, 3}, Device: CPU})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		write func(string, *Tensor) error
		x     *Tensor
		want  []string
	}{
		{"bfloat16", WriteNPY, bf, []string{"bfloat16 has no numpy dtype", "float32"}},
		{"not contiguous", WriteNPY, transposed, []string{"x.npy", "not contiguous", "copy it into a contiguous tensor"}},
		{"bfloat16 widened, not contiguous", WriteNPYWidened, bfTransposed, []string{"x.npy", "not contiguous", "copy it into a contiguous tensor"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			wantErr(t, tc.write(filepath.Join(dir, "x.npy"), tc.x), tc.want...)
			if ents, _ := os.ReadDir(dir); len(ents) != 0 {
				t.Errorf("a failed write left %v behind", ents[0].Name())
			}
		})
	}
}

func TestReadNPYHeader(t *testing.T) {
	v1 := func(dict string) []byte {
		return append(binary.LittleEndian.AppendUint16([]byte("\x93NUMPY\x01\x00"), uint16(len(dict))), dict...)
	}
	v2 := func(dict string) []byte {
		return append(binary.LittleEndian.AppendUint32([]byte("\x93NUMPY\x02\x00"), uint32(len(dict))), dict...)
	}
	tests := []struct {
		name  string
		in    []byte
		descr string
		shape []int64
		want  string // error
	}{
		{"version 2.0", v2("{'descr': '>i4', 'fortran_order': False, 'shape': (3, 0, 2), }     \n"), ">i4", []int64{3, 0, 2}, ""},
		{"keys in another order", v1(`{"shape": (5,), "fortran_order": False, "descr": "|u1"}` + "\n"), "|u1", []int64{5}, ""},
		{"bad magic", []byte("\x93NUMPZ\x01\x00\x00\x00"), "", nil, "bad magic"},
		{"version 3.0", []byte("\x93NUMPY\x03\x00\x00\x00\x00\x00"), "", nil, "unsupported version 3.0"},
		{"short", []byte("\x93NUM"), "", nil, "magic"},
		{"header cut", v1("{'descr': '<f4'")[:14], "", nil, "header"},
		{"no newline", v1("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"), "", nil, "newline"},
		{"fortran order", v1("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }\n"), "", nil, "fortran_order True"},
		{"missing shape", v1("{'descr': '<f4', 'fortran_order': False, }\n"), "", nil, "missing shape"},
		{"negative dimension", v1("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }\n"), "", nil, "shape"},
		{"unknown key", v1("{'descr': '<f4', 'fortran_order': False, 'shape': (), 'x': 1}\n"), "", nil, `unknown key "x"`},
		{"structured dtype", v1("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (), }\n"), "", nil, "descr"},
		{"not a dict", v1("[1, 2]\n"), "", nil, "not a dict"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			descr, shape, err := ReadNPYHeader(bytes.NewReader(tc.in))
			if tc.want != "" {
				wantErr(t, err, tc.want)
				return
			}
			if err != nil || descr != tc.descr || !slices.Equal(shape, tc.shape) {
				t.Fatalf("got %q %v %v, want %q %v", descr, shape, err, tc.descr, tc.shape)
			}
		})
	}
}

func TestRemoveTempsTakesOnlyInterruptedWrites(t *testing.T) {
	dir := t.TempDir()
	keep := []string{"attn.npy", "x", "odd.tmp-", "name.tmp-12.npy", "b.tmp-x1"}
	gone := []string{"attn.npy.tmp-123456", "a.tmp-b.npy.tmp-7"}
	for _, name := range append(append([]string{}, keep...), gone...) {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := RemoveTemps(dir); err != nil {
		t.Fatal(err)
	}
	for _, name := range keep {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Errorf("%s was removed", name)
		}
	}
	for _, name := range gone {
		if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
			t.Errorf("%s, left by an interrupted write, is still there", name)
		}
	}
	if err := RemoveTemps(filepath.Join(dir, "missing")); err != nil {
		t.Errorf("a job that wrote no tensors yet: %v", err)
	}
}

// A temporary file another write holds (another attempt at the same job,
// still running) is kept: its rename would fail.
func TestRemoveTempsLeavesAWriteUnderWay(t *testing.T) {
	dir := t.TempDir()
	live := filepath.Join(dir, "attn.npy.tmp-42")
	f, err := os.Create(live)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		t.Skipf("no file locks here: %v", err)
	}
	if err := RemoveTemps(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Fatalf("the file of a write under way was removed: %v", err)
	}
	// The write ends: its file is renamed into place, as writeFileAtomic does.
	if err := os.Rename(live, filepath.Join(dir, "attn.npy")); err != nil {
		t.Fatal(err)
	}
}
