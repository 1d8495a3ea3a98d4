package worker

import (
	"bytes"
	"io"
	"sync"

	"github.com/rs/zerolog"
)

// tail keeps the last max bytes written to it.
type tail struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func newTail(max int) *tail { return &tail{max: max} }

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - t.max; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// lineLogger forwards complete lines to the debug log, so -v shows what
// workers print as it happens.
func lineLogger(log zerolog.Logger, stream string) io.Writer {
	if log.GetLevel() > zerolog.DebugLevel {
		return io.Discard
	}
	return &lineWriter{log: log, stream: stream}
}

type lineWriter struct {
	log     zerolog.Logger
	stream  string
	pending []byte
}

func (l *lineWriter) Write(p []byte) (int, error) {
	l.pending = append(l.pending, p...)
	for {
		i := bytes.IndexByte(l.pending, '\n')
		if i < 0 {
			break
		}
		l.log.Debug().Str("stream", l.stream).Msg(string(l.pending[:i]))
		l.pending = l.pending[i+1:]
	}
	return len(p), nil
}
