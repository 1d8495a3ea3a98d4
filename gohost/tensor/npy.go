package tensor

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net/url"
	"strconv"
	"strings"
)

const npyMagic = "\x93NUMPY"

// maxNPYHeader bounds the header ReadNPYHeader accepts. numpy itself refuses
// headers over 10000 bytes unless told otherwise; ours are under 500.
const maxNPYHeader = 1 << 20

// npyDescrs are numpy's little-endian type strings; single bytes have no
// byte order, which numpy writes as '|'.
var npyDescrs = []struct {
	dt    DType
	descr string
}{
	{Float64, "<f8"}, {Float32, "<f4"}, {Float16, "<f2"},
	{Int64, "<i8"}, {Int32, "<i4"}, {Int16, "<i2"}, {Int8, "|i1"}, {UInt8, "|u1"}, {Bool, "|b1"},
}

// WriteNPYWidened writes t as WriteNPY does, but a bfloat16 tensor widened
// to float32 (numpy has no bfloat16; its values are exact in float32), in an
// arena of its own that is gone once written: widening beside the tensor's
// own arena would take twice its size there again.
func WriteNPYWidened(path string, t *Tensor) error {
	if t.DType() != BFloat16 {
		return WriteNPY(path, t)
	}
	// Checked here, as writeNPY does, so the error names the file and what to do.
	if d := t.Desc(); !d.Contiguous() {
		return fmt.Errorf("write npy %s: shape %v with strides %v is not contiguous; copy it into a contiguous tensor first", path, d.Shape, d.Strides)
	}
	values, err := t.Float64s()
	if err != nil {
		return fmt.Errorf("write npy %s: %w", path, err)
	}
	ar, err := NewArena(2, "npy-float32", max(1, 2*int64(len(t.Bytes()))))
	if err != nil {
		return fmt.Errorf("write npy %s: %w", path, err)
	}
	defer ar.Close()
	out, err := ar.NewTensor(Float32, t.Shape()...)
	if err != nil {
		return fmt.Errorf("write npy %s: %w", path, err)
	}
	if err := out.SetFloat64s(values); err != nil {
		return fmt.Errorf("write npy %s: %w", path, err)
	}
	return WriteNPY(path, out)
}

func npyDescr(dt DType) (string, error) {
	if dt == BFloat16 {
		// Writing the raw bits as '<u2' would load in numpy as integers that
		// look like data; better to fail than to hand over wrong numbers.
		return "", errors.New("bfloat16 has no numpy dtype; write it with WriteNPYWidened (as float32)")
	}
	for _, d := range npyDescrs {
		if d.dt == dt {
			return d.descr, nil
		}
	}
	return "", fmt.Errorf("%s has no numpy dtype", dt)
}

// NPYName is the file name a tensor called name is saved under: name with
// every byte other than letters, digits, '_' and '-' (and '.' past the first
// character) written as %XX, plus ".npy". Distinct names give distinct files
// (so "a/b" and "a_b" do not collide), NameFromNPY reverses it, and no name
// can reach outside the directory it is written to. The empty name is "%".
// A name whose escaped form would pass the file-name limit keeps its first
// part and ends in "~" and a hash of the whole name: still distinct, no
// longer reversible (a map from names to files must say which it is).
func NPYName(name string) string {
	if name == "" {
		return "%.npy"
	}
	escaped := escapeName(name)
	if len(escaped) <= maxNameBytes {
		return escaped + ".npy"
	}
	cut := maxNameBytes - 17 // "~" and 16 hex digits
	for cut > 0 && strings.LastIndexByte(escaped[:cut], '%') >= cut-2 {
		cut-- // never split a %XX
	}
	sum := sha256.Sum256([]byte(name))
	return escaped[:cut] + "~" + hex.EncodeToString(sum[:8]) + ".npy"
}

// maxNameBytes leaves room for ".npy" in the 255 bytes most file systems
// allow a name.
const maxNameBytes = 255 - len(".npy")

