package sched

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/mattn/go-isatty"

	"github.com/vlkv/vlkv/gohost/worker"
)

// Terminal is a terminal that log lines and a progress bar share. The bar
// is redrawn in place with "\r" and has no newline: a log line written
// straight after it would continue the bar's line. Lines written through
// Terminal clear the bar first and redraw it after.
type Terminal struct {
	mu  sync.Mutex
	out io.Writer
	bar string // as last drawn; "" while none is shown
}

// NewTerminal shares out, a terminal, between log lines and a bar.
func NewTerminal(out io.Writer) *Terminal { return &Terminal{out: out} }

// clearLine returns the cursor to the line's start and erases the line.
const clearLine = "\r\x1b[K"

// Write writes log output: whole lines, as a logger writes an event.
func (t *Terminal) Write(b []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.bar == "" {
		return t.out.Write(b)
	}
	io.WriteString(t.out, clearLine)
	n, err := t.out.Write(b)
	if len(b) > 0 && b[len(b)-1] == '\n' {
		io.WriteString(t.out, t.bar)
	}
	return n, err
}

// Ask writes question and returns what read returns (the answer typed),
// holding back the bar and log lines meanwhile: a bar redrawn while the
// user reads would erase the question from the line the answer is typed
// on. The bar comes back after the answer.
func (t *Terminal) Ask(question string, read func() string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.bar != "" {
		io.WriteString(t.out, clearLine)
	}
	io.WriteString(t.out, question)
	answer := read()
	io.WriteString(t.out, t.bar)
	return answer
}

// drawBar replaces the bar shown, if any, with bar.
func (t *Terminal) drawBar(bar string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.bar = bar
	io.WriteString(t.out, clearLine+bar)
}

// endBar leaves the bar as last drawn on its own line.
func (t *Terminal) endBar() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.bar != "" {
		io.WriteString(t.out, "\n")
		t.bar = ""
	}
}

// IsTerminal says whether w is a terminal: a *Terminal, or a file that is one.
func IsTerminal(w io.Writer) bool {
	switch w := w.(type) {
	case *Terminal:
		return true
	case *os.File:
		return isatty.IsTerminal(w.Fd())
	}
	return false
}

// Progress reports finished jobs: a redrawn bar on a terminal, one plain
// line per job otherwise (logs, CI). On a *Terminal, log lines written
// through it while the bar is shown appear above the bar. A job can take
// an hour, so the bar's elapsed time is redrawn every barTick, and a log
// that sees no job finish for quietLine says the run is still going.
type Progress struct {
	mu       sync.Mutex
	out      io.Writer
	tty      bool
	total    int
	skipped  int
	done     int
	failed   int
	started  time.Time
	first    time.Time // when the first job of this call finished
	lastLine time.Time // of the last line written, when not on a terminal
	now      func() time.Time
	every    time.Duration // between redraws, or checks for a quiet log
	quiet    time.Duration
	stop     chan struct{}
	stopped  sync.WaitGroup
}

// How often the bar is redrawn, and how long a log goes without a line
// before it gets one saying the run is still going.
var (
	barTick   = time.Second
	quietLine = 5 * time.Minute
)

// NewProgress counts towards total jobs; skipped ones (resumed) are already
// done. Close stops its redraws.
func NewProgress(out io.Writer, tty bool, total, skipped int) *Progress {
	p := &Progress{out: out, tty: tty, total: total, skipped: skipped, done: skipped, started: time.Now(), now: time.Now,
		every: barTick, quiet: quietLine, stop: make(chan struct{})}
	if !tty {
		p.every = min(quietLine, time.Minute)
	}
	p.lastLine = p.started
	if tty {
		p.draw()
	}
	if p.done < p.total {
		p.stopped.Add(1)
		go p.tick()
	}
	return p
}

// tick redraws the bar every barTick, or writes a line after quietLine
// without one, until Close.
func (p *Progress) tick() {
	defer p.stopped.Done()
	t := time.NewTicker(p.every)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
		}
		p.mu.Lock()
		switch {
		case p.done >= p.total: // drawn or written as it finished
		case p.tty:
			p.draw()
		case p.now().Sub(p.lastLine) >= p.quiet:
			fmt.Fprintf(p.out, "[%d/%d] still running (%s elapsed, no job finished in %s), ETA %s\n", p.done, p.total,
				p.elapsed(), p.now().Sub(p.lastLine).Round(time.Second), p.eta())
			p.lastLine = p.now()
		}
		p.mu.Unlock()
	}
}

// Finished records one outcome.
func (p *Progress) Finished(o Outcome) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	if p.done-p.skipped == 1 {
		p.first = p.now()
	}
	status := "ok"
	if o.Err != nil {
		p.failed++
		status = "FAILED: " + firstLine(o.Err.Error()) + failedAt(o.Err)
	}
	if p.tty {
		p.draw()
		return
	}
	eta := ""
	if p.done < p.total {
		eta = ", ETA " + p.eta()
	}
	fmt.Fprintf(p.out, "[%d/%d] %s %s (%s) %s%s\n", p.done, p.total, o.Job.ID, o.Job.Label, o.Duration.Round(time.Millisecond),
		status, eta)
	p.lastLine = p.now()
}

// Close stops the redraws and ends the bar's line.
func (p *Progress) Close() {
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	p.stopped.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := p.out.(*Terminal); ok && p.tty {
		t.endBar()
	} else if p.tty {
		fmt.Fprintln(p.out)
	}
}

func (p *Progress) draw() {
	const width = 30
	filled := 0
	if p.total > 0 {
		filled = width * p.done / p.total
	}
	bar := fmt.Sprintf("[%s%s] %d/%d done, %d failed, ETA %s (%s elapsed) ", strings.Repeat("=", filled), strings.Repeat(" ", width-filled),
		p.done, p.total, p.failed, p.eta(), p.elapsed())
	if t, ok := p.out.(*Terminal); ok {
		t.drawBar(bar)
		return
	}
	fmt.Fprint(p.out, "\r"+bar)
}

// elapsed is the time since the progress began, to the second.
func (p *Progress) elapsed() time.Duration {
	return p.now().Sub(p.started).Round(time.Second)
}

// eta extrapolates the time left from the jobs finished since the start
// (resumed ones do not count). From the second on, it goes by the jobs
// since the first: the first also paid for the workers' start and the
// kernels' first compiles, which made a 30-second run's first ETA minutes.
func (p *Progress) eta() string {
	if p.done >= p.total {
		return "0s"
	}
	ran := p.done - p.skipped
	if ran <= 0 {
		return "?"
	}
	per := p.now().Sub(p.started) / time.Duration(ran)
	if ran > 1 {
		per = p.now().Sub(p.first) / time.Duration(ran-1)
	}
	return (per * time.Duration(p.total-p.done)).Round(time.Second).String()
}

// failedAt is " (at FILE:LINE)": the kernels_py line a job's error comes
// from (kernels_py.runtime.errors.locate), so a failure in a method being
// written points at its source; "" when the worker named none.
func failedAt(err error) string {
	var je *worker.JobError
	if !errors.As(err, &je) || je.At == nil || je.At.File == "" {
		return ""
	}
	return fmt.Sprintf(" (at %s:%d)", je.At.File, je.At.Line)
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}
