package slurm

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vlkv/vlkv/gohost/runner"
	"github.com/vlkv/vlkv/gohost/sched"
)

// An ended task with jobs not recorded is explained by its .done when it
// wrote one, by its log when Slurm says it exited with an error, and as a
// kill only when Slurm says it was killed.
func TestIncompleteSaysWhyATaskEnded(t *testing.T) {
	log := "Traceback...\n\nerror: python interpreter /nonexistent/python (from --python) does not exist\n"
	tests := []struct {
		name  string
		state TaskState
		done  error  // what the task recorded in its .done, if it wrote one
		log   string // the task's log
		want  string
		not   string
	}{
		{"failed at start, with its .done", TaskState{State: "FAILED", Reason: "NonZeroExitCode"},
			errors.New("python interpreter /nonexistent/python (from --python) does not exist"), log,
			"task 0 ended FAILED (NonZeroExitCode): could not start its jobs: python interpreter", "killed"},
		{"failed without a .done", TaskState{State: "FAILED", Reason: "NonZeroExitCode"}, nil,
			"slurm_script: line 9: /tmp/wbc: No such file or directory\n",
			"exited with an error before it could say why in its .done; its log ends: slurm_script: line 9: " +
				"/tmp/wbc: No such file or directory", "killed"},
		{"the last lines of a long log", TaskState{State: "FAILED", Reason: "NonZeroExitCode"}, nil,
			"alpha\nbeta\ngamma\ndelta\n", "its log ends: beta | gamma | delta", "alpha"},
		{"failed without a log", TaskState{State: "FAILED", Reason: "NonZeroExitCode"}, nil, "",
			"exited with an error before it could say why in its .done (its log", "killed"},
		{"killed by a signal", TaskState{State: "FAILED", Reason: "RaisedSignal:9(Killed)"}, nil, log,
			"killed: a node failure", "its log ends"},
		{"node failure", TaskState{State: "NODE_FAIL"}, nil, log, "killed: a node failure", "its log ends"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			jobs := []runner.Job{{Job: sched.Job{ID: "a"}}}
			plan := Plan{Submission: "s", RunDir: dir, Shards: [][]runner.Job{jobs}}
			if err := os.MkdirAll(filepath.Join(dir, Dir, "s"), 0o755); err != nil {
				t.Fatal(err)
			}
			if tc.log != "" {
				os.WriteFile(filepath.Join(dir, Dir, "s", "task-0.log"), []byte(tc.log), 0o644)
			}
			if tc.done != nil {
				if err := (Task{Plan: plan, Shard: 0}).Failed(tc.done); err != tc.done {
					t.Fatalf("Failed returned %v", err)
				}
			}
			tc.state.Task = 0
			f := &Follow{RunDir: dir, Submission: Submission{ID: "s", ArrayJob: "7"}, Plan: plan,
				Pending: map[string]bool{"a": true}}
			msg := f.incomplete(map[int]TaskState{0: tc.state}).Error()
			if !strings.Contains(msg, tc.want) || strings.Contains(msg, tc.not) {
				t.Errorf("%s\nwant %q, and no %q", msg, tc.want, tc.not)
			}
		})
	}
}

// A SLURM_CONF that names no file fails at once, before any Slurm command
// runs (which would retry reading it for a minute).
func TestMissingSlurmConf(t *testing.T) {
	bin := t.TempDir()
	ran := filepath.Join(bin, "ran")
	if err := os.WriteFile(filepath.Join(bin, "squeue"), []byte("#!/bin/sh\ntouch "+ran+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin)
	for _, conf := range []string{filepath.Join(bin, "nonexistent.conf"), bin} {
		t.Setenv("SLURM_CONF", conf)
		_, err := Tasks(t.Context(), "7")
		var nc *NotConfiguredError
		if !errors.As(err, &nc) || !strings.Contains(err.Error(), "SLURM_CONF="+conf+" names no file") ||
			!strings.Contains(err.Error(), "point SLURM_CONF at the cluster's slurm.conf") {
			t.Errorf("SLURM_CONF=%s: %v", conf, err)
		}
		if _, err := os.Stat(ran); err == nil {
			t.Errorf("SLURM_CONF=%s: squeue ran", conf)
		}
	}
}
