package tensor

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func newArena(t testing.TB, size int64) *Arena {
	t.Helper()
	a, err := NewArena(1, "test", size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

func TestDescriptorValidate(t *testing.T) {
	ok := Descriptor{Arena: 1, Offset: 64, DType: Float32, Shape: []int64{2, 3}, Strides: []int64{3, 1}, Device: CPU}
	with := func(f func(*Descriptor)) Descriptor {
		d := ok
		d.Shape = append([]int64(nil), ok.Shape...)
		d.Strides = append([]int64(nil), ok.Strides...)
		f(&d)
		return d
	}
	tests := []struct {
		name    string
		d       Descriptor
		size    int64
		wantErr string
	}{
		{"valid", ok, 4096, ""},
		{"exactly fits", ok, 64 + 24, ""},
		{"one byte short", ok, 64 + 23, "outside arena"},
		{"empty tensor at the end", with(func(d *Descriptor) { d.Shape = []int64{0, 3}; d.Offset = 4096 }), 4096, ""},
		{"broadcast stride 0", with(func(d *Descriptor) { d.Strides = []int64{0, 1} }), 64 + 12, ""},
		{"transposed", with(func(d *Descriptor) { d.Strides = []int64{1, 2} }), 64 + 24, ""},
		{"unknown dtype", with(func(d *Descriptor) { d.DType = DType{Code: 9, Bits: 32, Lanes: 1} }), 4096, "unsupported dtype"},
		{"zero bits", with(func(d *Descriptor) { d.DType = DType{Code: CodeFloat, Bits: 0, Lanes: 1} }), 4096, "unsupported dtype"},
		{"gpu device", with(func(d *Descriptor) { d.Device = Device{Type: 2} }), 4096, "not the CPU"},
		{"negative size", with(func(d *Descriptor) { d.Shape[0] = -1 }), 4096, "negative size"},
		{"negative stride", with(func(d *Descriptor) { d.Strides[1] = -1 }), 4096, "negative stride"},
		{"negative offset", with(func(d *Descriptor) { d.Offset = -64 }), 4096, "negative offset"},
		{"stride count", with(func(d *Descriptor) { d.Strides = []int64{1} }), 4096, "1 strides for 2 dimensions"},
		{"misaligned", with(func(d *Descriptor) { d.ByteOffset = 2 }), 4096, "not aligned"},
		{"overflowing shape", with(func(d *Descriptor) { d.Shape = []int64{math.MaxInt64, 2} }), 4096, "overflow"},
		{"broadcast element count overflowing", with(func(d *Descriptor) { d.Shape = []int64{1 << 32, 1 << 32}; d.Strides = []int64{0, 0} }), 4096, "element count"},
		{"overflowing offset", with(func(d *Descriptor) { d.Offset = math.MaxInt64 - 3 }), 4096, "overflow"},
		{"too many dims", with(func(d *Descriptor) { d.Shape = make([]int64, 17); d.Strides = make([]int64, 17) }), 4096, "rank 17"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.d.Validate(tc.size)
			if tc.wantErr == "" && err != nil {
				t.Fatalf("unexpected error %v", err)
			}
			if tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("got %v, want an error containing %q", err, tc.wantErr)
			}
		})
	}
}

// Any descriptor that validates touches only bytes inside the arena.
func FuzzDescriptorValidate(f *testing.F) {
	f.Add(`{"arena":1,"offset":64,"byte_offset":0,"dtype":{"code":2,"bits":32,"lanes":1},"shape":[2,3],"strides":[3,1],"device":{"type":1,"id":0}}`, int64(4096))
	f.Add(`{"offset":9223372036854775800,"dtype":{"code":2,"bits":16,"lanes":1},"shape":[4],"strides":[1],"device":{"type":1}}`, int64(1<<20))
	f.Fuzz(func(t *testing.T, js string, size int64) {
		var d Descriptor
		if json.Unmarshal([]byte(js), &d) != nil || size < 0 {
			return
		}
		if d.Validate(size) != nil {
			return
		}
		start, end, err := d.Span()
		if err != nil || start < 0 || end < start || end > size {
			t.Fatalf("validated descriptor spans [%d, %d) of %d: %v", start, end, size, err)
		}
		// Walk the corner elements: each must lie inside the span.
		if d.NumElements() > 0 {
			lastIdx := int64(0)
			for i, n := range d.Shape {
				lastIdx += (n - 1) * d.Strides[i]
			}
			if last := start + lastIdx*d.DType.Size(); last+d.DType.Size() > end {
				t.Fatalf("last element at %d beyond end %d", last, end)
			}
		}
	})
}

