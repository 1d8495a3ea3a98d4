package tensor

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// MaxSafetensorsHeader bounds the JSON header, as the reference implementation
// does: a longer one is corruption, not a model.
const MaxSafetensorsHeader = 100 << 20

// SafetensorsEntry is one tensor of a safetensors file. Begin and End are byte
// offsets into the data section, which starts DataStart bytes into the file.
type SafetensorsEntry struct {
	Name       string
	DType      DType
	Shape      []int64
	Begin, End int64
}

// SafetensorsHeader is a checked safetensors header: every entry's bytes lie
// inside the file and no two entries share a byte.
type SafetensorsHeader struct {
	Entries   []SafetensorsEntry // sorted by Begin, then Name
	Metadata  map[string]string  // nil when the file has none
	DataStart int64
}

// safetensorsDTypes are the safetensors names of the dtypes the workbench
// exchanges; the format has others (U16, F8_E4M3, ...) that arenas cannot hold.
var safetensorsDTypes = []struct {
	name string
	dt   DType
}{
	{"F64", Float64}, {"F32", Float32}, {"F16", Float16}, {"BF16", BFloat16},
	{"I64", Int64}, {"I32", Int32}, {"I16", Int16}, {"I8", Int8}, {"U8", UInt8}, {"BOOL", Bool},
}

func safetensorsDType(name string) (DType, error) {
	for _, s := range safetensorsDTypes {
		if s.name == name {
			return s.dt, nil
		}
	}
	known := make([]string, len(safetensorsDTypes))
	for i, s := range safetensorsDTypes {
		known[i] = s.name
	}
	return DType{}, fmt.Errorf("unsupported dtype %q (supported: %s)", name, strings.Join(known, ", "))
}

func safetensorsName(dt DType) (string, error) {
	for _, s := range safetensorsDTypes {
		if s.dt == dt {
			return s.name, nil
		}
	}
	return "", fmt.Errorf("%s has no safetensors dtype", dt)
}

// ParseSafetensorsHeader reads the header of a safetensors file of fileSize
// bytes from r, which must be at the start of the file. It checks the header
// against the file size, so a caller may read every entry's bytes without
// further bounds checks.
func ParseSafetensorsHeader(r io.Reader, fileSize int64) (*SafetensorsHeader, error) {
	h, err := parseSafetensorsHeader(r, fileSize)
	if err != nil {
		return nil, fmt.Errorf("safetensors header: %w", err)
	}
	return h, nil
}

func parseSafetensorsHeader(r io.Reader, fileSize int64) (*SafetensorsHeader, error) {
	n, err := readSafetensorsHeaderLen(r, fileSize)
	if err != nil {
		return nil, err
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r, buf); err != nil {
		return nil, fmt.Errorf("reading the %d-byte header: %w", n, err)
	}
	// encoding/json would quietly turn invalid UTF-8 into U+FFFD, renaming tensors.
	if !utf8.Valid(buf) {
		return nil, errors.New("header is not valid UTF-8")
	}
	members, err := jsonObject(buf)
	if err != nil {
		return nil, err
	}
	h := &SafetensorsHeader{DataStart: 8 + n}
	for _, m := range members {
		if m.key == "__metadata__" {
			if h.Metadata, err = parseSafetensorsMetadata(m.value); err != nil {
				return nil, fmt.Errorf("__metadata__: %w", err)
			}
			continue
		}
		e, err := parseSafetensorsEntry(m.key, m.value, fileSize-h.DataStart)
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", m.key, err)
		}
		h.Entries = append(h.Entries, e)
	}
	sort.Slice(h.Entries, func(i, j int) bool {
		a, b := h.Entries[i], h.Entries[j]
		return a.Begin < b.Begin || a.Begin == b.Begin && a.Name < b.Name
	})
	if err := checkDisjoint(h.Entries); err != nil {
		return nil, err
	}
	return h, nil
}

