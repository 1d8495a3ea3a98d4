package sched

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// Progress reports finished jobs: a redrawn bar on a terminal, one plain
// line per job otherwise (logs, CI).
type Progress struct {
	mu      sync.Mutex
	out     io.Writer
	tty     bool
	total   int
	skipped int
	done    int
	failed  int
	started time.Time
	now     func() time.Time
}

// NewProgress counts towards total jobs; skipped ones (resumed) are already done.
func NewProgress(out io.Writer, tty bool, total, skipped int) *Progress {
	p := &Progress{out: out, tty: tty, total: total, skipped: skipped, done: skipped, started: time.Now(), now: time.Now}
	if tty {
		p.draw()
	}
	return p
}

// Finished records one outcome.
func (p *Progress) Finished(o Outcome) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	status := "ok"
	if o.Err != nil {
		p.failed++
		status = "FAILED: " + firstLine(o.Err.Error())
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
}

// Close ends the bar's line.
func (p *Progress) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty {
		fmt.Fprintln(p.out)
	}
}

func (p *Progress) draw() {
	const width = 30
	filled := 0
	if p.total > 0 {
		filled = width * p.done / p.total
	}
	fmt.Fprintf(p.out, "\r[%s%s] %d/%d done, %d failed, ETA %s ", strings.Repeat("=", filled), strings.Repeat(" ", width-filled),
		p.done, p.total, p.failed, p.eta())
}

// eta extrapolates the time left from the jobs finished since the start
// (resumed ones do not count).
func (p *Progress) eta() string {
	if p.done >= p.total {
		return "0s"
	}
	ran := p.done - p.skipped
	if ran <= 0 {
		return "?"
	}
	return (p.now().Sub(p.started) / time.Duration(ran) * time.Duration(p.total-p.done)).Round(time.Second).String()
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}
