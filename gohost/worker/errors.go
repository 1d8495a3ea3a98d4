package worker

import (
	"fmt"
	"regexp"
	"strings"
)

// JobError is a Python exception raised by a job, as the worker reported it.
type JobError struct {
	Type      string      `json:"type"`
	Message   string      `json:"message"`
	Traceback string      `json:"traceback"`
	At        *SourceLine `json:"at,omitempty"` // the kernels_py line it comes from, if any
	// WorkerLost, when set, is why the worker can run nothing more after
	// this error (its GPU context broken); it exits after the reply.
	WorkerLost string `json:"worker_lost,omitempty"`
}

func (e *JobError) Error() string {
	if e.WorkerLost != "" {
		return e.Type + ": " + e.Message + " (the worker's GPU was unusable after it: " + e.WorkerLost + "; the worker exited)"
	}
	return e.Type + ": " + e.Message
}

// SourceLine is an error at the kernels_py line it comes from, as
// kernels_py.runtime.errors.locate finds it: what a researcher editing a
// kernel needs first, where a traceback runs through Triton's internals.
type SourceLine struct {
	Message string `json:"message"`
	File    string `json:"file"`
	Line    int    `json:"line"`
	Source  string `json:"source"`
	Kind    string `json:"kind"`
}

func (s *SourceLine) Error() string {
	if s.File != "" {
		return fmt.Sprintf("%s:%d: %s", s.File, s.Line, s.Message)
	}
	return s.Message
}

// Format is the error as a block: its file:line, the line itself and the
// message under it (the message alone without a line; no source line
// where the source is not known).
func (s *SourceLine) Format() string {
	if s.File == "" {
		return s.Message
	}
	if src := strings.TrimSpace(s.Source); src != "" {
		return fmt.Sprintf("%s:%d\n    %s\n  %s", s.File, s.Line, src, s.Message)
	}
	return fmt.Sprintf("%s:%d\n  %s", s.File, s.Line, s.Message)
}

// Describe puts a failure ("selftest job failed", "X failed to compile")
// before where it happened: "FAILURE at" its block (Format), or
// "FAILURE: message" without a line. One form for a job's error, a config
// that does not compile and an estimate without a usable config.
func (s *SourceLine) Describe(failure string) string {
	if s.File == "" {
		return failure + ": " + s.Message
	}
	return failure + " at " + s.Format()
}

// ExitError reports a worker that ended while the host expected an answer.
type ExitError struct {
	State  string // how the process ended, e.g. "signal: killed"
	Output string // tail of its stdout and stderr
}

func (e *ExitError) Error() string {
	out := strings.TrimSpace(e.Output)
	if out == "" {
		return fmt.Sprintf("worker died (%s) and printed nothing", e.State)
	}
	// The first line is what a progress line or a log shows: where in
	// kernels_py a crash was, when the worker's stack says.
	where := ""
	if at := crashedAt(out); at != "" {
		where = " at " + at
	}
	return fmt.Sprintf("worker died (%s)%s; its last output:\n%s", e.State, where, indent(lastLines(out, 20)))
}

// stackFrame is a frame of the stack Python's faulthandler prints on a
// fatal signal (most recent call first).
var stackFrame = regexp.MustCompile(`^\s*File "([^"]+)", line (\d+) in (\S+)`)

// crashedAt is the innermost kernels_py frame, outside its runtime, of the
// crashing thread's stack in a worker's output: "kernels_py/x.py:5 in fn";
// "" when the output holds none.
func crashedAt(output string) string {
	i := strings.LastIndex(output, "Current thread ")
	if i < 0 {
		return ""
	}
	for _, line := range strings.Split(output[i:], "\n")[1:] {
		m := stackFrame.FindStringSubmatch(line)
		if m == nil {
			return "" // the end of the thread's stack
		}
		j := strings.LastIndex(m[1], "kernels_py/")
		if j < 0 || strings.HasPrefix(m[1][j:], "kernels_py/runtime/") {
			continue
		}
		return fmt.Sprintf("%s:%s in %s", m[1][j:], m[2], m[3])
	}
	return ""
}

func lastLines(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func indent(s string) string { return "    " + strings.ReplaceAll(s, "\n", "\n    ") }
