// Package testpy gives tests the Python interpreter that scripts/test
// resolved (it has torch and triton), so they can talk to real workers.
package testpy

import (
	"os"
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