func TestArenaAllocFree(t *testing.T) {
	a := newArena(t, 4096)
	if a.Size() != 4096 {
		t.Fatalf("size %d", a.Size())
	}
	x, err := a.Alloc(100, 0)
	if err != nil {
		t.Fatal(err)
	}
	y, err := a.Alloc(10, 256)
	if err != nil {
		t.Fatal(err)
	}
	if x%Alignment != 0 || y%256 != 0 || y < x+100 {
		t.Fatalf("offsets %d %d", x, y)
	}
	if _, err := a.Alloc(8192, 0); err == nil || !strings.Contains(err.Error(), "no room") {
		t.Fatalf("oversized alloc: %v", err)
	}
	if err := a.Free(x + 1); err == nil {
		t.Fatal("freed an offset that was never allocated")
	}
	if err := a.Free(x); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(x); err == nil {
		t.Fatal("double free went unnoticed")
	}
	if err := a.Free(y); err != nil {
		t.Fatal(err)
	}
	// Everything coalesced: the whole arena is one allocation again.
	if a.Used() != 0 {
		t.Fatalf("used %d after freeing everything", a.Used())
	}
	if off, err := a.Alloc(4096, 0); err != nil || off != 0 {
		t.Fatalf("whole-arena alloc after frees: %d, %v", off, err)
	}
	if _, err := a.Alloc(64, 3); err == nil {
		t.Fatal("accepted a non-power-of-two alignment")
	}
}

// A size near MaxInt64 is refused, not rounded up past it into a negative
// allocation that corrupts the free list and lets later ones overlap.
func TestArenaAllocHugeSize(t *testing.T) {
	a := newArena(t, 4096)
	for _, n := range []int64{math.MaxInt64, math.MaxInt64 - 63, math.MaxInt64 - 100, 4097} {
		if off, err := a.Alloc(n, 0); err == nil || !strings.Contains(err.Error(), "no room") {
			t.Fatalf("Alloc(%d): offset %d, %v", n, off, err)
		}
	}
	if x, err := a.NewTensor(UInt8, math.MaxInt64); err == nil {
		t.Fatalf("NewTensor(uint8, MaxInt64) allocated %+v", x.Desc())
	}
	if a.Used() != 0 {
		t.Fatalf("used %d after refused allocations", a.Used())
	}
	if off, err := a.Alloc(4096, 0); err != nil || off != 0 {
		t.Fatalf("whole-arena alloc after refused ones: %d, %v", off, err)
	}
}

