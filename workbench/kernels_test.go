package main

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/worker"
)

// A kernel that does not compile is printed at its file:line with the
// compiler's message and fails the command; none is no error.
func TestCompileErrorsArePrintedAndFail(t *testing.T) {
	tests := []struct {
		name    string
		errs    []compileError
		want    []string
		wantErr string
	}{
		{name: "none"},
		{
			name: "one config",
			errs: []compileError{{Case: "gather-fp16-d128-gqa4", Kernel: "_stage1_kernel", Config: "w8 s3",
				SourceLine: worker.SourceLine{File: "kernels_py/ops/gather_decode/kernel.py", Line: 72,
					Message: "arange's range must be a power of 2", Source: "        offs_n = start + tl.arange(0, 3)"}}},
			want: []string{"gather-fp16-d128-gqa4 _stage1_kernel (w8 s3) failed to compile at " +
				"kernels_py/ops/gather_decode/kernel.py:72\n    offs_n = start + tl.arange(0, 3)\n" +
				"  arange's range must be a power of 2\n"},
			wantErr: "kernels report: 1 compile error (above)",
		},
		{
			name: "a launcher and a config",
			errs: []compileError{{Case: "a", SourceLine: worker.SourceLine{Message: "launcher failed"}},
				{Case: "b", Kernel: "_k", SourceLine: worker.SourceLine{File: "x.py", Line: 3, Message: "m"}}},
			want:    []string{"a failed to compile: launcher failed\n", "b _k failed to compile at x.py:3\n  m\n"},
			wantErr: "kernels report: 2 compile errors (above)",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			err := compileErrors(&out, tc.errs)
			if tc.wantErr == "" {
				if err != nil || out.Len() != 0 {
					t.Fatalf("err %v, printed %q", err, out.String())
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("err %v, want %q", err, tc.wantErr)
			}
			for _, w := range tc.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("printed %q, want %q", out.String(), w)
				}
			}
		})
	}
}

// A job's error from a kernels_py line is shown at that line, its
// traceback logged with -v; other errors keep their traceback, and bad
// knobs are a usage error.
func TestJobFailedShowsTheKernelsLine(t *testing.T) {
	at := &worker.SourceLine{File: "kernels_py/ops/gather_decode/kernel.py", Line: 72,
		Source: "        offs_n = start + tl.arange(0, 3)", Message: "ValueError: arange's range must be a power of 2"}
	tests := []struct {
		name      string
		err       error
		want      string
		usage     bool
		debugged  bool
		notInText string
	}{
		{name: "at a line", err: &worker.JobError{Type: "triton.runtime.errors.InterpreterError", Message: `ValueError("arange's range must be a power of 2")`,
			Traceback: "Traceback (most recent call last): ...", At: at},
			want: "selftest job failed at kernels_py/ops/gather_decode/kernel.py:72\n    offs_n = start + tl.arange(0, 3)\n" +
				"  ValueError: arange's range must be a power of 2\n(the traceback: add -v)",
			debugged: true, notInText: "Traceback"},
		{name: "raised as an error that says more", err: &worker.JobError{Type: "RuntimeError",
			Message: "the step cannot be captured in a CUDA graph: does it wait for the host?", Traceback: "tb",
			At: &worker.SourceLine{File: "kernels_py/benchmarks/base.py", Line: 160, Source: "graph.replay()",
				Message: "RuntimeError: operation not permitted when stream is capturing"}},
			want: "selftest job failed at kernels_py/benchmarks/base.py:160\n    graph.replay()\n" +
				"  RuntimeError: operation not permitted when stream is capturing\n(raised as RuntimeError: the step " +
				"cannot be captured in a CUDA graph: does it wait for the host?)\n(the traceback: add -v)"},
		{name: "no line", err: &worker.JobError{Type: "ValueError", Message: "boom", Traceback: "Traceback ...\nValueError: boom"},
			want: "selftest job failed: ValueError: boom\nTraceback ...\nValueError: boom"},
		{name: "bad knobs", err: &worker.JobError{Type: badKnobs, Message: "heads must divide", At: at},
			want: "heads must divide", usage: true},
	}
	for _, tc := range tests {
		// With -v the traceback is logged, and the hint to add -v is left out.
		for _, verbose := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/verbose=%v", tc.name, verbose), func(t *testing.T) {
				var logged bytes.Buffer
				level, want := zerolog.InfoLevel, tc.want
				if verbose {
					level, want = zerolog.DebugLevel, strings.TrimSuffix(tc.want, "\n(the traceback: add -v)")
				}
				a := &app{log: zerolog.New(&logged).Level(level)}
				err := a.jobFailed("selftest job", tc.err)
				var ue *usageError
				if err == nil || err.Error() != want || errors.As(err, &ue) != tc.usage {
					t.Fatalf("got %v (usage %v), want %q", err, errors.As(err, &ue), want)
				}
				if tc.notInText != "" && strings.Contains(err.Error(), tc.notInText) {
					t.Errorf("%q in %q", tc.notInText, err.Error())
				}
				if got := strings.Contains(logged.String(), "Traceback"); got != (tc.debugged && verbose) {
					t.Errorf("traceback logged: %v, want %v (%s)", got, tc.debugged && verbose, logged.String())
				}
			})
		}
	}
}

// The estimate's error where no config of a kernel is usable names the
// first failure as a compile error is named; output that is no such error
// is left to the caller.
func TestNoUsableConfigNamesTheFirstFailure(t *testing.T) {
	tests := []struct {
		name string
		raw  string
		want string
	}{
		{name: "a config that does not compile",
			raw: `{"error": "gather: no config of _stage1_kernel compiled without spills at this shape (...)", "at": ` +
				`{"case": "gather", "kernel": "_stage1_kernel", "config": "w8 s3", "file": "kernels_py/ops/gather_decode/kernel.py", ` +
				`"line": 72, "source": "  offs_n = tl.arange(0, 3)", "message": "arange's range must be a power of 2"}}`,
			want: "kernels report: gather: no config of _stage1_kernel compiled without spills at this shape (...)\n" +
				"gather _stage1_kernel (w8 s3) failed to compile at kernels_py/ops/gather_decode/kernel.py:72\n" +
				"    offs_n = tl.arange(0, 3)\n  arange's range must be a power of 2"},
		{name: "every config spilled", raw: `{"error": "gather: no config ... (spilled: w4 s2)", "at": null}`,
			want: "kernels report: gather: no config ... (spilled: w4 s2)"},
		{name: "a report", raw: `{"title": "estimate", "tables": []}`},
		{name: "not JSON", raw: "Traceback ..."},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := noUsableConfig([]byte(tc.raw))
			if tc.want == "" {
				if err != nil {
					t.Fatalf("got %v, want none", err)
				}
				return
			}
			if err == nil || err.Error() != tc.want {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
		})
	}
}

// --op and --case take a comma-separated list as well as repeats, as
// selftest's --op does.
func TestReportOpsAndCasesTakeLists(t *testing.T) {
	for _, flag := range []string{"op", "case"} {
		cmd := newKernelsReportCmd(&app{})
		if err := cmd.ParseFlags([]string{"--" + flag, "a,b", "--" + flag, "c"}); err != nil {
			t.Fatalf("--%s: %v", flag, err)
		}
		got, err := cmd.Flags().GetStringSlice(flag)
		if err != nil {
			t.Fatalf("--%s: %v", flag, err)
		}
		if strings.Join(got, " ") != "a b c" {
			t.Errorf("--%s a,b --%s c: %q, want [a b c]", flag, flag, got)
		}
	}
}
