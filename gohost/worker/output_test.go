package worker

import (
	"bytes"
	"strings"
	"testing"

	"github.com/rs/zerolog"
)

func TestLineLoggerLevels(t *testing.T) {
	tests := []struct {
		name  string
		level zerolog.Level
		input string
		want  []string // substrings of the log, in order
		not   []string
	}{
		{"progress at info", zerolog.InfoLevel, "noise\nvlkv progress: row 1 of 2\n", []string{`"level":"info"`, `"message":"row 1 of 2"`}, []string{"noise"}},
		{"everything with -v", zerolog.DebugLevel, "noise\nvlkv progress: done\n", []string{`"message":"noise"`, `"message":"done"`}, nil},
		{"partial lines wait", zerolog.InfoLevel, "vlkv progress: half", nil, []string{"half"}},
		{"quiet drops progress too", zerolog.WarnLevel, "vlkv progress: row\n", nil, []string{"row"}},
		{"a carriage return ends a line", zerolog.DebugLevel, " 10%|#\r 20%|##\rdone\r\n",
			[]string{`"message":" 10%|#"`, `"message":" 20%|##"`, `"message":"done"`}, []string{`"message":""`}},
		{"an unended line is cut", zerolog.DebugLevel, strings.Repeat("x", maxLineBytes+5),
			[]string{`"message":"` + strings.Repeat("x", maxLineBytes) + `"`}, []string{`"message":"xxxxx"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			w := lineLogger(zerolog.New(&buf).Level(tt.level), "stderr")
			if _, err := w.Write([]byte(tt.input)); err != nil {
				t.Fatal(err)
			}
			got := buf.String()
			rest := got
			for _, want := range tt.want {
				i := strings.Index(rest, want)
				if i < 0 {
					t.Fatalf("log %q lacks %q (in order)", got, want)
				}
				rest = rest[i+len(want):]
			}
			for _, not := range tt.not {
				if strings.Contains(got, not) {
					t.Errorf("log %q holds %q", got, not)
				}
			}
		})
	}
}

func TestLineLoggerHoldsLittleOfAnUnendedLine(t *testing.T) {
	w := lineLogger(zerolog.Nop(), "stderr").(*lineWriter)
	chunk := bytes.Repeat([]byte("x"), 1000)
	for i := 0; i < 1000; i++ { // 1 MB, no line end
		w.Write(chunk)
	}
	if len(w.pending) >= maxLineBytes {
		t.Errorf("holds %d bytes of an unended line, want under %d", len(w.pending), maxLineBytes)
	}
}

// A worker's fatal-error stack names, on the error's first line (what a
// progress line shows), the kernels_py frame the crash was in: that line
// said only "worker died (signal: segmentation fault); its last output:".
func TestExitErrorSaysWhereItCrashed(t *testing.T) {
	const stack = `Fatal Python error: Segmentation fault

Thread 0x00007f01 (most recent call first):
  File "/r/kernels_py/methods/other.py", line 9 in idle

Current thread 0x00007f00 (most recent call first):
  File "/venv/lib/python3.13/site-packages/triton/runtime/interpreter.py", line 70 in load
  File "/r/kernels_py/ops/gather/kernel.py", line 41 in gather_kernel
  File "/r/kernels_py/methods/h2o.py", line 12 in prefill
  File "/r/kernels_py/runtime/worker.py", line 174 in run_job

Extension modules: numpy, torch (total: 2)`
	tests := []struct {
		name, output, first string
	}{
		{"a fatal error's stack", stack, "worker died (signal: segmentation fault) at kernels_py/ops/gather/kernel.py:41 in gather_kernel; its last output:"},
		{"a stack only in the runtime", "Current thread 0x1 (most recent call first):\n  File \"/r/kernels_py/runtime/worker.py\", line 174 in run_job\n",
			"worker died (signal: segmentation fault); its last output:"},
		{"no stack", "bye", "worker died (signal: segmentation fault); its last output:"},
		{"nothing printed", "", "worker died (signal: segmentation fault) and printed nothing"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := &ExitError{State: "signal: segmentation fault", Output: tc.output}
			if first, _, _ := strings.Cut(err.Error(), "\n"); first != tc.first {
				t.Errorf("first line %q, want %q", first, tc.first)
			}
		})
	}
}
