package main

import (
	"fmt"
	"math"
	"strings"
	"testing"
)

// bench exchange measures whole float32 tensors from --min-bytes to
// --max-bytes, never one below the range asked for.
func TestExchangeSizes(t *testing.T) {
	tests := []struct {
		min, max int64
		want     []int64
	}{
		{4, 64, []int64{4, 16, 64}},
		{4, 63, []int64{4, 16}},
		{5, 100, []int64{8, 32}},                   // rounded up: 5 bytes measured 4
		{4097, 1 << 14, []int64{4100}},             // 4100*4 is past 16 KiB
		{5, 6, nil},                                // no whole float32 in the range
		{1 << 62, math.MaxInt64, []int64{1 << 62}}, // the next step is past int64
		{math.MaxInt64, math.MaxInt64, nil},
	}
	for _, tc := range tests {
		if got := exchangeSizes(tc.min, tc.max); fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("exchangeSizes(%d, %d) = %v, want %v", tc.min, tc.max, got, tc.want)
		}
	}
}

func TestBenchExchangeRefusesARangeWithNoTensor(t *testing.T) {
	// Refused before any Python starts (this interpreter does not exist).
	code, _, stderr := runCLI(t, "--python", "/nonexistent", "bench", "exchange", "--min-bytes", "5", "--max-bytes", "6")
	if code != 2 || !strings.Contains(stderr, "no float32 tensor has from 5 to 6 bytes") {
		t.Errorf("bench exchange --min-bytes 5 --max-bytes 6: exit %d, %s", code, stderr)
	}
}
