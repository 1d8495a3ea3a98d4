package tensor

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
)

// MaxDims bounds a descriptor's rank; nothing the workbench handles comes close.
const MaxDims = 16

// Descriptor locates a tensor in an arena. Data starts at Offset+ByteOffset
// bytes into the arena (DLPack's data pointer is the arena base plus Offset,
// and ByteOffset is its byte_offset); Strides are in elements.
type Descriptor struct {
	Arena      uint32  `json:"arena"`
	Offset     int64   `json:"offset"`
	ByteOffset int64   `json:"byte_offset"`
	DType      DType   `json:"dtype"`
	Shape      []int64 `json:"shape"`
	Strides    []int64 `json:"strides"`
	Device     Device  `json:"device"`
}

// ContiguousStrides are the row-major strides of shape, in elements.
func ContiguousStrides(shape []int64) []int64 {
	strides := make([]int64, len(shape))
	step := int64(1)
	for i := len(shape) - 1; i >= 0; i-- {
		strides[i] = step
		step *= shape[i]
	}
	return strides
}

// NumElements is the product of the shape (1 for a scalar).
func (d Descriptor) NumElements() int64 {
	n := int64(1)
	for _, s := range d.Shape {
		n *= s
	}
	return n
}

// Contiguous reports whether the tensor is laid out row-major without gaps.
func (d Descriptor) Contiguous() bool {
	want := ContiguousStrides(d.Shape)
	for i := range d.Shape {
		if d.Shape[i] > 1 && d.Strides[i] != want[i] {
			return false
		}
	}
	return true
}

var errOverflow = errors.New("size overflows int64")

// Span returns the byte range [start, end) of the arena the tensor touches,
// checking every field on the way: a known dtype, a CPU device, rank within
// MaxDims, non-negative sizes, strides and offsets, and no overflow.
func (d Descriptor) Span() (start, end int64, err error) {
	if err := d.DType.Valid(); err != nil {
		return 0, 0, err
	}
	if d.Device != CPU {
		return 0, 0, fmt.Errorf("device (type %d, id %d) is not the CPU; arenas live in host memory", d.Device.Type, d.Device.ID)
	}
	if len(d.Shape) > MaxDims {
		return 0, 0, fmt.Errorf("rank %d exceeds %d", len(d.Shape), MaxDims)
	}
	if len(d.Strides) != len(d.Shape) {
		return 0, 0, fmt.Errorf("%d strides for %d dimensions", len(d.Strides), len(d.Shape))
	}
	if d.Offset < 0 || d.ByteOffset < 0 {
		return 0, 0, fmt.Errorf("negative offset (offset %d, byte_offset %d)", d.Offset, d.ByteOffset)
	}
	start, ok := add(d.Offset, d.ByteOffset)
	if !ok {
		return 0, 0, errOverflow
	}
	elem := d.DType.Size()
	if start%elem != 0 {
		return 0, 0, fmt.Errorf("data at byte %d is not aligned to its %d-byte elements", start, elem)
	}
	empty := false
	last := int64(0) // element index of the last element, relative to start
	count := int64(1)
	for i, n := range d.Shape {
		if n < 0 {
			return 0, 0, fmt.Errorf("negative size %d in dimension %d", n, i)
		}
		if d.Strides[i] < 0 {
			return 0, 0, fmt.Errorf("negative stride %d in dimension %d", d.Strides[i], i)
		}
		if n == 0 {
			empty = true
			continue
		}
		// Zero strides let a shape name more elements than the bytes it
		// spans; their count must still be an int64 (NumElements).
		var ok bool
		if count, ok = mul(count, n); !ok {
			return 0, 0, fmt.Errorf("shape %v: element count %w", d.Shape, errOverflow)
		}
		step, ok := mul(n-1, d.Strides[i])
		if !ok {
			return 0, 0, errOverflow
		}
		if last, ok = add(last, step); !ok {
			return 0, 0, errOverflow
		}
	}
	if empty {
		return start, start, nil
	}
	extent, ok := mul(last+1, elem)
	if !ok {
		return 0, 0, errOverflow
	}
	end, ok = add(start, extent)
	if !ok {
		return 0, 0, errOverflow
	}
	return start, end, nil
}

// Validate checks the descriptor against an arena of the given size.
func (d Descriptor) Validate(arenaSize int64) error {
	start, end, err := d.Span()
	if err != nil {
		return fmt.Errorf("tensor descriptor: %w", err)
	}
	if end > arenaSize || start > arenaSize {
		return fmt.Errorf("tensor descriptor: bytes [%d, %d) fall outside arena %d of %d bytes", start, end, d.Arena, arenaSize)
	}
	return nil
}

func add(a, b int64) (int64, bool) {
	s := a + b
	return s, s >= a && s >= 0
}

func mul(a, b int64) (int64, bool) {
	if a < 0 || b < 0 {
		return 0, false
	}
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi != 0 || lo > math.MaxInt64 {
		return 0, false
	}
	return int64(lo), true
}