// readSafetensorsHeaderLen reads and checks the 8-byte little-endian header length.
func readSafetensorsHeaderLen(r io.Reader, fileSize int64) (int64, error) {
	if fileSize < 8 {
		return 0, fmt.Errorf("truncated: the file has %d bytes, fewer than the 8-byte header length", fileSize)
	}
	var b [8]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return 0, fmt.Errorf("reading the header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(b[:])
	// A file of text (a script, JSON, a config) reads as an absurd length: say what it is instead.
	text := ""
	if n > MaxSafetensorsHeader || 8+int64(n) > fileSize {
		if isText(b[:]) {
			text = fmt.Sprintf(": it starts with the text %q, not a header length: not a .safetensors file", b[:])
		}
	}
	switch {
	case n == 0:
		return 0, errors.New("header length is 0; even an empty header is the 2 bytes {}")
	case n > MaxSafetensorsHeader:
		return 0, fmt.Errorf("header length %d exceeds the %d-byte limit%s", n, MaxSafetensorsHeader, text)
	case 8+int64(n) > fileSize:
		return 0, fmt.Errorf("truncated: header length %d needs %d bytes but the file has %d%s", n, 8+n, fileSize, text)
	}
	return int64(n), nil
}

// isText says whether b is printable ASCII or whitespace.
func isText(b []byte) bool {
	for _, c := range b {
		if (c < 0x20 || c > 0x7e) && c != '\n' && c != '\r' && c != '\t' {
			return false
		}
	}
	return true
}

// parseSafetensorsEntry checks one tensor's entry against the dataSize bytes
// that follow the header.
func parseSafetensorsEntry(name string, raw json.RawMessage, dataSize int64) (SafetensorsEntry, error) {
	e := SafetensorsEntry{Name: name}
	members, err := jsonObject(raw)
	if err != nil {
		return e, err
	}
	var dtype string
	var offsets []int64
	seen := map[string]bool{}
	for _, m := range members {
		switch m.key {
		case "dtype":
			err = decodeField(m, &dtype)
		case "shape":
			err = decodeField(m, &e.Shape)
		case "data_offsets":
			err = decodeField(m, &offsets)
		default:
			// A field we do not know may change the meaning of the others.
			return e, fmt.Errorf("unknown field %q (an entry has dtype, shape and data_offsets)", m.key)
		}
		if err != nil {
			return e, err
		}
		seen[m.key] = true
	}
	for _, f := range []string{"dtype", "shape", "data_offsets"} {
		if !seen[f] {
			return e, fmt.Errorf("missing %s", f)
		}
	}
	if e.DType, err = safetensorsDType(dtype); err != nil {
		return e, err
	}
	nbytes, err := shapeBytes(e.Shape, e.DType)
	if err != nil {
		return e, err
	}
	if len(offsets) != 2 {
		return e, fmt.Errorf("data_offsets %v has %d values, want [begin, end]", offsets, len(offsets))
	}
	e.Begin, e.End = offsets[0], offsets[1]
	if e.Begin < 0 || e.End < e.Begin {
		return e, fmt.Errorf("data_offsets [%d, %d] do not satisfy 0 <= begin <= end", e.Begin, e.End)
	}
	if e.End-e.Begin != nbytes {
		return e, fmt.Errorf("data_offsets [%d, %d] span %d bytes but shape %v of %s needs %d",
			e.Begin, e.End, e.End-e.Begin, e.Shape, dtype, nbytes)
	}
	if e.End > dataSize {
		return e, fmt.Errorf("truncated: data [%d, %d) ends past the %d data bytes the file has", e.Begin, e.End, dataSize)
	}
	return e, nil
}

// shapeBytes is the byte size of a contiguous tensor of the given shape. It
// rejects shapes whose size overflows even when a zero dimension empties the
// tensor, since the arena computes strides from the other dimensions.
func shapeBytes(shape []int64, dt DType) (int64, error) {
	if len(shape) > MaxDims {
		return 0, fmt.Errorf("rank %d exceeds %d", len(shape), MaxDims)
	}
	extent, empty := dt.Size(), false
	for i, n := range shape {
		if n < 0 {
			return 0, fmt.Errorf("negative size %d in dimension %d of shape %v", n, i, shape)
		}
		if n == 0 {
			empty = true
			continue
		}
		var ok bool
		if extent, ok = mul(extent, n); !ok {
			return 0, fmt.Errorf("shape %v of %s: %w", shape, dt, errOverflow)
		}
	}
	if empty {
		return 0, nil
	}
	return extent, nil
}

// checkDisjoint reports two entries sharing bytes; entries are sorted by Begin.
func checkDisjoint(entries []SafetensorsEntry) error {
	// Sorted and disjoint so far, the last non-empty entry is the one that
	// ends furthest. Empty entries hold no bytes, so they overlap nothing.
	var last *SafetensorsEntry
	for i := range entries {
		e := &entries[i]
		if e.Begin == e.End {
			continue
		}
		if last != nil && e.Begin < last.End {
			return fmt.Errorf("tensors %q [%d, %d) and %q [%d, %d) overlap",
				last.Name, last.Begin, last.End, e.Name, e.Begin, e.End)
		}
		last = e
	}
	return nil
}

func parseSafetensorsMetadata(raw json.RawMessage) (map[string]string, error) {
	if string(raw) == "null" {
		return nil, nil
	}
	members, err := jsonObject(raw)
	if err != nil {
		return nil, err
	}
	md := make(map[string]string, len(members))
	for _, m := range members {
		var s string
		if err := decodeField(m, &s); err != nil {
			return nil, err
		}
		md[m.key] = s
	}
	return md, nil
}

type jsonMember struct {
	key   string
	value json.RawMessage
}

// jsonObject splits a JSON object into its members in order. Unlike decoding
// into a map, it rejects duplicate keys (which one wins is up to the reader)
// and anything after the object.
func jsonObject(data []byte) ([]jsonMember, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("not valid JSON: %w", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, fmt.Errorf("not a JSON object but %s", jsonKind(tok))
	}
	var members []jsonMember
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("not valid JSON: %w", err)
		}
		key, ok := tok.(string)
		if !ok {
			return nil, fmt.Errorf("not valid JSON: object key is %s", jsonKind(tok))
		}
		if seen[key] {
			return nil, fmt.Errorf("duplicate key %q", key)
		}
		seen[key] = true
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return nil, fmt.Errorf("not valid JSON: value of %q: %w", key, err)
		}
		members = append(members, jsonMember{key, value})
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return nil, fmt.Errorf("not valid JSON: %w", err)
	}
	if tok, err := dec.Token(); err != io.EOF {
		if err != nil {
			return nil, fmt.Errorf("not valid JSON after the object: %w", err)
		}
		return nil, fmt.Errorf("unexpected %s after the JSON object", jsonKind(tok))
	}
	return members, nil
}

