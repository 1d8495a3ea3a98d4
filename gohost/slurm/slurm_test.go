package slurm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/results/resultstest"
	"github.com/vlkv/vlkv/gohost/runner"
	"github.com/vlkv/vlkv/gohost/sched"
)

func TestParseShard(t *testing.T) {
	tests := []struct {
		spec   string
		shards int
		want   int
		err    string
	}{
		{"0", 3, 0, ""},
		{"2", 3, 2, ""},
		{"2/3", 3, 2, ""},
		{"3", 3, 0, "shard 3 is out of range: the plan has 3 shards (0 to 2)"},
		{"-1", 3, 0, "out of range"},
		{"1/4", 3, 0, "the plan has 3 shards, not 4"},
		{"x", 3, 0, "want I or I/N"},
		{"1/y", 3, 0, "want I or I/N"},
	}
	for _, tc := range tests {
		got, err := ParseShard(tc.spec, tc.shards)
		if tc.err == "" && (err != nil || got != tc.want) {
			t.Errorf("ParseShard(%q) = %d, %v; want %d", tc.spec, got, err, tc.want)
		}
		if tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("ParseShard(%q): error %v, want %q", tc.spec, err, tc.err)
		}
	}
}

func TestShardsAreContiguousAndBalanced(t *testing.T) {
	var jobs []runner.Job
	for i := 0; i < 7; i++ {
		jobs = append(jobs, runner.Job{Job: sched.Job{ID: fmt.Sprint(i)}})
	}
	for _, tc := range []struct {
		n     int
		sizes string
	}{{1, "7"}, {3, "2 2 3"}, {7, "1 1 1 1 1 1 1"}, {64, "1 1 1 1 1 1 1"}} {
		shards := shard(jobs, tc.n)
		var sizes []string
		next := 0
		for _, s := range shards {
			sizes = append(sizes, fmt.Sprint(len(s)))
			for _, j := range s {
				if j.ID != fmt.Sprint(next) {
					t.Errorf("%d shards: job %s where %d was due", tc.n, j.ID, next)
				}
				next++
			}
		}
		if got := strings.Join(sizes, " "); got != tc.sizes {
			t.Errorf("%d shards: sizes %s, want %s", tc.n, got, tc.sizes)
		}
	}
}

func TestScriptQuotesWhatItPasses(t *testing.T) {
	e := &Executor{Workbench: "/opt/wb it's", TaskArgs: []string{"--python", "/a b/python"},
		Env: []string{"VLKV_CACHE_DIR=/x'y"}, Options: Options{Extra: []string{"#SBATCH --exclusive", "--qos=q"}}}
	s := e.script(Plan{Submission: "s1", Experiment: "e", RunDir: "/runs/e/1", Shards: make([][]runner.Job, 2)})
	for _, want := range []string{"#SBATCH --array=0-1\n", "#SBATCH --exclusive\n", "#SBATCH --qos=q\n",
		`export VLKV_CACHE_DIR='/x'\''y'`, `exec '/opt/wb it'\''s' '--python' '/a b/python' shard '/runs/e/1/slurm/s1/plan.json' --shard "$SLURM_ARRAY_TASK_ID"`,
		"#SBATCH --output=/runs/e/1/slurm/s1/task-%a.log\n#SBATCH --open-mode=append\n"} {
		if !strings.Contains(s, want) {
			t.Errorf("script lacks %q:\n%s", want, s)
		}
	}
	if err := (Options{Extra: []string{"a\nb"}}).Check(); err == nil {
		t.Error("a multi-line --sbatch-line passed")
	}
}

func TestTerminalStates(t *testing.T) {
	for state, want := range map[string]bool{"PENDING": false, "RUNNING": false, "COMPLETING": false, "COMPLETED": true,
		"TIMEOUT": true, "CANCELLED": true, "NODE_FAIL": true, "PREEMPTED": true, "OUT_OF_MEMORY": true,
		"RESV_DEL_HOLD": false, "REQUEUE_HOLD": false, "SUSPENDED": false, "A_STATE_OF_A_LATER_SLURM": false} {
		if got := (TaskState{State: state}).Terminal(); got != want {
			t.Errorf("%s terminal = %v", state, got)
		}
	}
}

