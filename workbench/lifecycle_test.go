package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/runner"
	"github.com/vlkv/vlkv/gohost/testpy"
)

// planRun writes a run directory holding recs, whose manifest plans jobs
// jobs and, when ids is not nil, records their ids.
func planRun(t *testing.T, dir string, jobs int, ids []string, recs ...results.Record) string {
	t.Helper()
	writeRun(t, dir, recs...)
	manifest, _ := json.Marshal(results.Manifest{Experiment: "sweep", Jobs: jobs})
	if err := os.WriteFile(filepath.Join(dir, results.ManifestFile), manifest, 0o644); err != nil {
		t.Fatal(err)
	}
	if ids != nil {
		data, _ := json.Marshal(ids)
		if err := os.WriteFile(filepath.Join(dir, results.JobsFile), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// status reports a run against the plan of its newest run or resume,
// rebuilds results.parquet for a local run, says who writes a run it
// cannot open, and what a path that is not a run is.
func TestStatusReports(t *testing.T) {
	dir := t.TempDir()
	ok := func(id string) results.Record { return results.Record{JobID: id, Method: "full"} }
	failed := results.Record{JobID: "c", Method: "full", Status: results.StatusFailed, Error: "boom"}
	killed := planRun(t, filepath.Join(dir, "sweep", "20260101-000000-aaaaaa"), 3, []string{"a", "b", "c"}, ok("a"), ok("b"))
	replanned := planRun(t, filepath.Join(dir, "re", "run"), 2, []string{"a", "b"}, ok("a"), ok("b"), failed)
	legacy := planRun(t, filepath.Join(dir, "legacy", "run"), 1, nil, ok("a"), ok("b"))
	locked := planRun(t, filepath.Join(dir, "locked", "run"), 2, []string{"a", "b"}, ok("a"))
	tests := []struct {
		name      string
		dir       string
		code      int
		want      string
		wantTable int // rows of results.parquet afterwards; -1: not checked
	}{
		{"killed local run", killed, 0, killed + ": 2 of 3 jobs done, 0 failed\n", 2},
		{"rows of an earlier script", replanned, 0,
			replanned + ": 2 of 2 jobs done, 0 failed; the run holds 3 rows, 1 not in its latest script's plan (1 of them failed)\n", 3},
		{"no job ids, more rows than jobs", legacy, 0, legacy + ": 2 rows for a plan of 1 job (some are of jobs an earlier script planned), 0 failed\n", 2},
		{"run being written here", locked, 0, fmt.Sprintf("%s is being written by workbench process %d on ", locked, os.Getpid()), -1},
		{"missing path", filepath.Join(dir, "nowhere"), 1, "run directory " + filepath.Join(dir, "nowhere") + " does not exist", -1},
		{"experiment folder", filepath.Join(dir, "sweep"), 1, "is not a run directory but an experiment's folder: give one of its runs:\n  " + killed + " (the newest)", -1},
		{"results root", dir, 1, "is not a run directory but a results root: give a run of one of its experiments, " +
			"OUT/<experiment>/<run-id>; the newest of each:\n  " + legacy + "\n  " + locked + "\n  " + replanned + "\n  " + killed, -1},
	}
	hold, err := results.Open(locked)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := runCLI(t, "status", tc.dir)
			if code != tc.code || !strings.Contains(stdout+stderr, tc.want) || strings.Contains(stdout, "follows the run") {
				t.Errorf("exit %d, want %d with %q:\n%s%s", code, tc.code, tc.want, stdout, stderr)
			}
			if tc.wantTable >= 0 {
				if rows := parquetRows(t, filepath.Join(tc.dir, results.ParquetFile)); len(rows) != tc.wantTable {
					t.Errorf("results.parquet has %d rows, want %d", len(rows), tc.wantTable)
				}
			}
		})
	}
}

