// Package resultstest holds helpers for tests of code that writes run
// directories.
package resultstest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/vlkv/vlkv/gohost/results"
)

// Snapshot is every file of a run directory but its lock (which names the
// process holding it), by path, with its contents: two snapshots are equal
// when nothing in the run changed.
func Snapshot(t testing.TB, dir string) map[string]string {
	t.Helper()
	files := map[string]string{}
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() == results.LockFile {
			return err
		}
		data, err := os.ReadFile(path)
		rel, _ := filepath.Rel(dir, path)
		files[rel] = string(data)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}
