package main

import (
	"bytes"
	"strings"
	"testing"
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
				At: "kernels_py/ops/gather_decode/kernel.py:72", Message: "arange's range must be a power of 2",
				Source: "        offs_n = start + tl.arange(0, 3)"}},
			want: []string{"kernels_py/ops/gather_decode/kernel.py:72: gather-fp16-d128-gqa4 _stage1_kernel (w8 s3): " +
				"arange's range must be a power of 2\n    offs_n = start + tl.arange(0, 3)\n"},
			wantErr: "1 kernel config did not compile",
		},
		{
			name:    "a launcher and a config",
			errs:    []compileError{{Case: "a", Message: "launcher failed"}, {Case: "b", Kernel: "_k", At: "x.py:3", Message: "m"}},
			want:    []string{"error: a: launcher failed\n", "x.py:3: b _k: m\n"},
			wantErr: "2 kernel configs did not compile",
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
