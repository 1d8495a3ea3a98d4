package worker

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
)

func TestFrameRoundTrip(t *testing.T) {
	var buf bytes.Buffer
	msgs := []message{
		{Type: "run", ID: 1, Job: &Job{Fn: "kernels_py.runtime.diag:echo", Args: map[string]any{"x": 1.5}}},
		{Type: "reload", ID: 2},
		{Type: "shutdown", ID: 3},
	}
	for _, m := range msgs {
		if err := WriteFrame(&buf, m); err != nil {
			t.Fatal(err)
		}
	}
	for _, want := range msgs {
		body, err := ReadFrame(&buf)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(body), `"type":"`+want.Type+`"`) {
			t.Errorf("frame %s does not hold type %q", body, want.Type)
		}
	}
	if _, err := ReadFrame(&buf); err != io.EOF {
		t.Fatalf("after the last frame: got %v, want io.EOF", err)
	}
}

func TestReadFrameRejectsBadInput(t *testing.T) {
	tests := []struct {
		name    string
		data    []byte
		wantErr error
		wantMsg string
	}{
		{"truncated header", []byte{0, 0}, io.ErrUnexpectedEOF, "truncated frame header (2 of 4 bytes)"},
		{"truncated body", append([]byte{0, 0, 0, 10}, `{"a":`...), io.ErrUnexpectedEOF, "truncated frame body (5 of 10 bytes)"},
		{"garbage body", append([]byte{0, 0, 0, 4}, "\xff\x00ab"...), nil, "not a JSON object"},
		{"json array", append([]byte{0, 0, 0, 2}, "[]"...), nil, "not a JSON object"},
		{"oversized", []byte{0xff, 0xff, 0xff, 0xff}, ErrFrameTooLarge, "announces 4294967295 bytes"},
		{"text instead of a frame", []byte("Traceback (most recent call last):\n"), ErrFrameTooLarge, "announces"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadFrame(bytes.NewReader(tc.data))
			if err == nil {
				t.Fatal("got no error")
			}
			if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Errorf("error %v is not %v", err, tc.wantErr)
			}
			if !strings.Contains(err.Error(), tc.wantMsg) {
				t.Errorf("error %q does not mention %q", err, tc.wantMsg)
			}
		})
	}
}

func TestWriteFrameRejectsOversizedAndUnencodable(t *testing.T) {
	if err := WriteFrame(io.Discard, map[string]string{"s": strings.Repeat("x", MaxFrameBytes)}); !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("oversized: got %v", err)
	}
	if err := WriteFrame(io.Discard, map[string]any{"c": make(chan int)}); err == nil {
		t.Error("unencodable value: got no error")
	}
}

func FuzzReadFrame(f *testing.F) {
	f.Add([]byte{0, 0, 0, 2, '{', '}'})
	f.Add([]byte{0, 0, 0, 9})
	f.Fuzz(func(t *testing.T, data []byte) {
		body, err := ReadFrame(bytes.NewReader(data))
		if err == nil && len(body) > len(data)-4 {
			t.Fatalf("body of %d bytes from %d bytes of input", len(body), len(data))
		}
	})
}
