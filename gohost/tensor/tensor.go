package tensor

import (
	"encoding/json"
	"fmt"
	"unsafe"
)

// Tensor is a view of arena memory described by a Descriptor.
type Tensor struct {
	arena *Arena
	desc  Descriptor
	owned bool // allocated by NewTensor; Free releases its bytes
}

func (t *Tensor) Desc() Descriptor { return t.desc }
func (t *Tensor) Arena() *Arena    { return t.arena }
func (t *Tensor) DType() DType     { return t.desc.DType }
func (t *Tensor) Shape() []int64   { return append([]int64(nil), t.desc.Shape...) }

// Bytes returns the bytes the tensor spans, in place.
func (t *Tensor) Bytes() []byte {
	start, end, _ := t.desc.Span()
	return t.arena.Bytes()[start:end]
}

// Free returns an allocated tensor's bytes to its arena.
func (t *Tensor) Free() error {
	if !t.owned {
		return fmt.Errorf("tensor at offset %d was not allocated by this process; free its allocation instead", t.desc.Offset)
	}
	t.owned = false
	return t.arena.Free(t.desc.Offset)
}

// ref is how tensors appear inside job arguments and results.
type ref struct {
	Tensor *Descriptor `json:"__tensor__"`
}

// MarshalJSON writes the tensor as a reference: {"__tensor__": descriptor}.
func (t *Tensor) MarshalJSON() ([]byte, error) { return json.Marshal(ref{&t.desc}) }

// Ref is a tensor reference decoded from a worker's result; resolve it with
// Arena.Tensor (which validates it) before touching memory.
type Ref struct{ Desc Descriptor }

func (r *Ref) UnmarshalJSON(b []byte) error {
	var v ref
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	if v.Tensor == nil {
		return fmt.Errorf("not a tensor reference: %.100s", b)
	}
	r.Desc = *v.Tensor
	return nil
}

// view returns the tensor's elements as a []T in place. It needs a contiguous
// tensor of one of the given dtypes.
func view[T any](t *Tensor, dts ...DType) ([]T, error) {
	ok := false
	for _, dt := range dts {
		ok = ok || t.desc.DType == dt
	}
	if !ok {
		return nil, fmt.Errorf("tensor is %s, not %s", t.desc.DType, dts[0])
	}
	if !t.desc.Contiguous() {
		return nil, fmt.Errorf("tensor with strides %v is not contiguous", t.desc.Strides)
	}
	b := t.Bytes()
	n := t.desc.NumElements()
	if n == 0 {
		return []T{}, nil
	}
	return unsafe.Slice((*T)(unsafe.Pointer(&b[0])), n), nil
}

func (t *Tensor) Float32() ([]float32, error) { return view[float32](t, Float32) }
func (t *Tensor) Float64() ([]float64, error) { return view[float64](t, Float64) }

// Float16 returns raw IEEE half-precision bits; see HalfToFloat32.
func (t *Tensor) Float16() ([]uint16, error) { return view[uint16](t, Float16) }

// BFloat16 returns raw bfloat16 bits; see BFloat16ToFloat32.
func (t *Tensor) BFloat16() ([]uint16, error) { return view[uint16](t, BFloat16) }
func (t *Tensor) Int8() ([]int8, error)       { return view[int8](t, Int8) }
func (t *Tensor) UInt8() ([]uint8, error)     { return view[uint8](t, UInt8, Bool) }
func (t *Tensor) Int16() ([]int16, error)     { return view[int16](t, Int16) }
func (t *Tensor) Int32() ([]int32, error)     { return view[int32](t, Int32) }
func (t *Tensor) Int64() ([]int64, error)     { return view[int64](t, Int64) }

// Region is a byte range of an arena lent to a worker for one job's output
// tensors (kernels_py.runtime.arena.empty allocates from it).
type Region struct {
	Arena  uint32 `json:"arena"`
	Offset int64  `json:"offset"`
	Size   int64  `json:"size"`
}

// Float64s copies a contiguous tensor of any dtype out as float64s (half
// types widened, integers converted), for checks and small reports.
func (t *Tensor) Float64s() ([]float64, error) {
	var out []float64
	err := t.elements(func(get func(int) float64, _ func(int, float64)) {
		// Sized only once the tensor is known contiguous, so its elements
		// fit the arena: a worker's descriptor with zero strides names
		// more elements than any memory holds.
		out = make([]float64, t.desc.NumElements())
		for i := range out {
			out[i] = get(i)
		}
	})
	return out, err
}

// SetFloat64s writes values into a contiguous tensor of any dtype, rounding
// to its precision (half types round to nearest even; integers truncate).
func (t *Tensor) SetFloat64s(values []float64) error {
	if int64(len(values)) != t.desc.NumElements() {
		return fmt.Errorf("%d values for a tensor of %d elements", len(values), t.desc.NumElements())
	}
	return t.elements(func(_ func(int) float64, set func(int, float64)) {
		for i, v := range values {
			set(i, v)
		}
	})
}

// elements hands fn a getter and a setter over the tensor's elements.
func (t *Tensor) elements(fn func(get func(int) float64, set func(int, float64))) error {
	switch t.desc.DType {
	case Float64:
		return elementsOf(t, Float64, func(v float64) float64 { return v }, func(f float64) float64 { return f }, fn)
	case Float32:
		return elementsOf(t, Float32, func(v float32) float64 { return float64(v) }, func(f float64) float32 { return float32(f) }, fn)
	case Float16:
		return elementsOf(t, Float16, func(v uint16) float64 { return float64(HalfToFloat32(v)) }, func(f float64) uint16 { return Float32ToHalf(float32(f)) }, fn)
	case BFloat16:
		return elementsOf(t, BFloat16, func(v uint16) float64 { return float64(BFloat16ToFloat32(v)) }, func(f float64) uint16 { return Float32ToBFloat16(float32(f)) }, fn)
	case Int8:
		return elementsOf(t, Int8, func(v int8) float64 { return float64(v) }, func(f float64) int8 { return int8(f) }, fn)
	case Int16:
		return elementsOf(t, Int16, func(v int16) float64 { return float64(v) }, func(f float64) int16 { return int16(f) }, fn)
	case Int32:
		return elementsOf(t, Int32, func(v int32) float64 { return float64(v) }, func(f float64) int32 { return int32(f) }, fn)
	case Int64:
		return elementsOf(t, Int64, func(v int64) float64 { return float64(v) }, func(f float64) int64 { return int64(f) }, fn)
	case UInt8, Bool:
		return elementsOf(t, t.desc.DType, func(v uint8) float64 { return float64(v) }, func(f float64) uint8 { return uint8(f) }, fn)
	}
	return fmt.Errorf("no element access for %s", t.desc.DType)
}

func elementsOf[T any](t *Tensor, dt DType, get func(T) float64, set func(float64) T, fn func(func(int) float64, func(int, float64))) error {
	v, err := view[T](t, dt)
	if err != nil {
		return err
	}
	fn(func(i int) float64 { return get(v[i]) }, func(i int, f float64) { v[i] = set(f) })
	return nil
}
