// Package results owns run directories: results/<experiment>/<run-id>/ with
// manifest.json, journal.jsonl (one fsync'd line per finished job, the source
// of truth), results.parquet (rebuilt from the journal), tensors/, and
// run.lock, which the one process writing the run holds.
package results

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/gofrs/flock"
)

const (
	ManifestFile = "manifest.json"
	JournalFile  = "journal.jsonl"
	ParquetFile  = "results.parquet"
	TensorsDir   = "tensors"
	LockFile     = "run.lock"
	// JobsFile lists the job ids of the plan the run's newest run or resume
	// ran: rows of other jobs come from an earlier script.
	JobsFile = "jobs.json"
)

// Manifest describes a run: what ran, on what, when.
type Manifest struct {
	Experiment  string            `json:"experiment"`
	RunID       string            `json:"run_id"`
	File        string            `json:"file"`
	FileHash    string            `json:"file_sha256"`
	Git         *Git              `json:"git,omitempty"`  // nil when unknown (a rebuilt manifest)
	KernelsHash map[string]string `json:"kernels_sha256"` // per kernels_py source file, when the run started
	// KernelsDigest is one hash of KernelsHash; every journal row carries
	// the digest of the code that computed it.
	KernelsDigest string `json:"kernels_digest,omitempty"`
	// CodeChanges are the resumes that ran on different kernels_py sources
	// (allowed with --allow-code-change), oldest first.
	CodeChanges []CodeChange      `json:"code_changes,omitempty"`
	Versions    map[string]string `json:"versions"`
	Device      string            `json:"device"`
	// Protocol is the comparison protocol the experiment's jobs were set
	// up by ("paper": each method's defaults); Dtypes the dtype knob of
	// its synthetic workloads, which every ratio there is counted against
	// (a trace or a live model runs in its own dtype).
	Protocol string      `json:"protocol,omitempty"`
	Dtypes   []string    `json:"dtypes,omitempty"`
	Jobs     int         `json:"jobs"`
	Started  time.Time   `json:"started"`
	Ended    *time.Time  `json:"ended,omitempty"`
	Resumed  []time.Time `json:"resumed,omitempty"`
	// Scripts are the scripts the run and each resume of it planned from,
	// oldest first (File and FileHash are the first's): a resume may run an
	// edited script, or another one.
	Scripts []Script `json:"scripts,omitempty"`
	// Rebuilt is set when manifest.json was lost and rebuilt from the
	// journal: the script, git state and source hashes are then unknown,
	// and Started is the first row's finish time.
	Rebuilt *time.Time `json:"rebuilt,omitempty"`
}

// Script is the experiment script a run or resume planned from.
type Script struct {
	At       time.Time `json:"at"`
	File     string    `json:"file"`
	FileHash string    `json:"file_sha256"`
	Jobs     int       `json:"jobs"` // in its plan
}

// CurrentScript is the script the run's newest run or resume planned from.
func (m Manifest) CurrentScript() Script {
	if n := len(m.Scripts); n > 0 {
		return m.Scripts[n-1]
	}
	return Script{At: m.Started, File: m.File, FileHash: m.FileHash, Jobs: m.Jobs}
}

// CodeChange is a resume (or a worker) on kernels_py sources other than
// those of the run's earlier rows.
type CodeChange struct {
	At            time.Time         `json:"at"`
	KernelsDigest string            `json:"kernels_digest"`
	Changed       []string          `json:"changed,omitempty"` // files added, removed or edited since the previous sources (absent: unknown)
	KernelsHash   map[string]string `json:"kernels_sha256"`
	// Git is the checkout's state then (Manifest.Git is its state when the
	// run started); nil outside one.
	Git *Git `json:"git,omitempty"`
}

// CurrentKernels is the digest and per-file hashes of the sources the run's
// newest rows were computed with.
func (m Manifest) CurrentKernels() (string, map[string]string) {
	if n := len(m.CodeChanges); n > 0 {
		return m.CodeChanges[n-1].KernelsDigest, m.CodeChanges[n-1].KernelsHash
	}
	if m.KernelsDigest == "" && len(m.KernelsHash) > 0 {
		return KernelsDigest(m.KernelsHash), m.KernelsHash
	}
	return m.KernelsDigest, m.KernelsHash
}

