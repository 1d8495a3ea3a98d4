// Package testpy gives tests the Python interpreter that scripts/test
// resolved (it has torch and triton), so they can talk to real workers.
package testpy

import (
	"bytes"
	"os"
	"sync"
	"testing"
)

// Python returns $VLKV_TEST_PYTHON. Outside CI a test without it is skipped;
// in CI it fails, so a misconfigured run cannot pass by skipping.
func Python(t testing.TB) string {
	t.Helper()
	py := os.Getenv("VLKV_TEST_PYTHON")
	if py == "" {
		if os.Getenv("CI") != "" {
			t.Fatal("VLKV_TEST_PYTHON is not set; run the tests through scripts/test")
		}
		t.Skip("VLKV_TEST_PYTHON is not set; run the tests through scripts/test")
	}
	return py
}

// SyncBuffer collects a process's or a logger's output while the test
// reads it from another goroutine.
type SyncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
