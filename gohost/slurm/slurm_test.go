package slurm

import (
	"fmt"
	"strings"
	"testing"

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
		"#SBATCH --output=/runs/e/1/slurm/s1/task-%a.log"} {
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
		"TIMEOUT": true, "CANCELLED": true, "NODE_FAIL": true, "PREEMPTED": true, "OUT_OF_MEMORY": true} {
		if got := (TaskState{State: state}).Terminal(); got != want {
			t.Errorf("%s terminal = %v", state, got)
		}
	}
}