// KernelsDigest is one sha256 over per-file hashes: the same sources give
// the same digest wherever they lie.
func KernelsDigest(files map[string]string) string {
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	h := sha256.New()
	for _, name := range names {
		fmt.Fprintf(h, "%s\x00%s\n", name, files[name])
	}
	return hex.EncodeToString(h.Sum(nil))
}

// ChangedFiles lists the files added, removed or edited between two sets
// of per-file hashes.
func ChangedFiles(before, after map[string]string) []string {
	var changed []string
	for name, h := range after {
		if before[name] != h {
			changed = append(changed, name)
		}
	}
	for name := range before {
		if _, ok := after[name]; !ok {
			changed = append(changed, name)
		}
	}
	sort.Strings(changed)
	return changed
}

// Git is the checkout a run came from, if any.
type Git struct {
	Commit string `json:"commit,omitempty"`
	// Dirty: tracked files differ from the commit. Untracked files alone
	// (say, a results directory inside the checkout) do not make it dirty.
	Dirty     bool `json:"dirty"`
	Untracked bool `json:"untracked,omitempty"`
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
	Seconds      float64        `json:"duration_seconds"`       // the job's own time on its worker (last attempt)
	WallSeconds  float64        `json:"wall_seconds,omitempty"` // worker start-ups and failed attempts included
	// KernelsDigest names the kernels_py sources the job ran on (Manifest.KernelsDigest).
	KernelsDigest string         `json:"kernels_digest,omitempty"`
	Metrics       map[string]any `json:"metrics,omitempty"`
	Extra         map[string]any `json:"extra,omitempty"` // non-scalar outputs (per-layer lists, ...)
	Finished      time.Time      `json:"finished"`
}

const (
	StatusOK     = "ok"
	StatusFailed = "failed"
)

// Run is an open run directory.
type Run struct {
	Dir      string
	mu       sync.Mutex
	lock     *flock.Flock
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

// RunDir is where Create puts the run of m under root.
func RunDir(root string, m Manifest) (string, error) {
	if !safeName.MatchString(m.Experiment) || !safeName.MatchString(m.RunID) {
		return "", fmt.Errorf("experiment %q / run id %q: want letters, digits, '.', '_' or '-'", m.Experiment, m.RunID)
	}
	return filepath.Join(root, m.Experiment, m.RunID), nil
}

// Create makes root/<experiment>/<run-id>/, locks it and writes its
// manifest. The lock is taken before the manifest exists, so no other
// process can resume the run before this one lets go of it.
func Create(root string, m Manifest) (*Run, error) {
	dir, err := RunDir(root, m)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(dir, TensorsDir), 0o755); err != nil {
		return nil, fmt.Errorf("create run directory: %w", err)
	}
	lock, err := lockDir(dir)
	if err != nil {
		return nil, err
	}
	if IsRun(dir) {
		// Two runs started in the same second whose ids also drew the same
		// random suffix (a cluster's many hosts on one results root): the
		// second would rewrite the first's manifest and add to its journal.
		lock.Unlock()
		return nil, fmt.Errorf("create run %s: the directory already holds a run; start again for a new run id, or --resume it", dir)
	}
	r := &Run{Dir: dir, manifest: m, lock: lock}
	if err := removeTemps(dir); err != nil {
		lock.Unlock()
		return nil, err
	}
	if err := r.writeManifest(); err != nil {
		lock.Unlock()
		return nil, err
	}
	if err := r.openJournal(); err != nil {
		lock.Unlock()
		return nil, err
	}
	return r, nil
}

// Latest returns the newest run directory of an experiment under root, or
// "". A run counts once it has a manifest or a journal.
func Latest(root, experiment string) (string, error) {
	runs, err := Runs(filepath.Join(root, experiment))
	if err != nil || len(runs) == 0 {
		return "", err
	}
	return runs[len(runs)-1], nil
}

