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
// tensors (kernels_py.arena.empty allocates from it).
type Region struct {
	Arena  uint32 `json:"arena"`
	Offset int64  `json:"offset"`
	Size   int64  `json:"size"`
}
