package results

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/parquet-go/parquet-go"
	"golang.org/x/sys/unix"
)

func newRun(t *testing.T) *Run {
	t.Helper()
	r, err := Create(t.TempDir(), Manifest{Experiment: "quick", RunID: NewRunID(time.Now()), File: "x.star", Jobs: 3, Started: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func rec(id string, status string, metrics map[string]any) Record {
	return Record{JobID: id, Experiment: "quick", Method: "h2o", Params: map[string]any{"budget": 0.25},
		Workload: map[string]any{"seed": float64(0), "dtype": "float32"}, Status: status, Attempts: 1, Seconds: 1.5,
		Metrics: metrics, Finished: time.Unix(1700000000, 0)}
}

func TestJournalRoundTripAndTornLine(t *testing.T) {
	r := newRun(t)
	for _, id := range []string{"a", "b"} {
		if err := r.Append(rec(id, StatusOK, map[string]any{"rel_err_mean": 0.1})); err != nil {
			t.Fatal(err)
		}
	}
	r.Close()
	// A crash mid-write leaves half a line.
	f, _ := os.OpenFile(filepath.Join(r.Dir, JournalFile), os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString(`{"job_id":"c","status":"o`)
	f.Close()
	recs, err := ReadJournal(r.Dir)
	if err != nil || len(recs) != 2 || recs[1].JobID != "b" {
		t.Fatalf("read %d records, %v", len(recs), err)
	}
	r2, err := Open(r.Dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if err := r2.Append(rec("c", StatusFailed, nil)); err != nil {
		t.Fatal(err)
	}
	done, err := Finished(r.Dir)
	if err != nil || len(done) != 3 || done["c"].Status != StatusFailed {
		t.Fatalf("after resume: %v, %v", done, err)
	}
	// A corrupt line that is not the last one is an error, not silently skipped.
	data, _ := os.ReadFile(filepath.Join(r.Dir, JournalFile))
	os.WriteFile(filepath.Join(r.Dir, JournalFile), append([]byte("garbage\n"), data...), 0o644)
	if _, err := ReadJournal(r.Dir); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Errorf("corrupt first line: %v", err)
	}
}

func TestCreateRejectsUnsafeNames(t *testing.T) {
	for _, m := range []Manifest{{Experiment: "../x", RunID: "r"}, {Experiment: "x", RunID: "a/b"}, {Experiment: "", RunID: "r"}} {
		if _, err := Create(t.TempDir(), m); err == nil {
			t.Errorf("accepted %+v", m)
		}
	}
}

func TestLatest(t *testing.T) {
	root := t.TempDir()
	if dir, err := Latest(root, "quick"); dir != "" || err != nil {
		t.Fatalf("empty root: %q %v", dir, err)
	}
	for _, id := range []string{"20261101-000000-aaaaaa", "20261102-000000-bbbbbb"} {
		r, err := Create(root, Manifest{Experiment: "quick", RunID: id})
		if err != nil {
			t.Fatal(err)
		}
		r.Close()
	}
	os.MkdirAll(filepath.Join(root, "quick", "zzz-not-a-run"), 0o755)
	if dir, _ := Latest(root, "quick"); filepath.Base(dir) != "20261102-000000-bbbbbb" {
		t.Errorf("latest = %s", dir)
	}
}

func TestManifestUpdate(t *testing.T) {
	r := newRun(t)
	end := time.Now()
	if err := r.UpdateManifest(func(m *Manifest) { m.Ended = &end }); err != nil {
		t.Fatal(err)
	}
	r.Close()
	r2, err := Open(r.Dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if m := r2.Manifest(); m.Ended == nil || m.Experiment != "quick" || m.Jobs != 3 {
		t.Errorf("reopened manifest %+v", m)
	}
}

func TestBuildParquet(t *testing.T) {
	r := newRun(t)
	r.Append(rec("a", StatusOK, map[string]any{"rel_err_mean": 0.1, "cache_bytes": float64(1024)}))
	failed := rec("b", StatusFailed, nil)
	failed.Error = "ValueError: boom"
	r.Append(failed)
	retried := rec("b", StatusOK, map[string]any{"rel_err_mean": 0.2, "cache_bytes": 2048.5})
	retried.Extra = map[string]any{"per_layer_rel_err": []any{0.1, 0.3}}
	r.Append(retried) // a resumed run journaled b again: the last record wins
	f, data := buildAndOpen(t, r.Dir, 2)
	var names []string
	for _, c := range f.Schema().Fields() {
		names = append(names, c.Name())
	}
	got := strings.Join(names, ",")
	for _, want := range []string{"job_id", "status", "param_budget", "workload_dtype", "metric_rel_err_mean", "metric_cache_bytes", "extra_per_layer_rel_err"} {
		if !strings.Contains(got, want) {
			t.Errorf("columns %s lack %s", got, want)
		}
	}
	if f.NumRows() != 2 {
		t.Fatalf("%d rows", f.NumRows())
	}
	reader := parquet.NewReader(bytes.NewReader(data))
	defer reader.Close()
	rows := map[string]map[string]any{}
	for i := 0; i < 2; i++ {
		row := map[string]any{}
		if err := reader.Read(&row); err != nil {
			t.Fatal(err)
		}
		rows[row["job_id"].(string)] = row
	}
	if rows["b"]["status"] != "ok" || rows["b"]["metric_cache_bytes"] != 2048.5 || rows["a"]["metric_cache_bytes"] != 1024.0 {
		t.Errorf("rows %v", rows)
	}
	if rows["b"]["extra_per_layer_rel_err"] != "[0.1,0.3]" {
		t.Errorf("list column %v", rows["b"]["extra_per_layer_rel_err"])
	}
}

// Zero values are values: an error of exactly 0, a count of 0, false, "" must
// not come back as missing.
func TestBuildParquetKeepsZeroValues(t *testing.T) {
	r := newRun(t)
	zero := rec("z", StatusOK, map[string]any{"rel_err_mean": float64(0), "kept": float64(0), "exact": false, "note": ""})
	zero.Params = map[string]any{"budget": float64(0), "scoring": ""}
	r.Append(zero)
	r.Append(rec("n", StatusOK, map[string]any{"rel_err_mean": 0.5, "kept": float64(3), "exact": true, "note": "x"}))
	if _, err := BuildParquet(r.Dir); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(r.Dir, ParquetFile))
	if err != nil {
		t.Fatal(err)
	}
	reader := parquet.NewReader(bytes.NewReader(data))
	defer reader.Close()
	for i := 0; i < 2; i++ {
		row := map[string]any{}
		if err := reader.Read(&row); err != nil {
			t.Fatal(err)
		}
		if row["job_id"] != "z" {
			continue
		}
		want := map[string]any{"metric_rel_err_mean": 0.0, "metric_kept": int64(0), "metric_exact": false,
			"metric_note": "", "param_budget": 0.0, "param_scoring": ""}
		for k, v := range want {
			if row[k] != v {
				t.Errorf("%s = %#v, want %#v", k, row[k], v)
			}
		}
		return
	}
	t.Fatal("row z not found")
}

// One writer per run directory: a second Open is refused, naming the PID
// that holds it, until the first closes.
func TestRunDirectoryLock(t *testing.T) {
	r := newRun(t)
	_, err := Open(r.Dir)
	var le *LockedError
	if !errors.As(err, &le) || le.Holder.PID != os.Getpid() || !strings.Contains(err.Error(), fmt.Sprintf("workbench process %d", os.Getpid())) {
		t.Fatalf("second writer: %v", err)
	}
	r.Close()
	r2, err := Open(r.Dir)
	if err != nil {
		t.Fatalf("after the first writer closed: %v", err)
	}
	r2.Close()
}

// A run whose manifest.json is lost still counts as a run, and opening it
// rebuilds the manifest from its journal rather than starting over, however
// the run's path is written (status passes it on as typed).
func TestOpenRebuildsALostManifest(t *testing.T) {
	for _, tc := range []struct {
		name string
		path func(dir string) string // how the run is named to Open
		wd   func(dir string) string // where Open runs; "" the test's directory
	}{
		{"absolute", func(dir string) string { return dir }, nil},
		{"trailing slash", func(dir string) string { return dir + "/" }, nil},
		{"the run's own folder", func(string) string { return "." }, func(dir string) string { return dir }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRun(t)
			first := rec("a", StatusOK, map[string]any{"x": 1.0})
			first.KernelsDigest = "abc"
			r.Append(first)
			r.Close()
			os.Remove(filepath.Join(r.Dir, ManifestFile))
			root := filepath.Dir(filepath.Dir(r.Dir))
			if dir, _ := Latest(root, "quick"); dir != r.Dir {
				t.Fatalf("latest = %q, want the run without a manifest %q", dir, r.Dir)
			}
			if tc.wd != nil {
				t.Chdir(tc.wd(r.Dir))
			}
			r2, err := Open(tc.path(r.Dir))
			if err != nil {
				t.Fatal(err)
			}
			defer r2.Close()
			m := r2.Manifest()
			if m.Rebuilt == nil || m.Experiment != "quick" || m.RunID != filepath.Base(r.Dir) || m.KernelsDigest != "abc" || !m.Started.Equal(first.Finished) {
				t.Errorf("rebuilt manifest %+v", m)
			}
			if _, err := os.Stat(filepath.Join(r.Dir, ManifestFile)); err != nil {
				t.Error("the rebuilt manifest was not written")
			}
		})
	}
}

func TestKernelsDigestAndChangedFiles(t *testing.T) {
	a := map[string]string{"x.py": "1", "y.py": "2"}
	b := map[string]string{"y.py": "2", "x.py": "1"}
	if KernelsDigest(a) != KernelsDigest(b) || len(KernelsDigest(a)) != 64 {
		t.Error("digest depends on map order or is not a sha256")
	}
	c := map[string]string{"x.py": "3", "z.py": "4"}
	if KernelsDigest(a) == KernelsDigest(c) {
		t.Error("different sources, same digest")
	}
	if got := ChangedFiles(a, c); strings.Join(got, ",") != "x.py,y.py,z.py" {
		t.Errorf("changed %v", got)
	}
}

// Tasks' segments are merged into the journal once each, however often the
// merge runs, and a line still being written waits for its newline.
func TestSegmentsMergeOnce(t *testing.T) {
	dir := t.TempDir()
	run, err := Create(dir, Manifest{Experiment: "e", RunID: "r"})
	if err != nil {
		t.Fatal(err)
	}
	defer run.Close()
	seg, err := CreateSegment(run.Dir, SegmentName("sub", 0))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	seg.Append(Record{JobID: "a", Status: StatusOK, Finished: now})
	merger, err := run.NewMerger()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := merger.Merge(); err != nil || len(got) != 1 {
		t.Fatalf("first merge: %v, %v", got, err)
	}
	// Half a line: not merged until complete.
	f, _ := os.OpenFile(SegmentPath(run.Dir, SegmentName("sub", 0)), os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString(`{"job_id":"b","status":"ok"`)
	if got, _ := merger.Merge(); len(got) != 0 {
		t.Fatalf("merged a torn line: %v", got)
	}
	f.WriteString(`,"finished":"` + now.Format(time.RFC3339Nano) + `"}` + "\n")
	f.Close()
	if got, _ := merger.Merge(); len(got) != 1 || got[0].JobID != "b" {
		t.Fatalf("second merge: %v", got)
	}
	// A new merger (a resumed host) merges nothing twice.
	again, _ := run.NewMerger()
	if got, _ := again.Merge(); len(got) != 0 {
		t.Fatalf("merged again: %v", got)
	}
	recs, _ := ReadJournal(run.Dir)
	if len(recs) != 2 {
		t.Fatalf("journal has %d records", len(recs))
	}
}

// A writer killed between creating a temporary file and renaming it leaves
// the file behind; opening the run for writing removes what such rewrites
// left (of this and earlier versions' naming), and nothing else.
func TestOpenRemovesInterruptedWrites(t *testing.T) {
	r := newRun(t)
	if _, err := BuildParquet(r.Dir); err != nil {
		t.Fatal(err)
	}
	r.Close()
	stale := []string{".manifest.json.tmp-123", ".results.parquet.tmp-456", "manifest.json.tmp-789", "results.parquet.tmp-1"}
	kept := []string{"notes.tmp-1", "results.parquet.bak"}
	for _, name := range append(stale, kept...) {
		if err := os.WriteFile(filepath.Join(r.Dir, name), []byte("partial"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	r2, err := Open(r.Dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	for _, name := range stale {
		if _, err := os.Stat(filepath.Join(r.Dir, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: %v; want it removed", name, err)
		}
	}
	for _, name := range append(kept, ManifestFile, ParquetFile, JournalFile) {
		if _, err := os.Stat(filepath.Join(r.Dir, name)); err != nil {
			t.Errorf("%s: %v; want it kept", name, err)
		}
	}
}

// Count tallies the last record of each job against a plan: failures
// whenever they ran, those from before the caller's own, and rows of jobs
// the plan lacks.
func TestCount(t *testing.T) {
	rec := func(id, status string) Record { return Record{JobID: id, Status: status} }
	rows := map[string]Record{"a": rec("a", StatusOK), "b": rec("b", StatusFailed), "c": rec("c", StatusFailed), "x": rec("x", StatusFailed)}
	tests := []struct {
		name   string
		plan   []string
		ranNow []string
		want   Tally
	}{
		{"every row planned, all run now", []string{"a", "b", "c", "x"}, []string{"a", "b", "c", "x"}, Tally{Done: 4, Failed: 3}},
		{"failures from before", []string{"a", "b", "c", "x"}, []string{"a", "c"}, Tally{Done: 4, Failed: 3, FailedBefore: 2}},
		{"rows of another plan", []string{"a", "b", "d"}, nil, Tally{Done: 2, Failed: 1, FailedBefore: 1, Unplanned: 2, UnplannedFailed: 2}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			set := func(ids []string) map[string]bool {
				m := map[string]bool{}
				for _, id := range ids {
					m[id] = true
				}
				return m
			}
			if got := Count(rows, set(tc.plan), set(tc.ranNow)); got != tc.want {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

// Runs lists an experiment's runs oldest first; Latest is the last.
func TestRunsAndLatest(t *testing.T) {
	root := t.TempDir()
	exp := filepath.Join(root, "exp")
	for _, name := range []string{"20260102-000000-bbbbbb", "20260101-000000-aaaaaa", "not-a-run"} {
		os.MkdirAll(filepath.Join(exp, name), 0o755)
		if name != "not-a-run" {
			os.WriteFile(filepath.Join(exp, name, JournalFile), nil, 0o644)
		}
	}
	runs, err := Runs(exp)
	want := []string{filepath.Join(exp, "20260101-000000-aaaaaa"), filepath.Join(exp, "20260102-000000-bbbbbb")}
	if err != nil || fmt.Sprint(runs) != fmt.Sprint(want) {
		t.Errorf("runs %v, %v; want %v", runs, err, want)
	}
	if latest, err := Latest(root, "exp"); err != nil || latest != want[1] {
		t.Errorf("latest %q, %v", latest, err)
	}
	if runs, err := Runs(filepath.Join(root, "none")); err != nil || runs != nil {
		t.Errorf("no folder: %v, %v", runs, err)
	}
}

// Runs orders runs by when they started, so a run copied or renamed to a
// name of its own is not the newest for --resume and status to take.
func TestRunsOrderByStart(t *testing.T) {
	day := func(d int) time.Time { return time.Date(2026, 1, d, 0, 0, 0, 0, time.UTC) }
	tests := []struct {
		name string
		runs map[string]time.Time // run directory name: its manifest's start (zero: no manifest, a journal only)
		want []string
	}{
		{"run ids", map[string]time.Time{"20260102-000000-bbbbbb": day(2), "20260101-000000-aaaaaa": day(1)},
			[]string{"20260101-000000-aaaaaa", "20260102-000000-bbbbbb"}},
		{"a copy of an older run named by hand", map[string]time.Time{"20260101-000000-aaaaaa": day(1),
			"baseline": day(1), "20260102-000000-bbbbbb": day(2)},
			[]string{"20260101-000000-aaaaaa", "baseline", "20260102-000000-bbbbbb"}},
		{"a renamed run that started last", map[string]time.Time{"20260101-000000-aaaaaa": day(1), "mine": day(3)},
			[]string{"20260101-000000-aaaaaa", "mine"}},
		{"a journal only, dated by its run id", map[string]time.Time{"20260103-000000-cccccc": {},
			"20260102-000000-bbbbbb": day(2), "old": day(1)},
			[]string{"old", "20260102-000000-bbbbbb", "20260103-000000-cccccc"}},
		{"a manifest rebuilt from the journal, dated by its first row", map[string]time.Time{
			"20260101-000000-aaaaaa": day(3), "20260102-000000-bbbbbb": day(2)},
			[]string{"20260101-000000-aaaaaa", "20260102-000000-bbbbbb"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			exp := filepath.Join(root, "exp")
			for name, started := range tc.runs {
				dir := filepath.Join(exp, name)
				if err := os.MkdirAll(dir, 0o755); err != nil {
					t.Fatal(err)
				}
				file, data := JournalFile, []byte{}
				if !started.IsZero() {
					m, err := json.Marshal(Manifest{Experiment: "exp", RunID: name, Started: started})
					if err != nil {
						t.Fatal(err)
					}
					file, data = ManifestFile, m
				}
				if err := os.WriteFile(filepath.Join(dir, file), data, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			var want []string
			for _, name := range tc.want {
				want = append(want, filepath.Join(exp, name))
			}
			if runs, err := Runs(exp); err != nil || fmt.Sprint(runs) != fmt.Sprint(want) {
				t.Errorf("runs %v, %v; want %v", runs, err, want)
			}
			if latest, err := Latest(root, "exp"); err != nil || latest != want[len(want)-1] {
				t.Errorf("latest %q, %v; want %q", latest, err, want[len(want)-1])
			}
		})
	}
}

// RemoveEmpty removes only a run that holds what Create wrote: never one
// with a row, a tensor or another writer's file.
func TestRemoveEmpty(t *testing.T) {
	tests := []struct {
		name    string
		add     func(r *Run) error
		removed bool
	}{
		{"as created", func(r *Run) error { return r.WriteJobs([]string{"a"}) }, true},
		{"a row", func(r *Run) error { return r.Append(Record{JobID: "a", Status: StatusOK}) }, false},
		{"a tensor", func(r *Run) error {
			os.MkdirAll(filepath.Join(r.Dir, TensorsDir, "a"), 0o755)
			return os.WriteFile(filepath.Join(r.Dir, TensorsDir, "a", "k.npy"), []byte("x"), 0o644)
		}, false},
		{"a segment", func(r *Run) error {
			s, err := CreateSegment(r.Dir, SegmentName("s", 0))
			if err != nil {
				return err
			}
			return s.Close()
		}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			r, err := Create(root, Manifest{Experiment: "e", RunID: "r"})
			if err != nil {
				t.Fatal(err)
			}
			if err := tc.add(r); err != nil {
				t.Fatal(err)
			}
			removed, err := r.RemoveEmpty()
			if err != nil || removed != tc.removed {
				t.Fatalf("RemoveEmpty = %v, %v; want %v", removed, err, tc.removed)
			}
			_, statErr := os.Stat(r.Dir)
			if gone := errors.Is(statErr, os.ErrNotExist); gone != tc.removed {
				t.Errorf("run directory gone: %v, want %v", gone, tc.removed)
			}
			if !tc.removed { // kept, and still the writer's
				if err := r.Append(Record{JobID: "b", Status: StatusOK}); err != nil {
					t.Errorf("a kept run cannot be written: %v", err)
				}
				r.Close()
			}
		})
	}
}

// A run copied as its table reads back as its journal's last records.
func TestReadParquet(t *testing.T) {
	r := newRun(t)
	r.Append(rec("a", StatusOK, map[string]any{"rel_err_mean": 0.1, "cache_bytes": float64(1024)}))
	r.Append(rec("b", StatusFailed, map[string]any{"rel_err_mean": nil}))
	if _, err := BuildParquet(r.Dir); err != nil {
		t.Fatal(err)
	}
	recs, err := ReadParquet(r.Dir)
	if err != nil || len(recs) != 2 {
		t.Fatalf("%+v %v", recs, err)
	}
	a, b := recs[0], recs[1]
	if a.JobID != "a" || a.Status != StatusOK || a.Metrics["rel_err_mean"] != 0.1 || a.Metrics["cache_bytes"] != 1024.0 ||
		b.Status != StatusFailed || b.Metrics["rel_err_mean"] != nil {
		t.Errorf("%+v", recs)
	}
	if recs, err := ReadParquet(t.TempDir()); recs != nil || err != nil {
		t.Errorf("no table: %v %v", recs, err)
	}
}

// A run interrupted before its first job finished gets a table with the
// columns every row has and no rows, not a table without columns, which
// readers selecting rows by status or job id fail on.
func TestBuildParquetWithoutRowsHasTheFixedColumns(t *testing.T) {
	r := newRun(t)
	f, _ := buildAndOpen(t, r.Dir, 0)
	kinds := map[string]string{}
	for _, c := range f.Schema().Fields() {
		kinds[c.Name()] = c.Type().Kind().String()
	}
	for name, want := range map[string]string{"job_id": "BYTE_ARRAY", "experiment": "BYTE_ARRAY", "method": "BYTE_ARRAY",
		"status": "BYTE_ARRAY", "attempts": "INT64", "duration_seconds": "DOUBLE", "finished": "BYTE_ARRAY"} {
		if kinds[name] != want {
			t.Errorf("column %s: %q, want %q (columns %v)", name, kinds[name], want, kinds)
		}
	}
	if f.NumRows() != 0 {
		t.Errorf("%d rows", f.NumRows())
	}
	recs, err := ReadParquet(r.Dir)
	if err != nil || len(recs) != 0 {
		t.Errorf("ReadParquet: %v, %v", recs, err)
	}
}

// A damaged manifest names the file and what to do; moving it aside opens
// the run with one rebuilt from the journal, every row kept.
func TestDamagedManifestSaysHowToRecover(t *testing.T) {
	r := newRun(t)
	r.Append(rec("a", StatusOK, map[string]any{"x": 1.0}))
	dir := r.Dir
	r.Close()
	path := filepath.Join(dir, ManifestFile)
	if err := os.WriteFile(path, []byte(`{"experiment": "qu`), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, open := range map[string]func() error{
		"Open": func() error {
			r, err := Open(dir)
			if err == nil {
				r.Close()
			}
			return err
		},
		"ReadManifest": func() error { _, err := ReadManifest(dir); return err },
	} {
		err := open()
		if err == nil || !strings.Contains(err.Error(), path+" is not valid JSON") ||
			!strings.Contains(err.Error(), "move the file aside and `workbench status "+dir+"` (or --resume) rebuilds it from the journal") {
			t.Errorf("%s: %v", name, err)
		}
	}
	if err := os.Rename(path, path+".damaged"); err != nil {
		t.Fatal(err)
	}
	again, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if m := again.Manifest(); m.Rebuilt == nil || m.Experiment != filepath.Base(filepath.Dir(dir)) {
		t.Errorf("manifest %+v, want one rebuilt from the journal", m)
	}
	if done, err := Finished(dir); err != nil || len(done) != 1 {
		t.Errorf("rows %v, %v", done, err)
	}
}

// buildAndOpen builds the run's results.parquet, which must hold rows rows,
// and returns it opened, and its bytes.
func buildAndOpen(t *testing.T, dir string, rows int) (*parquet.File, []byte) {
	t.Helper()
	n, err := BuildParquet(dir)
	if err != nil || n != rows {
		t.Fatalf("rows %d (want %d), %v", n, rows, err)
	}
	data, err := os.ReadFile(filepath.Join(dir, ParquetFile))
	if err != nil {
		t.Fatal(err)
	}
	f, err := parquet.OpenFile(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	return f, data
}

// A journal line that fails part way (a full disk; here the file size
// limit) is cut off again, so the next line starts clean and the journal
// stays readable, in the run's journal and in a task's segment alike.
func TestAppendCutsOffAFailedWrite(t *testing.T) {
	r := newRun(t)
	seg, err := CreateSegment(r.Dir, SegmentName("sub", 0))
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	for _, tc := range []struct {
		name   string
		path   string
		append func(Record) error
		read   func() ([]Record, error)
	}{
		{"journal", filepath.Join(r.Dir, JournalFile), r.Append, func() ([]Record, error) { return ReadJournal(r.Dir) }},
		{"segment", SegmentPath(r.Dir, SegmentName("sub", 0)), seg.Append,
			func() ([]Record, error) { return ReadSegment(SegmentPath(r.Dir, SegmentName("sub", 0))) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.append(rec("a", StatusOK, nil)); err != nil {
				t.Fatal(err)
			}
			st, err := os.Stat(tc.path)
			if err != nil {
				t.Fatal(err)
			}
			// The limit lets part of the next line through, then the write fails (EFBIG).
			withFileSizeLimit(t, uint64(st.Size())+10, func() {
				if err := tc.append(rec("b", StatusOK, map[string]any{"x": 1.0})); err == nil {
					t.Fatal("a write past the file size limit succeeded")
				}
			})
			if after, _ := os.Stat(tc.path); after.Size() != st.Size() {
				t.Errorf("the failed line left %d bytes behind", after.Size()-st.Size())
			}
			if err := tc.append(rec("c", StatusOK, nil)); err != nil {
				t.Fatal(err)
			}
			recs, err := tc.read()
			if err != nil || len(recs) != 2 || recs[0].JobID != "a" || recs[1].JobID != "c" {
				t.Fatalf("read %v, %v; want a and c", recs, err)
			}
		})
	}
}

// withFileSizeLimit runs fn with RLIMIT_FSIZE at limit bytes (the Go
// runtime ignores the SIGXFSZ a write past it raises; the write fails).
func withFileSizeLimit(t *testing.T, limit uint64, fn func()) {
	t.Helper()
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_FSIZE, &old); err != nil {
		t.Skip(err)
	}
	if old.Max != unix.RLIM_INFINITY && old.Max < limit {
		t.Skip("file size limit already below the test's")
	}
	if err := unix.Setrlimit(unix.RLIMIT_FSIZE, &unix.Rlimit{Cur: limit, Max: old.Max}); err != nil {
		t.Skip(err)
	}
	defer unix.Setrlimit(unix.RLIMIT_FSIZE, &old)
	fn()
}

// A record of any size that Append writes, ReadJournal reads back: a line
// over a reader's buffer made every later read of the run fail.
func TestJournalReadsLongLines(t *testing.T) {
	r := newRun(t)
	big := rec("a", StatusOK, nil)
	big.Extra = map[string]any{"per_token": strings.Repeat("x", 65<<20)}
	for _, rc := range []Record{big, rec("b", StatusOK, nil)} {
		if err := r.Append(rc); err != nil {
			t.Fatal(err)
		}
	}
	recs, err := ReadJournal(r.Dir)
	if err != nil || len(recs) != 2 || len(recs[0].Extra["per_token"].(string)) != 65<<20 {
		t.Fatalf("read %d records, %v", len(recs), err)
	}
}

// Create never takes over a run directory that already holds a run (a run
// id drawn twice): its manifest and journal stay the first run's.
func TestCreateRefusesAnExistingRun(t *testing.T) {
	root := t.TempDir()
	m := Manifest{Experiment: "quick", RunID: "20260101-000000-abcdef", File: "first.star"}
	r, err := Create(root, m)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Append(rec("a", StatusOK, nil)); err != nil {
		t.Fatal(err)
	}
	r.Close()
	m.File = "second.star"
	if r2, err := Create(root, m); err == nil {
		r2.Close()
		t.Fatal("created a run over an existing one")
	} else if !strings.Contains(err.Error(), "already holds a run") {
		t.Errorf("error %v does not say the directory holds a run", err)
	}
	got, err := ReadManifest(r.Dir)
	if err != nil || got.File != "first.star" {
		t.Errorf("manifest now names %q (%v), want the first run's", got.File, err)
	}
	if recs, err := ReadJournal(r.Dir); err != nil || len(recs) != 1 {
		t.Errorf("journal: %d records, %v", len(recs), err)
	}
	// Its lock was let go: the run can still be resumed.
	r3, err := Open(r.Dir)
	if err != nil {
		t.Fatal(err)
	}
	r3.Close()
}

// cutPartial cuts a failed write's bytes only while they end the file: a
// whole line another writer appended after them stays.
func TestCutPartialKeepsAnotherWritersLine(t *testing.T) {
	for _, tc := range []struct {
		name, content string
		cut           bool
		after         string
	}{
		{"partial at the end", "{\"a\":1}\n{\"b\":", true, "{\"a\":1}\n"},
		{"another line after it", "{\"a\":1}\n{\"b\":{\"c\":3}\n", false, "{\"a\":1}\n{\"b\":{\"c\":3}\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "j.jsonl")
			os.WriteFile(path, []byte(tc.content), 0o644)
			f, err := os.OpenFile(path, os.O_RDWR|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if got := cutPartial(f, []byte("{\"b\":")); got != tc.cut {
				t.Errorf("cut %v, want %v", got, tc.cut)
			}
			if data, _ := os.ReadFile(path); string(data) != tc.after {
				t.Errorf("file holds %q, want %q", data, tc.after)
			}
		})
	}
}