func jsonKind(tok json.Token) string {
	switch v := tok.(type) {
	case json.Delim:
		if v == '[' {
			return "an array"
		}
		return "an object"
	case string:
		return "a string"
	case float64, json.Number:
		return "a number"
	case bool:
		return "a boolean"
	case nil:
		return "null"
	}
	return fmt.Sprintf("%v", tok)
}

// decodeField decodes one member's value, refusing null, which encoding/json
// would silently leave as the zero value.
func decodeField(m jsonMember, v any) error {
	if string(m.value) == "null" {
		return fmt.Errorf("%s is null", m.key)
	}
	if err := json.Unmarshal(m.value, v); err != nil {
		return fmt.Errorf("%s: %w", m.key, err)
	}
	return nil
}

// LoadSafetensors allocates one arena tensor per entry of the file at path and
// reads each tensor's bytes straight into the arena, with no staging buffer:
// weights are often a large part of memory. On error nothing stays allocated.
func LoadSafetensors(path string, a *Arena) (map[string]*Tensor, *SafetensorsHeader, error) {
	tensors, h, err := loadSafetensors(path, a)
	if err != nil {
		return nil, nil, fmt.Errorf("load %s: %w", path, err)
	}
	return tensors, h, nil
}

func loadSafetensors(path string, a *Arena) (_ map[string]*Tensor, _ *SafetensorsHeader, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, nil, fmt.Errorf("not a regular file (%s)", fi.Mode().Type())
	}
	h, err := ParseSafetensorsHeader(f, fi.Size())
	if err != nil {
		return nil, nil, err
	}
	tensors := make(map[string]*Tensor, len(h.Entries))
	defer func() {
		if err != nil {
			for _, t := range tensors {
				t.Free()
			}
		}
	}()
	// Entries are sorted by offset, so the file is read front to back.
	for _, e := range h.Entries {
		t, err := a.NewTensor(e.DType, e.Shape...)
		if err != nil {
			return nil, nil, fmt.Errorf("tensor %q: %w", e.Name, err)
		}
		tensors[e.Name] = t
		if _, err := f.ReadAt(t.Bytes(), h.DataStart+e.Begin); err != nil {
			return nil, nil, fmt.Errorf("tensor %q: reading %d bytes at %d: %w", e.Name, e.End-e.Begin, h.DataStart+e.Begin, err)
		}
	}
	return tensors, h, nil
}

// safetensorsJSONEntry is a tensor's header entry, fields in the order the
// reference implementation writes them.
type safetensorsJSONEntry struct {
	DType       string   `json:"dtype"`
	Shape       []int64  `json:"shape"`
	DataOffsets [2]int64 `json:"data_offsets"`
}

// WriteSafetensors writes contiguous tensors and optional metadata to path.
// Data is laid out in name order; the file appears at path only once whole.
func WriteSafetensors(path string, tensors map[string]*Tensor, metadata map[string]string) error {
	if err := writeSafetensors(path, tensors, metadata); err != nil {
		return fmt.Errorf("write safetensors %s: %w", path, err)
	}
	return nil
}

func writeSafetensors(path string, tensors map[string]*Tensor, metadata map[string]string) error {
	header, names, err := safetensorsHeaderJSON(tensors, metadata)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, func(w io.Writer) error {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(header)))
		if _, err := w.Write(n[:]); err != nil {
			return err
		}
		if _, err := w.Write(header); err != nil {
			return err
		}
		for _, name := range names {
			if _, err := w.Write(tensors[name].Bytes()); err != nil {
				return err
			}
		}
		return nil
	})
}