// Runs lists the run directories in an experiment's folder, oldest first
// by when each started (see runStarted): a run copied or renamed to a name
// of its own ("baseline") is not taken for the newest, which --resume would
// write into; none when the folder does not exist.
func Runs(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var runs []string
	for _, e := range entries {
		run := filepath.Join(dir, e.Name())
		if e.IsDir() && IsRun(run) {
			runs = append(runs, run)
		}
	}
	started := make(map[string]time.Time, len(runs))
	for _, run := range runs {
		started[run] = runStarted(run)
	}
	sort.Slice(runs, func(i, j int) bool {
		if a, b := started[runs[i]], started[runs[j]]; !a.Equal(b) {
			return a.Before(b)
		}
		return runs[i] < runs[j]
	})
	return runs, nil
}

// runIDTime is the layout of the time a run id starts with (NewRunID).
const runIDTime = "20060102-150405"

// runStarted is when the run in dir started: the time its directory's name
// holds as a run id does, else its manifest's start (a manifest rebuilt
// from the journal dates the run by its first row, so the name goes first);
// the zero time when neither says.
func runStarted(dir string) time.Time {
	if name := filepath.Base(dir); len(name) >= len(runIDTime) {
		if t, err := time.Parse(runIDTime, name[:len(runIDTime)]); err == nil {
			return t
		}
	}
	if m, err := ReadManifest(dir); err == nil {
		return m.Started
	}
	return time.Time{}
}

// IsRun says whether dir holds a run: a manifest or a journal.
func IsRun(dir string) bool {
	return fileExists(filepath.Join(dir, ManifestFile)) || fileExists(filepath.Join(dir, JournalFile))
}

// Open locks an existing run to resume it (a *LockedError when another
// process writes it). A line torn by a crash at the end of the journal is
// cut off, so new lines start clean, and the temporary files of a rewrite
// that a crash interrupted are removed. A lost manifest is rebuilt from the
// journal (Manifest.Rebuilt says so).
func Open(dir string) (*Run, error) {
	lock, err := lockDir(dir)
	if err != nil {
		return nil, err
	}
	r := &Run{Dir: dir, lock: lock}
	if err := r.open(); err != nil {
		lock.Unlock()
		return nil, err
	}
	return r, nil
}

func (r *Run) open() error {
	if err := removeTemps(r.Dir); err != nil {
		return err
	}
	if err := truncateTornLine(filepath.Join(r.Dir, JournalFile)); err != nil {
		return err
	}
	data, err := os.ReadFile(filepath.Join(r.Dir, ManifestFile))
	switch {
	case errors.Is(err, os.ErrNotExist):
		if r.manifest, err = rebuildManifest(r.Dir); err != nil {
			return err
		}
		if err := r.writeManifest(); err != nil {
			return err
		}
	case err != nil:
		return fmt.Errorf("open run %s: %w", r.Dir, err)
	default:
		if err := json.Unmarshal(data, &r.manifest); err != nil {
			return badManifest(r.Dir, err)
		}
	}
	return r.openJournal()
}

// rebuildManifest recovers what the journal knows of a run whose manifest
// is gone: its experiment and id (from the path), when it started, and the
// sources its newest rows ran on.
func rebuildManifest(dir string) (Manifest, error) {
	recs, err := ReadJournal(dir)
	if err != nil {
		return Manifest{}, err
	}
	if len(recs) == 0 {
		return Manifest{}, fmt.Errorf("open run %s: no %s and an empty journal: nothing to resume; start a new run", dir, ManifestFile)
	}
	// Named from the absolute path: a trailing slash or "." (status given the
	// path as typed) would make the run's id pass for its experiment.
	abs, err := filepath.Abs(dir)
	if err != nil {
		return Manifest{}, fmt.Errorf("open run %s: %w", dir, err)
	}
	now := time.Now()
	m := Manifest{Experiment: filepath.Base(filepath.Dir(abs)), RunID: filepath.Base(abs), Started: recs[0].Finished,
		KernelsDigest: recs[len(recs)-1].KernelsDigest, Versions: map[string]string{}, Rebuilt: &now}
	for _, rec := range recs {
		if rec.Finished.Before(m.Started) {
			m.Started = rec.Finished
		}
	}
	return m, nil
}