func TestOptionsCheck(t *testing.T) {
	tests := []struct {
		name string
		opts Options
		err  string // "" when the options pass
	}{
		{"none", Options{}, ""},
		{"minutes", Options{Time: "90"}, ""},
		{"MM:SS", Options{Time: "5:00"}, ""},
		{"HH:MM:SS", Options{Time: "2:00:00"}, ""},
		{"D-HH", Options{Time: "1-12"}, ""},
		{"D-HH:MM", Options{Time: "1-12:30"}, ""},
		{"D-HH:MM:SS", Options{Time: "1-12:30:00"}, ""},
		{"unlimited", Options{Time: "UNLIMITED"}, ""},
		{"time word", Options{Time: "bogus"}, `--time "bogus": want minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS`},
		{"time with four parts", Options{Time: "1:2:3:4"}, `--time "1:2:3:4"`},
		{"time with a unit", Options{Time: "2h"}, `--time "2h"`},
		{"negative time", Options{Time: "-5"}, `--time "-5"`},
		{"days only", Options{Time: "1-"}, `--time "1-"`},
		{"megabytes", Options{Mem: "4000"}, ""},
		{"gigabytes", Options{Mem: "32G"}, ""},
		{"lower-case suffix", Options{Mem: "512m"}, ""},
		{"terabytes", Options{Mem: "1T"}, ""},
		{"negative mem", Options{Mem: "-5G"}, `--mem "-5G": want a positive size`},
		{"zero mem: all of a node's", Options{Mem: "0"}, ""},
		{"zero with a unit", Options{Mem: "0G"}, `--mem "0G"`},
		{"mem unit word", Options{Mem: "32GB"}, `--mem "32GB"`},
		{"mem fraction", Options{Mem: "1.5G"}, `--mem "1.5G"`},
		{"cpus", Options{CPUsPerTask: 4}, ""},
		{"negative cpus", Options{CPUsPerTask: -1}, "--cpus-per-task must be at least 1, got -1"},
		{"negative max running", Options{MaxRunning: -1}, "--max-running must be positive"},
		{"negative shards", Options{Shards: -1}, "--shards must be positive"},
	}
	for _, tc := range tests {
		err := tc.opts.Check()
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("%s: %+v refused: %v", tc.name, tc.opts, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%s: %+v: error %v, want %q", tc.name, tc.opts, err, tc.err)
		}
	}
}

func TestDescribe(t *testing.T) {
	tests := []struct {
		tasks []TaskState
		want  string
	}{
		{nil, ""},
		{[]TaskState{{Task: 0, State: "COMPLETED"}}, "1 completed (task 0)"},
		{[]TaskState{{Task: 1, State: "CANCELLED"}, {Task: 0, State: "COMPLETED"}, {Task: 2, State: "COMPLETED"}},
			"1 cancelled (task 1), 2 completed (tasks 0,2)"},
		{[]TaskState{{Task: 3, State: "RUNNING"}, {Task: 0, State: "RUNNING"}, {Task: 1, State: "RUNNING"},
			{Task: 2, State: "RUNNING"}, {Task: 7, State: "RUNNING"}, {Task: 8, State: "RUNNING"}, {Task: 5, State: "PENDING"}},
			"1 pending (task 5), 6 running (tasks 0-3,7-8)"},
	}
	for _, tc := range tests {
		if got := Describe(tc.tasks); got != tc.want {
			t.Errorf("Describe(%v) = %q, want %q", tc.tasks, got, tc.want)
		}
	}
}