// The summary of a run or resume counts the plan's failures whenever they
// ran, and the rows of jobs the plan lacks.
func TestDescribeSummary(t *testing.T) {
	tests := []struct {
		name string
		sum  runner.Summary
		want string
	}{
		{"clean", runner.Summary{Rows: 3, Tally: results.Tally{Done: 3}}, "3 jobs, 0 failed"},
		{"one job", runner.Summary{Rows: 1, Tally: results.Tally{Done: 1, Failed: 1}}, "1 job, 1 failed"},
		{"failure left from before", runner.Summary{Rows: 3, Tally: results.Tally{Done: 3, Failed: 1, FailedBefore: 1}},
			"3 jobs, 1 failed (1 before this resume)"},
		{"rows of another plan", runner.Summary{Rows: 25, Tally: results.Tally{Done: 17, Unplanned: 8, UnplannedFailed: 2}},
			"17 jobs, 0 failed; the run holds 25 rows, 8 not in this script's plan (2 of them failed)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := describeSummary(tc.sum); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

// Messages that say how to go on give the whole command: script, --out,
// the flags given, not those of how this call resumed.
func TestRerunCommand(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"plain", []string{"run", "x.star"}, "workbench run x.star --out results"},
		{"flags", []string{"--python", "/my py", "--device", "cpu", "run", "x.star", "--out", "o", "--experiment", "e",
			"--workers", "2", "--resume", "--retry-failed", "--allow-code-change", "-v"},
			"workbench run x.star --out o --device cpu --experiment e --python '/my py' --workers 2"},
		{"slurm", []string{"run", "x.star", "--executor", "slurm", "--sbatch-line", "--qos=high", "--sbatch-line", "--x=y z", "--detach"},
			"workbench run x.star --out results --executor slurm --sbatch-line --qos=high --sbatch-line '--x=y z'"},
		{"demo", []string{"demo", "--out", "r"}, "workbench demo --out r"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			root := newRootCmd(io.Discard, io.Discard, tc.args)
			cmd, rest, err := root.Find(tc.args)
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.ParseFlags(rest); err != nil {
				t.Fatal(err)
			}
			out, _ := cmd.Flags().GetString("out")
			if got := (&app{prog: "workbench"}).rerunCommand(cmd, cmd.Flags().Args(), out); got != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}

// An interrupted call is continued with the flags it was given to retry
// failed jobs or accept changed code, where the command it printed dropped
// them (the failed jobs it had not reached stayed failed).
func TestContinueCommandKeepsHowTheCallResumed(t *testing.T) {
	tests := []struct {
		o    runOptions
		want string
	}{
		{runOptions{rerun: "workbench run x.star --out o"}, "workbench run x.star --out o --resume"},
		{runOptions{rerun: "workbench run x.star --out o", resume: true}, "workbench run x.star --out o --resume"},
		{runOptions{rerun: "workbench run x.star --out o", resume: true, retryFailed: true},
			"workbench run x.star --out o --resume --retry-failed"},
		{runOptions{rerun: "workbench run x.star --out o", resume: true, retryFailed: true, allowCodeChange: true},
			"workbench run x.star --out o --resume --retry-failed --allow-code-change"},
	}
	for _, tc := range tests {
		if got := tc.o.continueCommand(); got != tc.want {
			t.Errorf("%+v: got %q, want %q", tc.o, got, tc.want)
		}
	}
}

// A resume that leaves a failed job in place fails too, saying how many
// failed before it and the command that runs them again.
func TestResumeCountsEarlierFailures(t *testing.T) {
	py := testpy.Python(t)
	dir := t.TempDir()
	script := filepath.Join(dir, "fails.star")
	// KIVI's group of 128 does not fit 64-token images: the job fails at once.
	os.WriteFile(script, []byte(`experiment(name = "fails", methods = ["kivi"], grid = {"group": [128]},
    workloads = [workload(decode_steps = 4, layers = 2, tokens_per_image = 64)])
`), 0o644)
	out := filepath.Join(dir, "out")
	base := []string{"--python", py, "--device", "cpu", "run", script, "--out", out}
	again := strings.Join([]string{"workbench", "run", shellQuote(script), "--out", shellQuote(out), "--device", "cpu",
		"--python", shellQuote(py), "--resume", "--retry-failed"}, " ")
	tests := []struct {
		name  string
		extra []string
		want  string
	}{
		{"run", nil, "fails: 1 job, 1 failed -> "},
		{"resume", []string{"--resume"}, "fails: 1 job, 1 failed (1 before this resume) -> "},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := runCLI(t, append(base, tc.extra...)...)
			if code != 1 || !strings.Contains(stdout, tc.want) ||
				!strings.Contains(stderr, "1 job failed (see the error column of results.parquet); to run the failed jobs again, once their cause is fixed "+
					"(a bad knob fails the same way again): "+again) {
				t.Errorf("exit %d, want 1 with %q and the command %q:\n%s%s", code, tc.want, again, stdout, stderr)
			}
		})
	}
}

// Before a notebook reads a run, its table is brought in step with its
// journal only where it is behind: a finished run, or a table without a
// journal, is read without a write (a shared results folder may be
// read-only), and a journal behind its table never shrinks it.
func TestSyncForReadingWritesOnlyWhatIsBehind(t *testing.T) {
	ok := func(id string) results.Record { return results.Record{JobID: id, Method: "full"} }
	dir := t.TempDir()
	ended := func(run string) {
		var m results.Manifest
		data, _ := os.ReadFile(filepath.Join(run, results.ManifestFile))
		json.Unmarshal(data, &m)
		now := time.Now()
		m.Ended = &now
		data, _ = json.Marshal(m)
		os.WriteFile(filepath.Join(run, results.ManifestFile), data, 0o644)
	}
	finished := planRun(t, filepath.Join(dir, "finished"), 2, []string{"a", "b"}, ok("a"), ok("b"))
	if _, err := results.BuildParquet(finished); err != nil {
		t.Fatal(err)
	}
	ended(finished)
	tableOnly := planRun(t, filepath.Join(dir, "table-only"), 2, []string{"a", "b"}, ok("a"), ok("b"))
	results.BuildParquet(tableOnly)
	os.Remove(filepath.Join(tableOnly, results.JournalFile))
	shortJournal := planRun(t, filepath.Join(dir, "short-journal"), 2, []string{"a", "b"}, ok("a"), ok("b"))
	results.BuildParquet(shortJournal)
	os.WriteFile(filepath.Join(shortJournal, results.JournalFile), nil, 0o644)
	killed := planRun(t, filepath.Join(dir, "killed"), 3, []string{"a", "b", "c"}, ok("a"), ok("b"))
	results.BuildParquet(killed)
	line, _ := json.Marshal(results.Record{JobID: "c", Method: "full", Status: results.StatusOK})
	f, _ := os.OpenFile(filepath.Join(killed, results.JournalFile), os.O_APPEND|os.O_WRONLY, 0)
	f.Write(append(line, '\n'))
	f.Close()

	tests := []struct {
		name     string
		dir      string
		rows     int
		unopened bool // no lock file made: nothing was opened for writing
	}{
		{"finished run", finished, 2, true},
		{"table without a journal", tableOnly, 2, true},
		{"journal behind its table", shortJournal, 2, false},
		{"killed run, journal ahead", killed, 3, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := &app{stdout: io.Discard, stderr: io.Discard}
			if err := a.syncForReading(tc.dir); err != nil {
				t.Fatal(err)
			}
			rows, _, err := results.ParquetRows(tc.dir)
			if err != nil || rows != tc.rows {
				t.Errorf("results.parquet holds %d rows (%v), want %d", rows, err, tc.rows)
			}
			_, err = os.Stat(filepath.Join(tc.dir, results.LockFile))
			if unopened := os.IsNotExist(err); unopened != tc.unopened {
				t.Errorf("lock file absent: %v, want %v", unopened, tc.unopened)
			}
		})
	}
}