func (r *Run) openJournal() error {
	f, err := os.OpenFile(filepath.Join(r.Dir, JournalFile), os.O_CREATE|os.O_APPEND|os.O_RDWR, 0o644) // read: appendLine checks what it cuts
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

// PlanRecord is a run's record of its plan as it stood: its manifest and
// JobsFile, which a resume rewrites. RestorePlanRecord puts it back.
type PlanRecord struct {
	manifest Manifest
	jobs     []byte // nil: the run had no JobsFile
}

// PlanRecord is the run's record of its plan as it stands now.
func (r *Run) PlanRecord() (PlanRecord, error) {
	p := PlanRecord{manifest: r.Manifest()}
	data, err := os.ReadFile(filepath.Join(r.Dir, JobsFile))
	switch {
	case err == nil:
		p.jobs = data
	case !errors.Is(err, os.ErrNotExist):
		return p, err
	}
	return p, nil
}

// RestorePlanRecord puts back the manifest and JobsFile p holds: a resume
// that never ran anything (its array refused) leaves the run as it found it.
func (r *Run) RestorePlanRecord(p PlanRecord) error {
	var err error
	if p.jobs == nil {
		err = os.Remove(filepath.Join(r.Dir, JobsFile))
		if errors.Is(err, os.ErrNotExist) {
			err = nil
		}
	} else {
		err = writeAtomic(filepath.Join(r.Dir, JobsFile), p.jobs)
	}
	if err != nil {
		return fmt.Errorf("restore the plan's jobs: %w", err)
	}
	return r.UpdateManifest(func(m *Manifest) { *m = p.manifest })
}

// WriteJobs records the job ids of the plan this run or resume runs
// (JobsFile), rewriting it atomically.
func (r *Run) WriteJobs(ids []string) error {
	if ids == nil {
		ids = []string{}
	}
	data, err := json.Marshal(ids)
	if err != nil {
		return err
	}
	if err := writeAtomic(filepath.Join(r.Dir, JobsFile), append(data, '\n')); err != nil {
		return fmt.Errorf("record the plan's jobs: %w", err)
	}
	return nil
}

// ReadManifest reads dir's manifest as it stands, without opening the run
// (no lock, nothing written): for reports on runs another process may hold.
func ReadManifest(dir string) (Manifest, error) {
	var m Manifest
	data, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return m, badManifest(dir, err)
	}
	return m, nil
}

// badManifest is a manifest that cannot be read (its writes are atomic, so
// something else damaged it): the journal still has every row, and a run
// without a manifest is opened with one rebuilt from it.
func badManifest(dir string, err error) error {
	return fmt.Errorf("open run %s: %s is not valid JSON (%w); the journal keeps every finished job: "+
		"move the file aside and `workbench status %s` (or --resume) rebuilds it from the journal",
		dir, filepath.Join(dir, ManifestFile), err, dir)
}

// ReadJobs returns the job ids of the plan the run's newest run or resume
// ran, as a set; nil when the run does not record them (a run from before
// it did).
func ReadJobs(dir string) (map[string]bool, error) {
	data, err := os.ReadFile(filepath.Join(dir, JobsFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var ids []string
	if err := json.Unmarshal(data, &ids); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, JobsFile), err)
	}
	set := make(map[string]bool, len(ids))
	for _, id := range ids {
		set[id] = true
	}
	return set, nil
}

// Tally counts a run's rows (the last record of each job) against the plan
// of one run or resume.
type Tally struct {
	Done         int // jobs of the plan with a row
	Failed       int // of those, rows that failed
	FailedBefore int // of Failed, rows not journaled by the call counting
	// Unplanned counts rows of jobs not in the plan (an earlier script's),
	// UnplannedFailed those of them that failed.
	Unplanned, UnplannedFailed int
}

// Count tallies rows (by job id) against plan's job ids; ranNow names the
// jobs the caller journaled itself (nil: none).
func Count(rows map[string]Record, plan map[string]bool, ranNow map[string]bool) Tally {
	var t Tally
	for id, rec := range rows {
		failed := rec.Status != StatusOK
		switch {
		case !plan[id]:
			t.Unplanned++
			if failed {
				t.UnplannedFailed++
			}
		case failed:
			t.Done++
			t.Failed++
			if !ranNow[id] {
				t.FailedBefore++
			}
		default:
			t.Done++
		}
	}
	return t
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
	if err := appendLine(r.journal, line); err != nil {
		return fmt.Errorf("journal job %s: %w", rec.JobID, err)
	}
	return nil
}