func TestArenaManyTensorsAndViews(t *testing.T) {
	a := newArena(t, 1<<20)
	type tc struct {
		dt   DType
		fill func(*Tensor) error
	}
	var tensors []*Tensor
	for _, dt := range []DType{Float32, Float16, BFloat16, Int8, UInt8, Int32, Int64} {
		x, err := a.NewTensor(dt, 3, 5)
		if err != nil {
			t.Fatal(err)
		}
		if x.Desc().Offset%Alignment != 0 || len(x.Bytes()) != int(15*dt.Size()) {
			t.Fatalf("%s: offset %d, %d bytes", dt, x.Desc().Offset, len(x.Bytes()))
		}
		tensors = append(tensors, x)
	}
	f32, _ := tensors[0].Float32()
	f32[7] = 1.5
	if got := math.Float32frombits(uint32(tensors[0].Bytes()[28]) | uint32(tensors[0].Bytes()[29])<<8 | uint32(tensors[0].Bytes()[30])<<16 | uint32(tensors[0].Bytes()[31])<<24); got != 1.5 {
		t.Fatalf("view does not alias memory: %v", got)
	}
	if _, err := tensors[0].Int32(); err == nil {
		t.Error("int32 view of a float32 tensor")
	}
	if v, err := tensors[1].Float16(); err != nil || len(v) != 15 {
		t.Errorf("float16 view: %d, %v", len(v), err)
	}
	if v, err := tensors[6].Int64(); err != nil || len(v) != 15 {
		t.Errorf("int64 view: %d, %v", len(v), err)
	}
	strided, err := a.Tensor(Descriptor{Arena: 1, Offset: tensors[0].Desc().Offset, DType: Float32, Shape: []int64{5, 3}, Strides: []int64{1, 5}, Device: CPU})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := strided.Float32(); err == nil || !strings.Contains(err.Error(), "not contiguous") {
		t.Errorf("view of a transposed tensor: %v", err)
	}
	if err := strided.Free(); err == nil {
		t.Error("freed a tensor this process did not allocate")
	}
	for _, x := range tensors {
		if err := x.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if a.Used() != 0 {
		t.Errorf("used %d after freeing all tensors", a.Used())
	}
	if _, err := a.Tensor(Descriptor{Arena: 2, DType: Float32, Device: CPU}); err == nil {
		t.Error("resolved a descriptor of another arena")
	}
}

func TestTensorJSONRef(t *testing.T) {
	a := newArena(t, 4096)
	x, _ := a.NewTensor(BFloat16, 4)
	b, err := json.Marshal(map[string]any{"x": x})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"__tensor__":{"arena":1`) {
		t.Fatalf("marshalled as %s", b)
	}
	var back struct{ X Ref }
	if err := json.Unmarshal(b, &back); err != nil || back.X.Desc.DType != BFloat16 || back.X.Desc.Shape[0] != 4 {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
	var bad Ref
	if err := json.Unmarshal([]byte(`{"x": 1}`), &bad); err == nil {
		t.Error("decoded a non-reference as a tensor")
	}
}

func TestHalfConversions(t *testing.T) {
	tests := []struct {
		f    float32
		half uint16
		bf   uint16
	}{
		{0, 0, 0},
		{1, 0x3c00, 0x3f80},
		{-2, 0xc000, 0xc000},
		{65504, 0x7bff, 0x477f + 1}, // bf16 rounds 65504 up to 65536
		{float32(math.Inf(1)), 0x7c00, 0x7f80},
		{5.960464477539063e-08, 0x0001, 0x3380}, // smallest half subnormal
	}
	for _, tc := range tests {
		if got := Float32ToHalf(tc.f); got != tc.half {
			t.Errorf("Float32ToHalf(%g) = %#04x, want %#04x", tc.f, got, tc.half)
		}
		if got := HalfToFloat32(tc.half); got != tc.f {
			t.Errorf("HalfToFloat32(%#04x) = %g, want %g", tc.half, got, tc.f)
		}
		if got := Float32ToBFloat16(tc.f); got != tc.bf {
			t.Errorf("Float32ToBFloat16(%g) = %#04x, want %#04x", tc.f, got, tc.bf)
		}
	}
	if v := HalfToFloat32(Float32ToHalf(float32(math.NaN()))); v == v {
		t.Error("NaN did not survive a half round trip")
	}
	if Float32ToHalf(1e6) != 0x7c00 {
		t.Error("overflow does not saturate to infinity")
	}
}

func TestParseDType(t *testing.T) {
	for _, n := range names {
		dt, err := ParseDType(n.name)
		if err != nil || dt != n.dt || dt.String() != n.name {
			t.Errorf("%s: %v %v", n.name, dt, err)
		}
	}
	if _, err := ParseDType("complex64"); err == nil || !strings.Contains(err.Error(), "known:") {
		t.Errorf("unknown dtype: %v", err)
	}
}

func TestFloat64sRoundTripEveryDType(t *testing.T) {
	a := newArena(t, 1<<16)
	want := []float64{0, 1, -2, 3.5, 100}
	for _, n := range names {
		t.Run(n.name, func(t *testing.T) {
			x, err := a.NewTensor(n.dt, 5)
			if err != nil {
				t.Fatal(err)
			}
			in := append([]float64(nil), want...)
			exact := map[DType][]float64{UInt8: {0, 1, 254, 3, 100}, Bool: {0, 1, 1, 1, 1}, Int8: {0, 1, -2, 3, 100},
				Int16: {0, 1, -2, 3, 100}, Int32: {0, 1, -2, 3, 100}, Int64: {0, 1, -2, 3, 100}}
			if e, ok := exact[n.dt]; ok {
				in = e
			}
			if err := x.SetFloat64s(in); err != nil {
				t.Fatal(err)
			}
			got, err := x.Float64s()
			if err != nil {
				t.Fatal(err)
			}
			for i := range in {
				if got[i] != in[i] {
					t.Fatalf("element %d: wrote %v, read %v", i, in[i], got[i])
				}
			}
		})
	}
	x, _ := a.NewTensor(Float32, 3)
	if err := x.SetFloat64s([]float64{1}); err == nil {
		t.Error("accepted 1 value for 3 elements")
	}
}

func TestNPYNameIsDistinctAndReversible(t *testing.T) {
	names := []string{"a/b", "a_b", "a%2Fb", "..", ".hidden", "a.b", "a b", "über", "", "x.npy"}
	seen := map[string]string{}
	for _, name := range names {
		file := NPYName(name)
		if other, ok := seen[file]; ok {
			t.Errorf("%q and %q both map to %s", name, other, file)
		}
		seen[file] = name
		if strings.ContainsAny(file, "/\\") || strings.HasPrefix(file, ".") {
			t.Errorf("%q -> %q reaches outside its directory or hides", name, file)
		}
		back, err := NameFromNPY(file)
		if err != nil || back != name {
			t.Errorf("%q -> %q -> %q, %v", name, file, back, err)
		}
	}
	if _, err := NameFromNPY("a/b.npy"); err == nil {
		t.Error("a name NPYName never writes was accepted")
	}
	// Names whose escaped form is too long for a file name stay distinct and fit.
	long1, long2 := strings.Repeat("/", 100)+"a", strings.Repeat("/", 100)+"b"
	f1, f2 := NPYName(long1), NPYName(long2)
	if f1 == f2 || len(f1) > 255 || len(f2) > 255 || !strings.Contains(f1, "~") || strings.Contains(f1[:strings.Index(f1, "~")], "%2~") {
		t.Errorf("long names: %q, %q", f1, f2)
	}
	if _, err := NameFromNPY(f1); err == nil {
		t.Error("a cut name claimed to be reversible")
	}
}

// A tensor whose file name is near the 255-byte limit is written: the
// temporary file beside it once added ".tmp-" and digits and went over.
func TestWriteNPYLongNames(t *testing.T) {
	a, err := NewArena(1, "npy", 1<<12)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	x, _ := a.NewTensor(Float32, 2)
	tests := []struct {
		name string
		tn   string
	}{
		{"240 letters", strings.Repeat("a", 240)},
		{"longest kept whole", strings.Repeat("b", maxNameBytes)},
		{"cut with a hash", strings.Repeat("c", 300)},
		{"escaped and cut", strings.Repeat("/", 90)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			file := NPYName(tt.tn)
			if err := WriteNPY(filepath.Join(dir, file), x); err != nil {
				t.Fatal(err)
			}
			entries, _ := os.ReadDir(dir)
			if len(entries) != 1 || entries[0].Name() != file {
				t.Errorf("directory holds %v, want only %s", entries, file)
			}
		})
	}
	// What fits no file system is still refused, with the path in the error.
	if err := WriteNPY(filepath.Join(t.TempDir(), strings.Repeat("d", 256)+".npy"), x); err == nil {
		t.Error("wrote a file whose name is over 255 bytes")
	}
}

// A worker's descriptor with zero strides names more elements than the
// bytes it spans: copying it out refuses it as not contiguous, without
// sizing a buffer by its element count first (a host panic, or all memory).
func TestFloat64sOfABroadcastDescriptor(t *testing.T) {
	a, err := NewArena(1, "broadcast", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	for _, dt := range []DType{BFloat16, Float32} {
		x, err := a.Tensor(Descriptor{Arena: 1, DType: dt, Shape: []int64{1 << 31, 1 << 31}, Strides: []int64{0, 0}, Device: CPU})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.Float64s(); err == nil || !strings.Contains(err.Error(), "not contiguous") {
			t.Errorf("%s: Float64s: %v, want a not-contiguous error", dt, err)
		}
		if err := WriteNPYWidened(filepath.Join(t.TempDir(), "x.npy"), x); err == nil || !strings.Contains(err.Error(), "not contiguous") {
			t.Errorf("%s: WriteNPYWidened: %v, want a not-contiguous error", dt, err)
		}
	}
}