// safetensorsHeaderJSON builds the padded header and returns the tensor names
// in the order their data follows it.
func safetensorsHeaderJSON(tensors map[string]*Tensor, metadata map[string]string) ([]byte, []string, error) {
	names := make([]string, 0, len(tensors))
	for name := range tensors {
		names = append(names, name)
	}
	sort.Strings(names)
	header := make(map[string]any, len(tensors)+1)
	if len(metadata) > 0 {
		for k, v := range metadata {
			if !utf8.ValidString(k) || !utf8.ValidString(v) {
				return nil, nil, fmt.Errorf("metadata %q: not valid UTF-8", k)
			}
		}
		header["__metadata__"] = metadata
	}
	var offset int64
	for _, name := range names {
		e, err := safetensorsEntryFor(name, tensors[name], offset)
		if err != nil {
			return nil, nil, fmt.Errorf("tensor %q: %w", name, err)
		}
		header[name] = e
		offset = e.DataOffsets[1]
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf) // encoding/json writes map keys sorted
	enc.SetEscapeHTML(false)
	if err := enc.Encode(header); err != nil {
		return nil, nil, err
	}
	js := bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	// Pad with spaces so the data starts 8-byte aligned: a reader that maps
	// the file can then view any dtype in place.
	if pad := (8 - len(js)%8) % 8; pad > 0 {
		js = append(js, bytes.Repeat([]byte(" "), pad)...)
	}
	return js, names, nil
}

func safetensorsEntryFor(name string, t *Tensor, offset int64) (safetensorsJSONEntry, error) {
	switch {
	case name == "__metadata__":
		return safetensorsJSONEntry{}, errors.New("the name is reserved for the metadata")
	case !utf8.ValidString(name):
		return safetensorsJSONEntry{}, errors.New("name is not valid UTF-8")
	case t == nil:
		return safetensorsJSONEntry{}, errors.New("nil tensor")
	}
	d := t.Desc()
	st, err := safetensorsName(d.DType)
	if err != nil {
		return safetensorsJSONEntry{}, err
	}
	if !d.Contiguous() {
		return safetensorsJSONEntry{}, fmt.Errorf("shape %v with strides %v is not contiguous; copy it into a contiguous tensor first", d.Shape, d.Strides)
	}
	n := int64(len(t.Bytes())) // a contiguous tensor spans exactly its elements
	return safetensorsJSONEntry{DType: st, Shape: append([]int64{}, d.Shape...), DataOffsets: [2]int64{offset, offset + n}}, nil
}

// tempPattern is the os.CreateTemp pattern of a temporary file for base:
// base, ".tmp-" and the up to 10 digits CreateTemp puts for "*", with base
// cut so that the whole fits the 255 bytes most file systems allow a name
// (a base that fits alone, as NPYName's do, may not with the suffix).
func tempPattern(base string) string {
	const digits = 10
	if room := 255 - len(tempSuffix) - digits; len(base) > room {
		base = base[:room]
	}
	return base + tempSuffix + "*"
}

// tempSuffix precedes the digits of a temporary file's name (tempPattern).
const tempSuffix = ".tmp-"

// RemoveTemps removes the temporary files writeFileAtomic left in dir when
// its process was killed before the rename. A write still under way (another
// attempt at the same job, say a requeued task's while the old one runs)
// holds a lock on its file until the rename, and keeps it.
func RemoveTemps(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, e := range entries {
		i := strings.LastIndex(e.Name(), tempSuffix)
		if i < 0 {
			continue
		}
		if digits := e.Name()[i+len(tempSuffix):]; digits == "" || strings.Trim(digits, "0123456789") != "" {
			continue
		}
		path := filepath.Join(dir, e.Name())
		if !abandoned(path) {
			continue
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove %s, left by an interrupted write: %w", path, err)
		}
	}
	return nil
}

// abandoned says whether no write holds the temporary file at path: its
// lock can be taken (and is let go at once). A file that cannot be opened
// or locked is kept.
func abandoned(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil
}

// writeFileAtomic writes path through a temporary file in the same directory,
// synced and then renamed into place, so a crash leaves either the old file or
// the whole new one, never part of it.
func writeFileAtomic(path string, write func(w io.Writer) error) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), tempPattern(filepath.Base(path)))
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	// Held until the file is renamed (closing lets it go): RemoveTemps
	// leaves a file under a write alone. Where the file system has no locks
	// the write goes on, and RemoveTemps keeps what it cannot lock.
	_ = unix.Flock(int(f.Fd()), unix.LOCK_EX)
	// Large tensors go past the buffer straight to the file; small ones are batched.
	w := bufio.NewWriterSize(f, 1<<16)
	if err := write(w); err != nil {
		return err
	}
	if err := w.Flush(); err != nil {
		return err
	}
	// CreateTemp makes the file 0600; a saved file is as readable as one os.Create makes.
	if err := f.Chmod(0o644); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return err
	}
	return f.Close()
}