// appendLine appends line and a newline to f, opened for reading and
// appending, and fsyncs it. A write that fails part way (a full disk) is
// cut off again: left in place, the next line would be glued to it, and the
// journal would hold a bad line before good ones, which no reader gets past.
func appendLine(f *os.File, line []byte) error {
	line = append(line, '\n')
	n, err := f.Write(line)
	if err != nil {
		if n > 0 && !cutPartial(f, line[:n]) {
			return fmt.Errorf("%w; the partial line could not be cut off (a reopen cuts it if it is the last)", err)
		}
		return err
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("fsync: %w", err)
	}
	return nil
}

// cutPartial truncates f by the partial bytes a failed write appended, if
// they are still its end: a task attempt writing the same segment may have
// appended a whole line after them, which must stay.
func cutPartial(f *os.File, partial []byte) bool {
	st, err := f.Stat()
	if err != nil || st.Size() < int64(len(partial)) {
		return false
	}
	at := st.Size() - int64(len(partial))
	tail := make([]byte, len(partial))
	if _, err := f.ReadAt(tail, at); err != nil || !bytes.Equal(tail, partial) {
		return false
	}
	return f.Truncate(at) == nil
}

// Close closes the journal and lets go of the run directory.
func (r *Run) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	err := r.journal.Close()
	if r.lock != nil {
		r.lock.Unlock()
	}
	return err
}

// RemoveEmpty closes the run and removes its directory when it holds only
// what Create wrote (manifest, plan ids, an empty journal and tensors
// folder, its lock): a run that never got to run anything, which a later
// run would take for an unfinished one. A run holding anything else (a
// row, a tensor, a file of another writer) stays open and as it is, and
// RemoveEmpty says so with false.
func (r *Run) RemoveEmpty() (bool, error) {
	entries, err := os.ReadDir(r.Dir)
	if err != nil {
		return false, err
	}
	for _, e := range entries {
		switch e.Name() {
		case ManifestFile, JobsFile, LockFile:
			continue
		case JournalFile:
			if info, err := e.Info(); err == nil && info.Size() == 0 {
				continue
			}
		case TensorsDir:
			if inner, err := os.ReadDir(filepath.Join(r.Dir, e.Name())); err == nil && len(inner) == 0 {
				continue
			}
		}
		return false, nil
	}
	// Under the lock, so no resume opens the run while it goes; the
	// manifest first, so a reader never finds a run half removed.
	for _, name := range []string{ManifestFile, JournalFile, JobsFile, TensorsDir, LockFile} {
		if err := os.Remove(filepath.Join(r.Dir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return false, err
		}
	}
	if err := r.Close(); err != nil {
		return false, err
	}
	return true, os.Remove(r.Dir)
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
	// Split in memory, with no bound on a line's length: Append writes
	// records of any size (a job's per-layer lists), and a line the reader
	// refused would make the whole run unreadable.
	lines := bytes.Split(data, []byte("\n"))
	var recs []Record
	for i, line := range lines {
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var rec Record
		if err := json.Unmarshal(line, &rec); err != nil {
			if i == len(lines)-1 { // last line, no newline after it: torn
				break
			}
			return nil, fmt.Errorf("%s line %d: %w", filepath.Join(dir, JournalFile), i+1, err)
		}
		recs = append(recs, rec)
	}
	return recs, nil
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

// tempPattern names the temporary file that writeAtomic renames onto
// base: hidden, so that a reader of the directory (a dataset reader skips
// names starting with a dot) never takes it for the file itself.
func tempPattern(base string) string { return "." + base + ".tmp-*" }

// removeTemps removes what rewrites of the manifest or the table left
// behind when their process was killed before the rename; only the writer
// holding the run's lock may call it, as no other rewrite can be under way.
// Earlier versions named them without the leading dot.
func removeTemps(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("open run %s: %w", dir, err)
	}
	for _, e := range entries {
		for _, base := range []string{ManifestFile, ParquetFile, JobsFile} {
			name := e.Name()
			if !strings.HasPrefix(name, "."+base+".tmp-") && !strings.HasPrefix(name, base+".tmp-") {
				continue
			}
			if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("remove %s, left by an interrupted write: %w", filepath.Join(dir, name), err)
			}
		}
	}
	return nil
}

func writeAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), tempPattern(filepath.Base(path)))
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
