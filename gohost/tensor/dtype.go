// Package tensor holds tensors the DLPack way (dtype code/bits/lanes, shape,
// strides in elements, byte offset, device) on shared-memory arenas that Go
// allocates and Python workers map, so kernels read and write them in place.
package tensor

import (
	"fmt"
	"strings"
)

// DTypeCode is DLPack's DLDataTypeCode.
type DTypeCode uint8

const (
	CodeInt    DTypeCode = 0
	CodeUInt   DTypeCode = 1
	CodeFloat  DTypeCode = 2
	CodeBFloat DTypeCode = 4
	CodeBool   DTypeCode = 6
)

// DType is DLPack's DLDataType.
type DType struct {
	Code  DTypeCode `json:"code"`
	Bits  uint8     `json:"bits"`
	Lanes uint16    `json:"lanes"`
}

var (
	Float64  = DType{CodeFloat, 64, 1}
	Float32  = DType{CodeFloat, 32, 1}
	Float16  = DType{CodeFloat, 16, 1}
	BFloat16 = DType{CodeBFloat, 16, 1}
	Int8     = DType{CodeInt, 8, 1}
	Int16    = DType{CodeInt, 16, 1}
	Int32    = DType{CodeInt, 32, 1}
	Int64    = DType{CodeInt, 64, 1}
	UInt8    = DType{CodeUInt, 8, 1}
	Bool     = DType{CodeBool, 8, 1}
)

// names are the dtypes both sides know, by their torch/numpy names.
var names = []struct {
	name string
	dt   DType
}{
	{"float64", Float64}, {"float32", Float32}, {"float16", Float16}, {"bfloat16", BFloat16},
	{"int8", Int8}, {"int16", Int16}, {"int32", Int32}, {"int64", Int64}, {"uint8", UInt8}, {"bool", Bool},
}

// ParseDType accepts a name such as "float32" or "bfloat16".
func ParseDType(name string) (DType, error) {
	for _, n := range names {
		if n.name == name {
			return n.dt, nil
		}
	}
	known := make([]string, len(names))
	for i, n := range names {
		known[i] = n.name
	}
	return DType{}, fmt.Errorf("unknown dtype %q (known: %s)", name, strings.Join(known, ", "))
}

// Valid reports whether d is one of the dtypes the workbench exchanges.
func (d DType) Valid() error {
	for _, n := range names {
		if n.dt == d {
			return nil
		}
	}
	return fmt.Errorf("unsupported dtype (code %d, bits %d, lanes %d)", d.Code, d.Bits, d.Lanes)
}

// Size is the number of bytes of one element.
func (d DType) Size() int64 { return int64(d.Bits) / 8 * int64(d.Lanes) }

func (d DType) String() string {
	for _, n := range names {
		if n.dt == d {
			return n.name
		}
	}
	return fmt.Sprintf("dtype(code=%d,bits=%d,lanes=%d)", d.Code, d.Bits, d.Lanes)
}

// Device is DLPack's DLDevice. Arenas live in host memory: CPU, id 0.
type Device struct {
	Type int32 `json:"type"`
	ID   int32 `json:"id"`
}

// CPU is kDLCPU.
var CPU = Device{Type: 1, ID: 0}
