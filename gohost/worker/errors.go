package worker

import (
	"fmt"
	"strings"
)

// JobError is a Python exception raised by a job, as the worker reported it.
type JobError struct {
	Type      string `json:"type"`
	Message   string `json:"message"`
	Traceback string `json:"traceback"`
}

func (e *JobError) Error() string { return e.Type + ": " + e.Message }

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
	return fmt.Sprintf("worker died (%s); its last output:\n%s", e.State, indent(lastLines(out, 20)))
}

func lastLines(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func indent(s string) string { return "    " + strings.ReplaceAll(s, "\n", "\n    ") }
