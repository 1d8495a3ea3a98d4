package worker

import (
	"bytes"
	"io"
	"strings"
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

// ProgressPrefix starts a line a job prints to say how it is going
// (kernels_py.runtime.progress): it is logged at the info level, as it
// happens; every other line only at the debug level (-v).
const ProgressPrefix = "vlkv progress: "

// lineLogger forwards complete lines to the log as they are written:
// progress lines at the info level, the rest at the debug level, so -v
// shows everything workers print.
func lineLogger(log zerolog.Logger, stream string) io.Writer {
	return &lineWriter{log: log, stream: stream}
}

type lineWriter struct {
	log     zerolog.Logger
	stream  string
	pending []byte
}

// maxLineBytes cuts a line that has not ended by then: output that never
// writes a newline must not grow without bound.
const maxLineBytes = 64 << 10

// Write logs each line as it ends. A carriage return ends a line too:
// progress bars (tqdm's) redraw themselves with "\r" and never write "\n".
func (l *lineWriter) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		i := bytes.IndexAny(p, "\r\n")
		if i < 0 {
			l.pending = append(l.pending, p...)
			break
		}
		l.pending = append(l.pending, p[:i]...)
		l.emit(l.pending)
		l.pending = l.pending[:0]
		p = p[i+1:]
	}
	for len(l.pending) >= maxLineBytes {
		l.emit(l.pending[:maxLineBytes])
		l.pending = append(l.pending[:0], l.pending[maxLineBytes:]...)
	}
	return n, nil
}

func (l *lineWriter) emit(line []byte) {
	if len(line) == 0 { // "\r\n", or a bar cleared before a line
		return
	}
	if text, ok := strings.CutPrefix(string(line), ProgressPrefix); ok {
		l.log.Info().Msg(text)
	} else {
		l.log.Debug().Str("stream", l.stream).Msg(string(line))
	}
}