// Once Slurm forgets an array, its tasks' .done files say how each ended.
func TestDescribeEnded(t *testing.T) {
	dir := t.TempDir()
	sub := Submission{ID: "s1", Tasks: 5}
	if err := os.MkdirAll(filepath.Join(dir, Dir, sub.ID), 0o755); err != nil {
		t.Fatal(err)
	}
	for i, d := range map[int]string{0: `{"jobs": 2, "recorded": 2}`, 1: `{"jobs": 2, "recorded": 2, "failed": 1}`,
		3: `{"jobs": 2, "recorded": 1, "error": "stopped by a signal (scancel, its time limit or a preemption) after recording 1 of its 2 jobs"}`} {
		if err := os.WriteFile(donePath(dir, sub.ID, i), []byte(d), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want := "2 tasks ran all their jobs (0-1); task 3: stopped by a signal (scancel, its time limit or a preemption) after " +
		"recording 1 of its 2 jobs; 2 tasks left no word (2,4: killed outright, or never started; see " +
		filepath.Join(dir, Dir, "s1", "task-<i>.log") + ")"
	if got := DescribeEnded(dir, sub); got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
}

// A Slurm command without a configuration fails with what to do, in one
// line, not with the search it made.
func TestCommandWithoutConfiguration(t *testing.T) {
	bin := t.TempDir()
	fake := "#!/bin/sh\necho 'squeue: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host' >&2\n" +
		"echo 'squeue: error: fetch_config: DNS SRV lookup failed' >&2\n" +
		"echo 'squeue: fatal: Could not establish a configuration source' >&2\nexit 1\n"
	if err := os.WriteFile(filepath.Join(bin, "squeue"), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin)
	for _, conf := range []string{"", "/etc/elsewhere/slurm.conf"} {
		t.Setenv("SLURM_CONF", conf)
		_, err := Tasks(context.Background(), "7")
		var nc *NotConfiguredError
		if !errors.As(err, &nc) {
			t.Fatalf("SLURM_CONF=%q: error %v, want a NotConfiguredError", conf, err)
		}
		msg := err.Error()
		if strings.Contains(msg, "\n") || strings.Contains(msg, "DNS SRV") || !strings.Contains(msg, "SLURM_CONF") {
			t.Errorf("SLURM_CONF=%q: error %q: want one line that says to set SLURM_CONF", conf, msg)
		}
		if conf != "" && !strings.Contains(msg, conf) {
			t.Errorf("SLURM_CONF=%q: error %q does not name it", conf, msg)
		}
	}
}

// A dry run prints what it would submit and leaves a run it resumes as it
// was, whether jobs are left to run or none.
func TestDryRunResumeLeavesTheRun(t *testing.T) {
	tests := []struct {
		name string
		jobs []string
		want string // in what it prints
	}{
		{"jobs left", []string{"a", "b", "c"}, "#SBATCH --array=0-0\n"},
		{"none left", []string{"a", "b"}, "nothing to submit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out := t.TempDir()
			o := runner.Options{Out: out, Experiment: "exp", File: "exp.star", FileHash: "h", Jobs: testJobs("a", "b"),
				KernelsDir: t.TempDir(), Executor: &doneExecutor{}, Log: zerolog.Nop()}
			first, err := runner.Run(context.Background(), o)
			if err != nil {
				t.Fatal(err)
			}
			before := resultstest.Snapshot(t, first.Dir)
			var printed strings.Builder
			o.Jobs, o.Resume = testJobs(tc.jobs...), true
			o.Executor = &Executor{DryRun: true, Out: &printed, Workbench: "/bin/workbench"}
			if _, err := runner.Run(context.Background(), o); !errors.Is(err, ErrDryRun) {
				t.Fatalf("dry run: %v, want ErrDryRun", err)
			}
			if !strings.Contains(printed.String(), tc.want) {
				t.Errorf("dry run printed %q, want %q", printed.String(), tc.want)
			}
			if after := resultstest.Snapshot(t, first.Dir); !maps.Equal(after, before) {
				t.Errorf("a dry run changed the run:\n%v\nwas\n%v", after, before)
			}
		})
	}
}

// A --partition is checked as sbatch takes it: one name, or a
// comma-separated list of which every name must exist.
func TestPartitionIn(t *testing.T) {
	names := []string{"debug", "gpu"}
	for _, ok := range []string{"gpu", "debug", "gpu,debug"} {
		if err := partitionIn(names, ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for name, bad := range map[string]string{"cpu": "cpu", "gpu,cpu": "cpu", "gpu,": ""} {
		want := fmt.Sprintf("partition %q does not exist on this cluster; its partitions: debug, gpu", bad)
		if err := partitionIn(names, name); err == nil || err.Error() != want {
			t.Errorf("%q: %v, want %q", name, err, want)
		}
	}
}

func testJobs(ids ...string) []runner.Job {
	jobs := make([]runner.Job, len(ids))
	for i, id := range ids {
		jobs[i] = runner.Job{Job: sched.Job{ID: id}, Method: "full"}
	}
	return jobs
}

// doneExecutor journals every job as done, without running it, and counts them.
type doneExecutor struct{ ran int }

func (d *doneExecutor) Run(_ context.Context, b runner.Batch) error {
	for _, j := range b.Jobs {
		d.ran++
		out := runner.Outcome{Outcome: sched.Outcome{Job: j, Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 1}}`)}}
		if err := b.Done(out); err != nil {
			return err
		}
	}
	return nil
}

// runOfTwoJobs runs jobs a and b of experiment exp, guarded as every run
// is; the options resume it.
func runOfTwoJobs(t *testing.T) (runner.Options, runner.Summary) {
	t.Helper()
	o := runner.Options{Out: t.TempDir(), Experiment: "exp", File: "exp.star", FileHash: "h",
		Jobs: testJobs("a", "b"), KernelsDir: t.TempDir(), Executor: &doneExecutor{}, Log: zerolog.Nop(),
		Guard: CheckNoneActive}
	first, err := runner.Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	return o, first
}

// Every resume of a run, on local workers as on Slurm, is refused while
// an array of the run is still queued, and where squeue cannot say
// whether one is; the refused run stays as it was and no job runs.
func TestResumeRefusedWhileTheArrayRuns(t *testing.T) {
	tests := []struct {
		name    string
		submit  bool   // the run submitted array 42
		squeue  string // the fake squeue's output; "" leaves it off PATH
		refused string // in the error; "" when the resume goes on
	}{
		{"queued", true, "0|COMPLETED|None\n1|RUNNING|None\n2|PENDING|JobArrayTaskLimit\n",
			"Slurm array 42 of %DIR% is still in the queue (1 completed, 1 pending (JobArrayTaskLimit), 1 running): its tasks run the jobs it holds. " +
				"Follow it with `workbench status %DIR%`, or stop it (scancel 42)"},
		{"ended", true, "0|COMPLETED|None\n1|CANCELLED|None\n", ""},
		{"aged out", true, "echo 'squeue: error: Invalid job id specified' >&2; exit 1", ""},
		{"no squeue", true, "", "%DIR% ran as Slurm array 42, and whether that still runs cannot be told here " +
			"(no squeue on PATH): resume it on a machine of the cluster"},
		{"local run", false, "", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o, first := runOfTwoJobs(t)
			if tc.submit {
				sub := Submission{ID: "s1", ArrayJob: "42", Tasks: 3, Jobs: 3, Submitted: time.Now()}
				if err := os.MkdirAll(filepath.Join(first.Dir, Dir), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := appendSubmission(first.Dir, sub); err != nil {
					t.Fatal(err)
				}
			}
			bin := t.TempDir()
			if tc.squeue != "" {
				script := "#!/bin/sh\nprintf '" + tc.squeue + "'\n"
				if strings.Contains(tc.squeue, "exit") {
					script = "#!/bin/sh\n" + tc.squeue + "\n"
				}
				if err := os.WriteFile(filepath.Join(bin, "squeue"), []byte(script), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			t.Setenv("PATH", bin)
			before := resultstest.Snapshot(t, first.Dir)

			ex := &doneExecutor{}
			o.Jobs, o.Resume, o.Executor = testJobs("a", "b", "c"), true, ex
			_, err := runner.Run(context.Background(), o)
			ran := ex.ran
			if tc.refused == "" {
				if err != nil || ran != 1 {
					t.Fatalf("resume: %v, ran %d jobs; want it to run job c", err, ran)
				}
				return
			}
			want := strings.ReplaceAll(tc.refused, "%DIR%", first.Dir)
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Fatalf("resume: %v\nwant %q", err, want)
			}
			if ran != 0 {
				t.Errorf("a refused resume ran %d jobs", ran)
			}
			if after := resultstest.Snapshot(t, first.Dir); !maps.Equal(after, before) {
				t.Errorf("a refused resume changed the run:\n%v\nwas\n%v", after, before)
			}
		})
	}
}

// An array queued by a host killed before it recorded the array's id (a
// plan, no submission) is found by its job name: a resume records it and
// is refused while it runs, and goes on where squeue knows no such array.
func TestResumeFindsAnArrayItNeverRecorded(t *testing.T) {
	tests := []struct {
		name    string
		byName  string // squeue's rows for the submission's job name
		refused string
	}{
		{"queued", "77\n77\n", "Slurm array 77 of %DIR% is still in the queue (1 running)"},
		{"two jobs of its name", "77\n78\n", "%DIR%: squeue lists 2 jobs named vlkv-exp-s2 (77, 78), where one array " +
			"was submitted: stop the ones that are not this run's"},
		{"never queued", "", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o, first := runOfTwoJobs(t)
			plan := Plan{Submission: "s2", Experiment: "exp", RunDir: first.Dir, Shards: [][]runner.Job{testJobs("c")}}
			if _, err := writePlan(plan); err != nil {
				t.Fatal(err)
			}
			bin := t.TempDir()
			script := "#!/bin/sh\ncase \"$*\" in\n*--name=vlkv-exp-s2\\ *) printf '" + tc.byName + "' ;;\n" +
				"*'-j 77'*) printf '0|RUNNING|None\\n' ;;\nesac\n"
			if err := os.WriteFile(filepath.Join(bin, "squeue"), []byte(script), 0o755); err != nil {
				t.Fatal(err)
			}
			t.Setenv("PATH", bin)
			if tc.name == "queued" { // a caller without the run's lock (a new run's warning) is told, and records nothing
				err := CheckNoneActive(context.Background(), first.Dir, false)
				if subs, _ := Submissions(first.Dir); err == nil || !strings.Contains(err.Error(), "Slurm array 77 of") || len(subs) != 0 {
					t.Errorf("without the lock: %v, recorded %v; want array 77 named and nothing recorded", err, subs)
				}
			}

			ex := &doneExecutor{}
			o.Jobs, o.Resume, o.Executor = testJobs("a", "b", "c"), true, ex
			_, err := runner.Run(context.Background(), o)
			subs, serr := Submissions(first.Dir)
			if serr != nil {
				t.Fatal(serr)
			}
			if tc.refused == "" {
				if err != nil || ex.ran != 1 || len(subs) != 0 {
					t.Fatalf("resume: %v, ran %d jobs, recorded %v; want it to run job c", err, ex.ran, subs)
				}
				return
			}
			if want := strings.ReplaceAll(tc.refused, "%DIR%", first.Dir); err == nil || !strings.Contains(err.Error(), want) {
				t.Fatalf("resume: %v\nwant %q", err, want)
			}
			if ex.ran != 0 {
				t.Errorf("a refused resume ran %d jobs", ex.ran)
			}
			if strings.Contains(tc.byName, "78") { // which is the run's cannot be told: none is recorded
				if len(subs) != 0 {
					t.Errorf("recorded %+v, want none", subs)
				}
				return
			}
			if len(subs) != 1 || subs[0].ID != "s2" || subs[0].ArrayJob != "77" || subs[0].Tasks != 1 || subs[0].Jobs != 1 {
				t.Errorf("recorded %+v, want submission s2 as array 77 of 1 task and 1 job", subs)
			}
		})
	}
}

// The batch script's job name holds its submission, by which a resume
// finds the array if its id was never recorded.
func TestScriptCarriesItsSubmission(t *testing.T) {
	e := &Executor{Workbench: "/bin/workbench"}
	script := e.script(Plan{Submission: "20260101-000000-abcd", Experiment: "exp", RunDir: "/runs/exp/r1",
		Shards: [][]runner.Job{testJobs("a")}})
	for _, want := range []string{"#SBATCH --job-name=vlkv-exp-20260101-000000-abcd\n"} {
		if !strings.Contains(script, want) {
			t.Errorf("script lacks %q:\n%s", want, script)
		}
	}
}

// An array sbatch rejects leaves no run a later one takes for unfinished:
// a new run's directory goes, and a resumed run keeps what it held but
// not the plan of the array that never ran.
func TestRejectedArrayLeavesNoRun(t *testing.T) {
	putOnPath(t, t.TempDir(), map[string]string{
		// The probe (--wait) runs; the array is rejected.
		"sbatch": "#!/bin/sh\ncase \"$*\" in *--wait*) exec sh ;; esac\n" +
			"echo 'sbatch: error: Memory specification can not be satisfied' >&2\nexit 1\n",
		"squeue": "#!/bin/sh\n", "sinfo": "#!/bin/sh\necho debug\n", "scancel": "#!/bin/sh\n",
	})
	tests := []struct {
		name   string
		resume bool
	}{
		{"new run", false},
		{"resume", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := runner.Options{Out: t.TempDir(), Experiment: "exp", File: "exp.star", FileHash: "h",
				Jobs: testJobs("a", "b"), KernelsDir: t.TempDir(), Log: zerolog.Nop()}
			var earlier string
			var before map[string]string
			if tc.resume {
				o.Executor = &doneExecutor{}
				first, err := runner.Run(context.Background(), o)
				if err != nil {
					t.Fatal(err)
				}
				earlier, before = first.Dir, resultstest.Snapshot(t, first.Dir)
				o.Jobs, o.Resume = testJobs("a", "b", "c"), true
			}
			o.Executor = &Executor{Workbench: "/bin/sh", Options: Options{Mem: "999999G"}, Out: io.Discard}
			sum, err := runner.Run(context.Background(), o)
			if err == nil || !strings.Contains(err.Error(), "Memory specification can not be satisfied") ||
				!strings.Contains(err.Error(), "nothing was submitted") {
				t.Fatalf("run: %v; want sbatch's error and that nothing was submitted", err)
			}
			runs, _ := results.Runs(filepath.Join(o.Out, "exp"))
			if !tc.resume {
				if len(runs) != 0 || sum.Dir != "" || !strings.Contains(err.Error(), "was removed") {
					t.Errorf("a rejected array left runs %v (summary dir %q; error %v)", runs, sum.Dir, err)
				}
				return
			}
			if len(runs) != 1 || runs[0] != earlier || len(journalOf(t, earlier)) != 2 {
				t.Fatalf("runs %v, want the resumed %s with its 2 rows", runs, earlier)
			}
			if _, err := os.Stat(filepath.Join(earlier, Dir)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the rejected array's plan stayed in %s: %v", filepath.Join(earlier, Dir), err)
			}
			if after := resultstest.Snapshot(t, earlier); !maps.Equal(after, before) { // the resume recorded nothing of itself
				t.Errorf("the rejected resume changed the run:\n%v\nwas\n%v", after, before)
			}
		})
	}
}

func journalOf(t *testing.T, dir string) []results.Record {
	t.Helper()
	recs, err := results.ReadJournal(dir)
	if err != nil {
		t.Fatal(err)
	}
	return recs
}

// Pending tasks show Slurm's reason, and a reason they can never get past
// says what to change.
func TestPendingReasons(t *testing.T) {
	tasks := []TaskState{{Task: 0, State: "RUNNING"}, {Task: 1, State: "PENDING", Reason: "PartitionConfig"},
		{Task: 2, State: "PENDING", Reason: "PartitionConfig"}, {Task: 3, State: "PENDING", Reason: "Priority"},
		{Task: 4, State: "PENDING"}}
	if got, want := summarize(tasks), "1 pending, 2 pending (PartitionConfig), 1 pending (Priority), 1 running"; got != want {
		t.Errorf("summarize = %q, want %q", got, want)
	}
	if got, want := Describe(tasks), "1 pending (task 4), 2 pending (tasks 1-2: PartitionConfig), "+
		"1 pending (task 3: Priority), 1 running (task 0)"; got != want {
		t.Errorf("Describe = %q, want %q", got, want)
	}
	for _, tc := range []struct {
		reason string
		want   string // "" when tasks pending for it may still start
	}{
		{"Priority", ""},
		{"Resources", ""},
		{"QOSGrpCpuLimit", ""},
		{"QOSMaxJobsPerUserLimit", ""},
		{"ReqNodeNotAvail, UnavailableNodes:node[1-2]", ""}, // down or drained nodes may come back
		{"PartitionConfig", "ask for more than the partition's nodes have or allow"},
		{"BadConstraints", "ask for more than the partition's nodes have or allow"},
		{"ReqNodeNotAvail, UnavailableNodes:", "no node of the partition can give"},
		{"PartitionTimeLimit", "give a shorter --time"},
		{"QOSMaxCpuPerJobLimit", "per-job limit"},
		{"AssocMaxWallDurationPerJobLimit", "per-job limit"},
		{"InvalidAccount", "give another --account"},
		{"InvalidQOS", "--qos"},
		{"DependencyNeverSatisfied", "--dependency"},
	} {
		got := Stuck("42", []TaskState{{Task: 0, State: "PENDING", Reason: tc.reason}, {Task: 1, State: "PENDING",
			Reason: tc.reason}})
		switch {
		case tc.want == "" && len(got) != 0:
			t.Errorf("%s: %q, want nothing", tc.reason, got)
		case tc.want != "" && (len(got) != 1 || !strings.Contains(got[0], tc.want) ||
			!strings.Contains(got[0], "can never start") || !strings.Contains(got[0], "scancel 42")):
			t.Errorf("%s: %q, want one line with %q", tc.reason, got, tc.want)
		}
	}
}