func escapeName(name string) string {
	var b strings.Builder
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c == '_' || c == '-' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '.' && i > 0 {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// NameFromNPY is the tensor name NPYName gave file for.
func NameFromNPY(file string) (string, error) {
	base, ok := strings.CutSuffix(file, ".npy")
	if !ok {
		return "", fmt.Errorf("%s: not a .npy file name", file)
	}
	if base == "%" {
		return "", nil
	}
	name, err := url.PathUnescape(base)
	if err != nil || NPYName(name) != file {
		return "", fmt.Errorf("%s: not a file name NPYName writes", file)
	}
	return name, nil
}

// WriteNPY writes a contiguous tensor to path in NPY format version 1.0, the
// format numpy.load reads. The file appears at path only once whole.
func WriteNPY(path string, t *Tensor) error {
	if err := writeNPY(path, t); err != nil {
		return fmt.Errorf("write npy %s: %w", path, err)
	}
	return nil
}

func writeNPY(path string, t *Tensor) error {
	d := t.Desc()
	descr, err := npyDescr(d.DType)
	if err != nil {
		return err
	}
	if !d.Contiguous() {
		return fmt.Errorf("shape %v with strides %v is not contiguous; copy it into a contiguous tensor first", d.Shape, d.Strides)
	}
	preamble, err := npyPreamble(descr, d.Shape)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, func(w io.Writer) error {
		if _, err := w.Write(preamble); err != nil {
			return err
		}
		_, err := w.Write(t.Bytes())
		return err
	})
}

// npyPreamble is the magic, version 1.0, header length and header dict, padded
// with spaces and ended by a newline so that the data starts at a multiple of
// 64 bytes, as numpy writes it (and as memory-mapping readers want it).
func npyPreamble(descr string, shape []int64) ([]byte, error) {
	dims := make([]string, len(shape))
	for i, n := range shape {
		dims[i] = strconv.FormatInt(n, 10)
	}
	tuple := "(" + strings.Join(dims, ", ") + ")"
	if len(shape) == 1 {
		tuple = "(" + dims[0] + ",)" // Python's one-element tuple
	}
	dict := fmt.Sprintf("{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr, tuple)
	const fixed = len(npyMagic) + 2 + 2 // magic, version, uint16 header length
	total := (fixed + len(dict) + 1 + 63) / 64 * 64
	if total-fixed > math.MaxUint16 {
		return nil, fmt.Errorf("header of %d bytes does not fit NPY version 1.0", total-fixed)
	}
	b := make([]byte, 0, total)
	b = append(b, npyMagic...)
	b = append(b, 1, 0)
	b = binary.LittleEndian.AppendUint16(b, uint16(total-fixed))
	b = append(b, dict...)
	for len(b) < total-1 {
		b = append(b, ' ')
	}
	return append(b, '\n'), nil
}

// ReadNPYHeader reads an NPY preamble (versions 1.0 and 2.0) and returns the
// dtype string and shape; r is left at the start of the data. Fortran-order
// arrays are an error, since their data is not laid out row-major.
func ReadNPYHeader(r io.Reader) (descr string, shape []int64, err error) {
	descr, shape, err = readNPYHeader(r)
	if err != nil {
		return "", nil, fmt.Errorf("npy header: %w", err)
	}
	return descr, shape, nil
}

func readNPYHeader(r io.Reader) (string, []int64, error) {
	var pre [8]byte
	if _, err := io.ReadFull(r, pre[:]); err != nil {
		return "", nil, fmt.Errorf("reading the magic: %w", err)
	}
	if string(pre[:6]) != npyMagic {
		return "", nil, fmt.Errorf("bad magic %q, not an NPY file", pre[:6])
	}
	var n uint64
	switch pre[6] {
	case 1:
		var b [2]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return "", nil, fmt.Errorf("reading the header length: %w", err)
		}
		n = uint64(binary.LittleEndian.Uint16(b[:]))
	case 2:
		var b [4]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return "", nil, fmt.Errorf("reading the header length: %w", err)
		}
		n = uint64(binary.LittleEndian.Uint32(b[:]))
	default:
		return "", nil, fmt.Errorf("unsupported version %d.%d (want 1.0 or 2.0)", pre[6], pre[7])
	}
	if n > maxNPYHeader {
		return "", nil, fmt.Errorf("header length %d exceeds %d", n, maxNPYHeader)
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r, buf); err != nil {
		return "", nil, fmt.Errorf("reading the %d-byte header: %w", n, err)
	}
	if n == 0 || buf[n-1] != '\n' {
		return "", nil, errors.New("header does not end in a newline")
	}
	return parseNPYDict(string(buf))
}

