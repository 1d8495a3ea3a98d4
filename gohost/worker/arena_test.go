package worker

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/vlkv/vlkv/gohost/tensor"
)

func newArena(t *testing.T, id uint32, size int64) *tensor.Arena {
	t.Helper()
	a, err := tensor.NewArena(id, "test", size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

func mapArena(t *testing.T, w *Worker, a *tensor.Arena) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := w.MapArena(ctx, a); err != nil {
		t.Fatal(err)
	}
}

// fill writes i+1 into element i of x, whatever its dtype.
func fill(t *testing.T, x *tensor.Tensor) {
	t.Helper()
	v := make([]float64, x.Desc().NumElements())
	for i := range v {
		v[i] = float64(i + 1)
	}
	if err := x.SetFloat64s(v); err != nil {
		t.Fatal(err)
	}
}

func values(t *testing.T, x *tensor.Tensor) []float64 {
	t.Helper()
	v, err := x.Float64s()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestWorkerModifiesArenaTensorsInPlace(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	a := newArena(t, 1, 1<<20)
	mapArena(t, w, a)
	var xs []*tensor.Tensor
	for _, dt := range []tensor.DType{tensor.Float32, tensor.Float16, tensor.BFloat16, tensor.Int8, tensor.UInt8, tensor.Int32, tensor.Int64} {
		x, err := a.NewTensor(dt, 3, 7)
		if err != nil {
			t.Fatal(err)
		}
		fill(t, x)
		xs = append(xs, x)
	}
	if _, err := run(t, w, "kernels_py.runtime.exchange:scale_inplace", map[string]any{"tensors": xs, "factor": 2}, time.Minute); err != nil {
		t.Fatal(err)
	}
	for _, x := range xs {
		for i, v := range values(t, x) {
			if want := float64(2 * (i + 1)); v != want {
				t.Fatalf("%s element %d = %v after the worker doubled it, want %v", x.DType(), i, v, want)
			}
		}
	}
}

func TestWorkerSeesStridesAndOffsets(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	a := newArena(t, 7, 1<<16)
	mapArena(t, w, a)
	x, _ := a.NewTensor(tensor.Float32, 4, 6)
	fill(t, x)
	d := x.Desc()
	d.Shape, d.Strides, d.ByteOffset = []int64{6, 3}, []int64{1, 6}, 4 // transposed rows 0..2, from element 1
	view, err := a.Tensor(d)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := run(t, w, "kernels_py.runtime.exchange:describe", map[string]any{"x": view}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Shape, Strides []int64
		First          float64
	}
	json.Unmarshal(raw, &got)
	if fmt.Sprint(got.Shape, got.Strides, got.First) != "[6 3] [1 6] 2" {
		t.Fatalf("worker saw %s", raw)
	}
}

func TestWorkerRejectsBadDescriptors(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	a := newArena(t, 3, 4096)
	mapArena(t, w, a)
	good := map[string]any{"arena": 3, "offset": 0, "byte_offset": 0, "dtype": map[string]any{"code": 2, "bits": 32, "lanes": 1},
		"shape": []int{4}, "strides": []int{1}, "device": map[string]any{"type": 1, "id": 0}}
	with := func(k string, v any) map[string]any {
		d := map[string]any{}
		for kk, vv := range good {
			d[kk] = vv
		}
		d[k] = v
		return d
	}
	tests := []struct {
		name string
		desc any
		want string
	}{
		{"past the end", with("offset", 4096-8), "fall outside arena 3"},
		{"huge shape", with("shape", []int64{1 << 62}), "fall outside arena 3"},
		{"unmapped arena", with("arena", 99), "arena 99 is not mapped"},
		{"unknown dtype", with("dtype", map[string]any{"code": 9, "bits": 32, "lanes": 1}), "unsupported dtype"},
		{"negative stride", with("strides", []int{-1}), "negative"},
		{"gpu device", with("device", map[string]any{"type": 2, "id": 0}), "not the CPU"},
		{"misaligned", with("byte_offset", 2), "not aligned"},
		{"strides mismatch", with("strides", []int{1, 1}), "2 strides for 1 dimensions"},
		{"not an object", "oops", "must be an object"},
		{"float offset", with("offset", 1.5), "must be an integer"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := run(t, w, "kernels_py.runtime.exchange:describe", map[string]any{"x": map[string]any{"__tensor__": tc.desc}}, time.Minute)
			var je *JobError
			if !errors.As(err, &je) || !strings.Contains(je.Message, tc.want) {
				t.Fatalf("got %v, want a job error mentioning %q", err, tc.want)
			}
			if !w.Alive() {
				t.Fatal("a bad descriptor killed the worker")
			}
		})
	}
	// The worker still serves good descriptors.
	if _, err := run(t, w, "kernels_py.runtime.exchange:describe", map[string]any{"x": map[string]any{"__tensor__": good}}, time.Minute); err != nil {
		t.Fatal(err)
	}
}

func TestWorkerReturnsTensorsFromScratch(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	a := newArena(t, 2, 1<<16)
	mapArena(t, w, a)
	off, err := a.Alloc(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	raw, err := w.Run(ctx, Job{Fn: "kernels_py.runtime.exchange:arange_out", Args: map[string]any{"n": 100},
		Scratch: &tensor.Region{Arena: 2, Offset: off, Size: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		Values tensor.Ref
		Sum    float64
	}
	if err := json.Unmarshal(raw, &res); err != nil {
		t.Fatalf("%v: %s", err, raw)
	}
	x, err := a.Tensor(res.Values.Desc)
	if err != nil {
		t.Fatal(err)
	}
	if d := x.Desc(); d.Offset < off || d.Offset+400 > off+4096 {
		t.Errorf("result at offset %d outside the scratch region [%d, %d)", d.Offset, off, off+4096)
	}
	v, err := x.Float32()
	if err != nil || len(v) != 100 || v[99] != 99 || res.Sum != 4950 {
		t.Fatalf("values %v (err %v), sum %v", v, err, res.Sum)
	}
	// Without a scratch region the job fails cleanly.
	if _, err := run(t, w, "kernels_py.runtime.exchange:arange_out", map[string]any{"n": 4}, time.Minute); err == nil || !strings.Contains(err.Error(), "no scratch region") {
		t.Errorf("job without scratch: %v", err)
	}
	// Too small a region is a job error too.
	_, err = w.Run(ctx, Job{Fn: "kernels_py.runtime.exchange:arange_out", Args: map[string]any{"n": 10000},
		Scratch: &tensor.Region{Arena: 2, Offset: off, Size: 4096}})
	if err == nil || !strings.Contains(err.Error(), "no room") {
		t.Errorf("overflowing scratch: %v", err)
	}
}

func countFDs(t *testing.T, pid int) int {
	t.Helper()
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

func countMappings(t *testing.T, pid int) int {
	t.Helper()
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(maps), "vlkv-")
}

// Thousands of jobs and hundreds of arena hand-overs leak no descriptors or
// mappings on either side.
func TestNoDescriptorOrMappingLeaks(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	a := newArena(t, 1, 1<<20)
	mapArena(t, w, a)
	x, _ := a.NewTensor(tensor.Float32, 64)
	run(t, w, "kernels_py.runtime.exchange:scale_inplace", map[string]any{"tensors": []*tensor.Tensor{x}}, time.Minute)

	hostFDs, workerFDs := countFDs(t, os.Getpid()), countFDs(t, w.Pid())
	workerMaps := countMappings(t, w.Pid())
	for i := 0; i < 2000; i++ {
		if _, err := run(t, w, "kernels_py.runtime.exchange:scale_inplace", map[string]any{"tensors": []*tensor.Tensor{x}, "factor": 1}, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for i := 0; i < 200; i++ {
		b, err := tensor.NewArena(uint32(100+i), "cycle", 1<<16)
		if err != nil {
			t.Fatal(err)
		}
		y, _ := b.NewTensor(tensor.Int32, 8)
		if err := w.MapArena(ctx, b); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Run(ctx, Job{Fn: "kernels_py.runtime.exchange:scale_inplace", Args: map[string]any{"tensors": []*tensor.Tensor{y}}}); err != nil {
			t.Fatal(err)
		}
		if err := w.UnmapArena(ctx, b.ID()); err != nil {
			t.Fatal(err)
		}
		b.Close()
	}
	if got := countFDs(t, os.Getpid()); got != hostFDs {
		t.Errorf("host fds: %d before, %d after", hostFDs, got)
	}
	if got := countFDs(t, w.Pid()); got != workerFDs {
		t.Errorf("worker fds: %d before, %d after", workerFDs, got)
	}
	if got := countMappings(t, w.Pid()); got != workerMaps {
		t.Errorf("worker arena mappings: %d before, %d after", workerMaps, got)
	}
}

// Handing over an arena already closed is refused and leaves the worker be.
func TestMapClosedArena(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	a := newArena(t, 9, 1<<16)
	a.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := w.MapArena(ctx, a); !errors.Is(err, tensor.ErrClosed) {
		t.Fatalf("mapping a closed arena: %v", err)
	}
	if _, err := w.Run(ctx, Job{Fn: "kernels_py.runtime.diag:echo"}); err != nil || !w.Alive() {
		t.Fatalf("worker after the refused mapping: alive %v, %v", w.Alive(), err)
	}
}

func TestArenaOutlivesCrashedWorker(t *testing.T) {
	a := newArena(t, 5, 1<<16)
	x, _ := a.NewTensor(tensor.Int32, 10)
	fill(t, x)
	w := startWorker(t, repoRoot(t))
	mapArena(t, w, a)
	run(t, w, "kernels_py.runtime.exchange:scale_inplace", map[string]any{"tensors": []*tensor.Tensor{x}, "factor": 3}, time.Minute)
	if _, err := run(t, w, "kernels_py.runtime.diag:crash", nil, time.Minute); err == nil {
		t.Fatal("crash job succeeded")
	}
	if v := values(t, x); v[9] != 30 {
		t.Fatalf("host view after the crash: %v", v)
	}
	w2 := startWorker(t, repoRoot(t))
	mapArena(t, w2, a)
	if _, err := run(t, w2, "kernels_py.runtime.exchange:scale_inplace", map[string]any{"tensors": []*tensor.Tensor{x}, "factor": 2}, time.Minute); err != nil {
		t.Fatal(err)
	}
	if v := values(t, x); v[0] != 6 || v[9] != 60 {
		t.Fatalf("after a fresh worker doubled it: %v", v)
	}
}

func TestPipeRoundTripDoublesTheBytes(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, n := range []int{0, 1, 1000, 300000} {
		data := make([]byte, 4*n)
		for i := 0; i < n; i++ {
			binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(float32(i)))
		}
		out, compute, err := w.PipeRoundTrip(ctx, data)
		if err != nil {
			t.Fatalf("%d floats: %v", n, err)
		}
		if len(out) != len(data) || compute < 0 {
			t.Fatalf("%d floats: got %d bytes back, compute %v", n, len(out), compute)
		}
		for i := 0; i < n; i++ {
			if got := math.Float32frombits(binary.LittleEndian.Uint32(out[4*i:])); got != float32(2*i) {
				t.Fatalf("element %d = %v, want %v", i, got, 2*i)
			}
		}
	}
	if _, _, err := w.PipeRoundTrip(ctx, make([]byte, 3)); err == nil {
		t.Error("accepted a partial float32")
	}
	// The channel is still in step afterwards.
	if _, err := w.Run(ctx, Job{Fn: "kernels_py.runtime.diag:echo"}); err != nil {
		t.Fatal(err)
	}
}