// status on a local run short of its plan, or holding failed jobs, gives the
// command that goes on with it; for a run that is not its experiment's
// newest under the root (--resume would continue another) or one that is
// complete, it gives none.
func TestStatusSaysHowToGoOn(t *testing.T) {
	root := t.TempDir()
	ok := func(id string) results.Record {
		return results.Record{JobID: id, Method: "full", Status: results.StatusOK}
	}
	failed := results.Record{JobID: "b", Method: "full", Status: results.StatusFailed, Error: "boom"}
	withScript := func(dir string) string {
		manifest, _ := json.Marshal(results.Manifest{Experiment: filepath.Base(filepath.Dir(dir)), Jobs: 2, File: "/x/my exp.star"})
		if err := os.WriteFile(filepath.Join(dir, results.ManifestFile), manifest, 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	older := withScript(planRun(t, filepath.Join(root, "sweep", "20260101-000000-aaaaaa"), 2, []string{"a", "b"}, ok("a")))
	short := withScript(planRun(t, filepath.Join(root, "sweep", "20260102-000000-aaaaaa"), 2, []string{"a", "b"}, ok("a")))
	withFailed := withScript(planRun(t, filepath.Join(root, "fails", "20260101-000000-aaaaaa"), 2, []string{"a", "b"}, ok("a"), failed))
	complete := withScript(planRun(t, filepath.Join(root, "done", "20260101-000000-aaaaaa"), 2, []string{"a", "b"}, ok("a"), ok("b")))
	// A run whose journal was lost after its table was built: a resume refuses it.
	lostJournal := withScript(planRun(t, filepath.Join(root, "lost", "20260101-000000-aaaaaa"), 2, []string{"a", "b"}, ok("a")))
	if _, err := results.BuildParquet(lostJournal); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(lostJournal, results.JournalFile)); err != nil {
		t.Fatal(err)
	}
	prog := progName(os.Args[0])
	goOn := "to continue it: " + prog + " run '/x/my exp.star' --experiment sweep --out " + root + " --resume"
	tests := []struct {
		name, wd, dir, want string // wd: the directory status runs in, when not the test's
	}{
		{"short of its plan", "", short, goOn},
		// A shell's completion ends the path with a slash; the run is the same.
		{"trailing slash", "", short + "/", goOn},
		{"the run's own folder", short, ".", goOn},
		{"relative to its experiment's folder", filepath.Dir(short), filepath.Base(short), goOn},
		{"failed jobs", "", withFailed, "to run its failed jobs again, once their cause is fixed: " + prog +
			" run '/x/my exp.star' --experiment fails --out " + root + " --resume --retry-failed"},
		{"not the newest run", "", older, ""},
		{"journal lost", "", lostJournal, "its results.parquet has 1 row but its journal.jsonl only 0 finished jobs: " +
			"the journal was lost or cut short, and a --resume would refuse the run; restore journal.jsonl"},
		{"complete", "", complete, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.wd != "" {
				t.Chdir(tc.wd)
			}
			code, stdout, stderr := runCLI(t, "status", tc.dir)
			if code != 0 {
				t.Fatalf("exit %d: %s", code, stderr)
			}
			if tc.want == "" && strings.Contains(stdout, "--resume") || !strings.Contains(stdout, tc.want) {
				t.Errorf("got %q, want %q", stdout, tc.want)
			}
		})
	}
}

// A run's manifest names its script absolutely, so that status's resume
// command works from any directory; an embedded script keeps its name.
func TestRecordedScriptIsAbsolute(t *testing.T) {
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for file, want := range map[string]string{
		"exp.star":                       filepath.Join(wd, "exp.star"),
		"../experiments/quickstart.star": filepath.Join(filepath.Dir(wd), "experiments", "quickstart.star"),
		"/x/my exp.star":                 "/x/my exp.star",
		"embedded:experiments/demo.star": "embedded:experiments/demo.star",
	} {
		if got := recordedScript(file); got != want {
			t.Errorf("recordedScript(%q) = %q, want %q", file, got, want)
		}
	}
}