// parseNPYDict parses the Python dict literal of an NPY header: string keys,
// and values that are strings, True/False or tuples of integers.
func parseNPYDict(s string) (string, []int64, error) {
	p := &npyParser{s: s}
	if !p.consume('{') {
		return "", nil, fmt.Errorf("header %q is not a dict", s)
	}
	var descr string
	var shape []int64
	fortran := false
	seen := map[string]bool{}
	for !p.consume('}') {
		key, err := p.str()
		if err != nil {
			return "", nil, err
		}
		if !p.consume(':') {
			return "", nil, fmt.Errorf("no ':' after key %q", key)
		}
		switch key {
		case "descr":
			descr, err = p.str()
		case "fortran_order":
			fortran, err = p.boolean()
		case "shape":
			shape, err = p.tuple()
		default:
			return "", nil, fmt.Errorf("unknown key %q", key)
		}
		if err != nil {
			return "", nil, fmt.Errorf("%s: %w", key, err)
		}
		seen[key] = true
		if !p.consume(',') && !p.peek('}') {
			return "", nil, fmt.Errorf("expected ',' or '}' at byte %d of %q", p.pos, s)
		}
	}
	if p.space(); p.pos != len(s) {
		return "", nil, fmt.Errorf("%q after the dict", s[p.pos:])
	}
	for _, k := range []string{"descr", "fortran_order", "shape"} {
		if !seen[k] {
			return "", nil, fmt.Errorf("missing %s", k)
		}
	}
	if fortran {
		return "", nil, errors.New("fortran_order True is not supported")
	}
	return descr, shape, nil
}

type npyParser struct {
	s   string
	pos int
}

func (p *npyParser) space() {
	for p.pos < len(p.s) && strings.IndexByte(" \t\r\n", p.s[p.pos]) >= 0 {
		p.pos++
	}
}

func (p *npyParser) peek(c byte) bool {
	p.space()
	return p.pos < len(p.s) && p.s[p.pos] == c
}

func (p *npyParser) consume(c byte) bool {
	if p.peek(c) {
		p.pos++
		return true
	}
	return false
}

// str reads a quoted string. NPY headers hold no escapes.
func (p *npyParser) str() (string, error) {
	p.space()
	if p.pos >= len(p.s) || p.s[p.pos] != '\'' && p.s[p.pos] != '"' {
		return "", fmt.Errorf("expected a string at byte %d", p.pos)
	}
	q := p.s[p.pos]
	end := strings.IndexByte(p.s[p.pos+1:], q)
	if end < 0 {
		return "", fmt.Errorf("unterminated string at byte %d", p.pos)
	}
	v := p.s[p.pos+1 : p.pos+1+end]
	p.pos += end + 2
	return v, nil
}

func (p *npyParser) boolean() (bool, error) {
	p.space()
	for _, w := range []string{"True", "False"} {
		if strings.HasPrefix(p.s[p.pos:], w) {
			p.pos += len(w)
			return w == "True", nil
		}
	}
	return false, fmt.Errorf("expected True or False at byte %d", p.pos)
}

// tuple reads a tuple of non-negative integers: (), (n,) or (a, b, ...).
func (p *npyParser) tuple() ([]int64, error) {
	if !p.consume('(') {
		return nil, fmt.Errorf("expected a tuple at byte %d", p.pos)
	}
	shape := []int64{}
	for !p.consume(')') {
		start := p.pos
		for p.pos < len(p.s) && '0' <= p.s[p.pos] && p.s[p.pos] <= '9' {
			p.pos++
		}
		n, err := strconv.ParseInt(p.s[start:p.pos], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("expected a non-negative integer at byte %d", start)
		}
		shape = append(shape, n)
		if !p.consume(',') && !p.peek(')') {
			return nil, fmt.Errorf("expected ',' or ')' at byte %d", p.pos)
		}
	}
	return shape, nil
}
