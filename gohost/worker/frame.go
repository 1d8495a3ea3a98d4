package worker

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// MaxFrameBytes caps one frame. Tensors travel by reference, so frames carry
// only metadata and small results; the cap stops a desynchronised stream from
// turning into a huge allocation. Mirrors kernels_py/runtime/protocol.py.
const MaxFrameBytes = 64 << 20

// ErrFrameTooLarge reports a frame header announcing more than MaxFrameBytes.
var ErrFrameTooLarge = errors.New("frame exceeds size limit")

// WriteFrame writes v as one frame: a 4-byte big-endian length, then JSON.
func WriteFrame(w io.Writer, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode frame: %w", err)
	}
	if len(body) > MaxFrameBytes {
		return fmt.Errorf("encode frame of %d bytes: %w", len(body), ErrFrameTooLarge)
	}
	buf := make([]byte, 4+len(body))
	binary.BigEndian.PutUint32(buf, uint32(len(body)))
	copy(buf[4:], body)
	if _, err := w.Write(buf); err != nil {
		return fmt.Errorf("write frame: %w", err)
	}
	return nil
}

// ReadFrame reads one frame and returns its body, checked to be a JSON object.
// A clean end of stream before any byte returns io.EOF.
func ReadFrame(r io.Reader) ([]byte, error) {
	var header [4]byte
	if n, err := io.ReadFull(r, header[:]); err != nil {
		if err == io.EOF {
			return nil, io.EOF
		}
		return nil, fmt.Errorf("truncated frame header (%d of 4 bytes): %w", n, io.ErrUnexpectedEOF)
	}
	size := binary.BigEndian.Uint32(header[:])
	if size > MaxFrameBytes {
		return nil, fmt.Errorf("frame header announces %d bytes: %w", size, ErrFrameTooLarge)
	}
	body := make([]byte, size)
	if n, err := io.ReadFull(r, body); err != nil {
		return nil, fmt.Errorf("truncated frame body (%d of %d bytes): %w", n, size, io.ErrUnexpectedEOF)
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil {
		return nil, fmt.Errorf("frame is not a JSON object: %w", err)
	}
	return body, nil
}
