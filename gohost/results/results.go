// Package results owns run directories: results/<experiment>/<run-id>/ with
// manifest.json, journal.jsonl (one fsync'd line per finished job, the source
// of truth), results.parquet (rebuilt from the journal) and tensors/.
package results

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
	"time"
)

const (
	ManifestFile = "manifest.json"
	JournalFile  = "journal.jsonl"
	ParquetFile  = "results.parquet"
	TensorsDir   = "tensors"
)

// Manifest describes a run: what ran, on what, when.
type Manifest struct {
	Experiment  string            `json:"experiment"`
	RunID       string            `json:"run_id"`
	File        string            `json:"file"`
	FileHash    string            `json:"file_sha256"`
	Git         Git               `json:"git"`
	KernelsHash map[string]string `json:"kernels_sha256"` // per kernels_py source file
	Versions    map[string]string `json:"versions"`
	Device      string            `json:"device"`
	Jobs        int               `json:"jobs"`
	Started     time.Time         `json:"started"`
	Ended       *time.Time        `json:"ended,omitempty"`
	Resumed     []time.Time       `json:"resumed,omitempty"`
}

// Git is the checkout a run came from, if any.
type Git struct {
	Commit string `json:"commit,omitempty"`
	Dirty  bool   `json:"dirty"`
}

// Record is one finished job: a line of the journal, a row of the table.
type Record struct {
	JobID        string         `json:"job_id"`
	Experiment   string         `json:"experiment"`
	Method       string         `json:"method"`
	Params       map[string]any `json:"params"`
	WorkloadName string         `json:"workload_name,omitempty"` // the registered workload (absent in runs from before workloads had names: synthetic)
	Workload     map[string]any `json:"workload"`
	Status       string         `json:"status"` // StatusOK or StatusFailed
	Error        string         `json:"error,omitempty"`
	Attempts     int            `json:"attempts"`
	Seconds      float64        `json:"duration_seconds"`
	Metrics      map[string]any `json:"metrics,omitempty"`
	Extra        map[string]any `json:"extra,omitempty"` // non-scalar outputs (per-layer lists, ...)
	Finished     time.Time      `json:"finished"`
}

const (
	StatusOK     = "ok"
	StatusFailed = "failed"
)

// Run is an open run directory.
type Run struct {
	Dir      string
	mu       sync.Mutex
	journal  *os.File
	manifest Manifest
}

var safeName = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)

// NewRunID is sortable by start time and unique enough for one machine.
func NewRunID(now time.Time) string {
	var b [3]byte
	rand.Read(b[:])
	return now.UTC().Format("20060102-150405") + "-" + hex.EncodeToString(b[:])
}

// Create makes root/<experiment>/<run-id>/ and writes its manifest.
func Create(root string, m Manifest) (*Run, error) {
	if !safeName.MatchString(m.Experiment) || !safeName.MatchString(m.RunID) {
		return nil, fmt.Errorf("experiment %q / run id %q: want letters, digits, '.', '_' or '-'", m.Experiment, m.RunID)
	}
	dir := filepath.Join(root, m.Experiment, m.RunID)
	if err := os.MkdirAll(filepath.Join(dir, TensorsDir), 0o755); err != nil {
		return nil, fmt.Errorf("create run directory: %w", err)
	}
	r := &Run{Dir: dir, manifest: m}
	if err := r.writeManifest(); err != nil {
		return nil, err
	}
	return r, r.openJournal()
}

// Latest returns the newest run directory of an experiment under root, or "".
func Latest(root, experiment string) (string, error) {
	entries, err := os.ReadDir(filepath.Join(root, experiment))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	var runs []string
	for _, e := range entries {
		if e.IsDir() && fileExists(filepath.Join(root, experiment, e.Name(), ManifestFile)) {
			runs = append(runs, e.Name())
		}
	}
	if len(runs) == 0 {
		return "", nil
	}
	sort.Strings(runs)
	return filepath.Join(root, experiment, runs[len(runs)-1]), nil
}

// Open reopens an existing run to resume it. A line torn by a crash at the
// end of the journal is cut off, so new lines start clean.
func Open(dir string) (*Run, error) {
	data, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return nil, fmt.Errorf("open run %s: %w", dir, err)
	}
	r := &Run{Dir: dir}
	if err := json.Unmarshal(data, &r.manifest); err != nil {
		return nil, fmt.Errorf("open run %s: manifest: %w", dir, err)
	}
	if err := truncateTornLine(filepath.Join(dir, JournalFile)); err != nil {
		return nil, err
	}
	return r, r.openJournal()
}

func (r *Run) openJournal() error {
	f, err := os.OpenFile(filepath.Join(r.Dir, JournalFile), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("open journal: %w", err)
	}
	r.journal = f
	return nil
}

// Manifest returns a copy of the run's manifest.
func (r *Run) Manifest() Manifest {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.manifest
}

// UpdateManifest changes the manifest and rewrites it atomically.
func (r *Run) UpdateManifest(change func(*Manifest)) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	change(&r.manifest)
	return r.writeManifest()
}

func (r *Run) writeManifest() error {
	data, err := json.MarshalIndent(r.manifest, "", "  ")
	if err != nil {
		return err
	}
	return writeAtomic(filepath.Join(r.Dir, ManifestFile), append(data, '\n'))
}

// Append journals one finished job: one line, then fsync, so a crash right
// after loses nothing that was reported done.
func (r *Run) Append(rec Record) error {
	line, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("journal job %s: %w", rec.JobID, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.journal.Write(append(line, '\n')); err != nil {
		return fmt.Errorf("journal job %s: %w", rec.JobID, err)
	}
	if err := r.journal.Sync(); err != nil {
		return fmt.Errorf("journal job %s: fsync: %w", rec.JobID, err)
	}
	return nil
}

// Close closes the journal.
func (r *Run) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.journal.Close()
}

// ReadJournal returns the journal's records in order; a torn last line (a
// crash mid-write) is ignored, any other bad line is an error.
func ReadJournal(dir string) ([]Record, error) {
	data, err := os.ReadFile(filepath.Join(dir, JournalFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var recs []Record
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Bytes()
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var rec Record
		if err := json.Unmarshal(line, &rec); err != nil {
			torn := n == bytes.Count(data, []byte("\n"))+1 // last line, no newline after it
			if torn {
				break
			}
			return nil, fmt.Errorf("%s line %d: %w", filepath.Join(dir, JournalFile), n, err)
		}
		recs = append(recs, rec)
	}
	return recs, sc.Err()
}

// Finished maps job ids to their last journal record.
func Finished(dir string) (map[string]Record, error) {
	recs, err := ReadJournal(dir)
	if err != nil {
		return nil, err
	}
	done := make(map[string]Record, len(recs))
	for _, rec := range recs {
		done[rec.JobID] = rec
	}
	return done, nil
}

func truncateTornLine(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	data, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	if len(data) == 0 || data[len(data)-1] == '\n' {
		return nil
	}
	return f.Truncate(int64(bytes.LastIndexByte(data, '\n') + 1))
}

func writeAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
