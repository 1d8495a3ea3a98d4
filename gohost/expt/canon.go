package expt

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"
)

// The canonical JSON form is byte-for-byte what Python writes with
//
//	json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
//
// so that the worker, a notebook or a shell one-liner can recompute a job id
// without Go. In particular floats are written the way Python's repr writes
// them (always with a "." or an exponent, so 1.0 never reads back as an int)
// and ints as plain integers.

// appendCanonical appends the canonical JSON of v. It accepts the values
// jobs hold (bool, string, Go ints and floats) and map[string]any / []any of
// them; anything else is a programming error and panics.
func appendCanonical(b []byte, v any) []byte {
	switch x := v.(type) {
	case nil:
		return append(b, "null"...)
	case bool:
		return strconv.AppendBool(b, x)
	case string:
		return appendString(b, x)
	case int:
		return strconv.AppendInt(b, int64(x), 10)
	case int8:
		return strconv.AppendInt(b, int64(x), 10)
	case int16:
		return strconv.AppendInt(b, int64(x), 10)
	case int32:
		return strconv.AppendInt(b, int64(x), 10)
	case int64:
		return strconv.AppendInt(b, x, 10)
	case uint:
		return strconv.AppendUint(b, uint64(x), 10)
	case uint8:
		return strconv.AppendUint(b, uint64(x), 10)
	case uint16:
		return strconv.AppendUint(b, uint64(x), 10)
	case uint32:
		return strconv.AppendUint(b, uint64(x), 10)
	case uint64:
		return strconv.AppendUint(b, x, 10)
	case float32:
		return appendFloat(b, float64(x))
	case float64:
		return appendFloat(b, x)
	case map[string]any:
		b = append(b, '{')
		for i, k := range sortedKeys(x) {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendString(b, k)
			b = append(b, ':')
			b = appendCanonical(b, x[k])
		}
		return append(b, '}')
	case []any:
		b = append(b, '[')
		for i, e := range x {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendCanonical(b, e)
		}
		return append(b, ']')
	}
	panic(fmt.Sprintf("expt: canonical JSON: unsupported value of type %T", v))
}

// appendFloat writes f as Python's repr(float) does: the shortest digits
// that round-trip, fixed notation for exponents in [-4, 16), scientific
// otherwise, and ".0" added to integral values.
func appendFloat(b []byte, f float64) []byte {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		// JSON has no spelling for these and check never lets one through.
		panic(fmt.Sprintf("expt: canonical JSON: non-finite float %v", f))
	}
	if f == 0 {
		if math.Signbit(f) {
			return append(b, "-0.0"...)
		}
		return append(b, "0.0"...)
	}
	// Shortest round-trip digits, e.g. "-1.2345e+06".
	s := strconv.FormatFloat(f, 'e', -1, 64)
	mant, expStr, _ := strings.Cut(s, "e")
	exp, _ := strconv.Atoi(expStr)
	if exp < -4 || exp >= 16 {
		return append(b, s...) // Go and Python agree here: "1e+16", "1.5e-07"
	}
	if mant[0] == '-' {
		b = append(b, '-')
		mant = mant[1:]
	}
	digits := strings.Replace(mant, ".", "", 1)
	switch {
	case exp < 0:
		b = append(b, "0."...)
		for range -exp - 1 {
			b = append(b, '0')
		}
		b = append(b, digits...)
	case len(digits) > exp+1:
		b = append(b, digits[:exp+1]...)
		b = append(b, '.')
		b = append(b, digits[exp+1:]...)
	default:
		b = append(b, digits...)
		for range exp + 1 - len(digits) {
			b = append(b, '0')
		}
		b = append(b, ".0"...)
	}
	return b
}

// appendString escapes like Python's json with ensure_ascii=False: only the
// quote, the backslash and control characters below U+0020.
func appendString(b []byte, s string) []byte {
	if !utf8.ValidString(s) {
		panic(fmt.Sprintf("expt: canonical JSON: string %q is not valid UTF-8", s))
	}
	const hexDigits = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch c {
		case '"':
			b = append(b, `\"`...)
		case '\\':
			b = append(b, `\\`...)
		case '\n':
			b = append(b, `\n`...)
		case '\r':
			b = append(b, `\r`...)
		case '\t':
			b = append(b, `\t`...)
		case '\b':
			b = append(b, `\b`...)
		case '\f':
			b = append(b, `\f`...)
		default:
			if c < 0x20 {
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			} else {
				b = append(b, c)
			}
		}
	}
	return append(b, '"')
}

// CanonicalJSON returns the canonical JSON of the job's identity: the object
// {"experiment", "method", "params", "workload"}, plus "workload_name" for a
// job on a workload other than the synthetic one. Jobs were identified by that
// object before workloads had names, all of them on the synthetic workload, so
// leaving the name out for it keeps their ids (and resumable runs) unchanged.
// The timeout is left out on purpose: giving a slow job more time must not
// make it a different job (and so must not lose its finished result on resume).
// So are the knobs j.OutOfID names: knobs added after jobs existed without
// them, at their defaults, so those jobs keep their ids.
func (j Job) CanonicalJSON() []byte {
	params, workload := j.Params, j.Workload
	if len(j.OutOfID) > 0 {
		params, workload = maps.Clone(params), maps.Clone(workload)
		for _, key := range j.OutOfID {
			if k, ok := strings.CutPrefix(key, "params."); ok {
				delete(params, k)
			} else if k, ok := strings.CutPrefix(key, "workload."); ok {
				delete(workload, k)
			}
		}
	}
	if params == nil {
		params = map[string]any{} // "{}", not "null": no params is still a complete set
	}
	if workload == nil {
		workload = map[string]any{}
	}
	identity := map[string]any{
		"experiment": j.Experiment,
		"method":     j.Method,
		"params":     params,
		"workload":   workload,
	}
	if j.WorkloadName != "" && j.WorkloadName != unnamedWorkload {
		identity["workload_name"] = j.WorkloadName
	}
	return appendCanonical(nil, identity)
}

// unnamedWorkload is the workload of every job whose id has no workload_name.
const unnamedWorkload = "synthetic"

// ComputeID returns the id the job's contents imply: the first 16 hex digits
// of the SHA-256 of CanonicalJSON. Load sets Job.ID to this; other packages
// can use it to check a job read back from a journal.
func (j Job) ComputeID() string {
	sum := sha256.Sum256(j.CanonicalJSON())
	return hex.EncodeToString(sum[:8])
}
