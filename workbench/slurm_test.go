package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/runner"
	"github.com/vlkv/vlkv/gohost/slurm"
	"github.com/vlkv/vlkv/gohost/slurm/slurmtest"
	"github.com/vlkv/vlkv/gohost/testpy"
)

// One single-node Slurm for the tests of this package, started by the
// first test that needs it and stopped by TestMain.
var (
	clusterOnce sync.Once
	cluster     *slurmtest.Cluster
	clusterErr  error
	clusterDir  string
)

func testCluster(t *testing.T) *slurmtest.Cluster {
	t.Helper()
	clusterOnce.Do(func() {
		if clusterDir, clusterErr = os.MkdirTemp("", "vlkv-slurm-"); clusterErr == nil {
			cluster, clusterErr = slurmtest.Start(clusterDir)
		}
	})
	return slurmtest.Need(t, cluster, clusterErr)
}

func stopCluster() {
	if cluster != nil {
		cluster.Stop()
	}
	if clusterDir != "" {
		os.RemoveAll(clusterDir)
	}
}

// slurmSetup is what every Slurm test runs on: the binary, the
// interpreter, a copy of kernels_py whose jobs sleep (so tasks can be
// caught mid-run) and a small experiment of 6 jobs.
type slurmSetup struct {
	bin, py, root, script, dir string
}

func newSlurmSetup(t *testing.T, jobSeconds float64) slurmSetup {
	t.Helper()
	s := slurmSetup{py: testpy.Python(t), bin: workbenchBinary(t), dir: t.TempDir()}
	s.root = copyKernels(t, s.dir)
	if jobSeconds > 0 {
		ablation := filepath.Join(s.root, "kernels_py", "ablation.py")
		f, _ := os.OpenFile(ablation, os.O_APPEND|os.O_WRONLY, 0)
		fmt.Fprintf(f, "\n_unslowed_run = run\n\ndef run(**kw):\n    import time\n    time.sleep(%g)\n    return _unslowed_run(**kw)\n", jobSeconds)
		f.Close()
	}
	s.script = filepath.Join(s.dir, "sweep.star")
	os.WriteFile(s.script, []byte(`experiment(
    name = "sweep",
    methods = ["full", "h2o", "snapkv", "streamingllm"],
    grid = {"budget": [0.25, 0.5]},
    workloads = [workload(tokens_per_image = 48, system_tokens = 8, text_tokens = 8, decode_steps = 2, layers = 2)],
)
`), 0o644)
	return s
}

// cmd is the workbench binary with this setup's interpreter and kernels.
func (s slurmSetup) cmd(c *slurmtest.Cluster, args ...string) *exec.Cmd {
	cmd := exec.Command(s.bin, append([]string{"--python", s.py, "--kernels", s.root, "--log-format", "console"}, args...)...)
	cmd.Env = os.Environ()
	if c != nil {
		cmd.Env = c.Env(cmd.Env)
	}
	return cmd
}

func runProc(t *testing.T, cmd *exec.Cmd) (int, string) {
	t.Helper()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	code := 0
	if err != nil {
		code = -1
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
	}
	return code, out.String()
}

// A Slurm run of a plan gives the rows a local run of it gives, in a run
// directory of the same shape (plus the tasks' segments and scripts).
func TestSlurmRunEqualsLocalRun(t *testing.T) {
	c := testCluster(t)
	s := newSlurmSetup(t, 0)
	code, out := runProc(t, s.cmd(nil, "run", s.script, "--out", filepath.Join(s.dir, "local")))
	if code != 0 {
		t.Fatalf("local run: exit %d\n%s", code, out)
	}
	code, out = runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", filepath.Join(s.dir, "slurm"),
		"--shards", "3", "--partition", slurmtest.Partition, "--time", "10:00"))
	if code != 0 || !strings.Contains(out, "sweep: 7 jobs, 0 failed") {
		t.Fatalf("slurm run: exit %d\n%s", code, out)
	}
	local, _ := results.Latest(filepath.Join(s.dir, "local"), "sweep")
	onSlurm, _ := results.Latest(filepath.Join(s.dir, "slurm"), "sweep")
	want, got := parquetRows(t, filepath.Join(local, results.ParquetFile)), parquetRows(t, filepath.Join(onSlurm, results.ParquetFile))
	if len(got) != 7 || !reflect.DeepEqual(got, want) {
		t.Errorf("slurm rows differ from local rows:\nslurm %v\nlocal %v", got, want)
	}
	subs, err := slurm.Submissions(onSlurm)
	if err != nil || len(subs) != 1 || subs[0].Tasks != 3 || subs[0].Jobs != 7 {
		t.Fatalf("submissions %+v, %v", subs, err)
	}
	segments, _ := filepath.Glob(filepath.Join(onSlurm, results.SegmentsDir, "*.jsonl"))
	if len(segments) != 3 {
		t.Errorf("segments %v: want one per task", segments)
	}
	for _, name := range []string{"plan.json", "submit.sh", "task-0.log", "task-2.done"} {
		if _, err := os.Stat(filepath.Join(onSlurm, slurm.Dir, subs[0].ID, name)); err != nil {
			t.Error(err)
		}
	}
	var m results.Manifest
	data, _ := os.ReadFile(filepath.Join(onSlurm, results.ManifestFile))
	if json.Unmarshal(data, &m) != nil || m.Ended == nil || m.Device != "slurm" {
		t.Errorf("manifest %s", data)
	}
}

// One array task killed mid-run: the host says which task ended without
// finishing and how to go on; the jobs the task had finished stay, and
// --resume submits only the others.
func TestSlurmTaskKilledMidRunThenResume(t *testing.T) {
	c := testCluster(t)
	s := newSlurmSetup(t, 1.0)
	out := filepath.Join(s.dir, "out")
	host := s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--shards", "2")
	log := startProc(t, host)
	// Wait for task 1 to record its first job, then kill it with two jobs to go.
	var runDir, segment string
	var before []results.Record
	deadline := time.Now().Add(90 * time.Second)
	for len(before) == 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		runDir, _ = results.Latest(out, "sweep")
		subs, _ := slurm.Submissions(runDir)
		if len(subs) == 0 {
			continue
		}
		segment = results.SegmentPath(runDir, results.SegmentName(subs[0].ID, 1))
		if before, _ = results.ReadSegment(segment); len(before) > 0 {
			if o, err := c.Command("scancel", subs[0].ArrayJob+"_1").CombinedOutput(); err != nil {
				t.Fatalf("scancel: %v %s", err, o)
			}
		}
	}
	err := host.Wait()
	if len(before) == 0 {
		t.Fatalf("task 1 recorded no job in time:\n%s", log.String())
	}
	text := log.String()
	if err == nil || !strings.Contains(text, "not run: task 1 ended CANCELLED") || !strings.Contains(text, "--resume") {
		t.Fatalf("host after the kill: %v\n%s", err, text)
	}
	// scancel's SIGTERM lets the task write its .done, which says why it
	// stopped; the host passes that on.
	subs, _ := slurm.Submissions(runDir)
	done, _ := os.ReadFile(filepath.Join(runDir, slurm.Dir, subs[0].ID, "task-1.done"))
	if !strings.Contains(string(done), "stopped by a signal") || !strings.Contains(text, "stopped by a signal (scancel") {
		t.Errorf("task 1's .done %q; the host said:\n%s", done, text)
	}
	// The host, and status after it, give the whole command that submits the rest.
	resumes := func(text string) bool {
		_, command, _ := strings.Cut(text, "to submit the rest: ")
		command, _, _ = strings.Cut(command, "\n")
		return strings.Contains(command, " run "+s.script+" --out "+out+" --executor slurm ") &&
			strings.HasSuffix(command, " --shards 2 --resume")
	}
	if !resumes(text) {
		t.Errorf("the host's message lacks the command to resume:\n%s", text)
	}
	if code, status := runProc(t, s.cmd(c, "status", "--no-follow", runDir)); code != 0 ||
		!strings.Contains(status, "the array has ended short; ") || !resumes(status) {
		t.Errorf("status after the kill: exit %d\n%s", code, status)
	}
	journal, _ := results.Finished(runDir)
	if len(journal) >= 7 || len(journal) < len(before) {
		t.Fatalf("journal has %d jobs after the kill", len(journal))
	}
	code, text := runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--resume"))
	if code != 0 || !strings.Contains(text, "sweep: 7 jobs, 0 failed") {
		t.Fatalf("resume: exit %d\n%s", code, text)
	}
	subs, _ = slurm.Submissions(runDir)
	if len(subs) != 2 || subs[1].Jobs != 7-len(journal) {
		t.Fatalf("the resume submitted %+v; %d jobs were done", subs, len(journal))
	}
	final, _ := results.ReadJournal(runDir)
	if len(final) != 7 {
		t.Errorf("journal has %d lines, want 7 (no job twice)", len(final))
	}
	for _, rec := range before { // the killed task's finished jobs are the ones it recorded, not rerun
		if got := finishedAt(final, rec.JobID); !got.Equal(rec.Finished) {
			t.Errorf("job %s: finished %v, recorded by the killed task at %v", rec.JobID, got, rec.Finished)
		}
	}
}

func finishedAt(recs []results.Record, id string) time.Time {
	for _, r := range recs {
		if r.JobID == id {
			return r.Finished
		}
	}
	return time.Time{}
}

// Ctrl-C (SIGINT, no terminal to ask on) cancels the array; what finished
// stays. --detach submits and returns; status follows the array to its end.
func TestSlurmCancelDetachAndStatus(t *testing.T) {
	c := testCluster(t)
	s := newSlurmSetup(t, 1.0)
	out := filepath.Join(s.dir, "out")
	host := s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--shards", "1")
	log := startProc(t, host)
	var runDir string
	var subs []slurm.Submission
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		runDir, _ = results.Latest(out, "sweep")
		if subs, _ = slurm.Submissions(runDir); len(subs) > 0 {
			if recs, _ := results.ReadSegment(results.SegmentPath(runDir, results.SegmentName(subs[0].ID, 0))); len(recs) > 0 {
				break
			}
		}
	}
	host.Process.Signal(syscall.SIGINT)
	err := host.Wait()
	if err == nil || !strings.Contains(log.String(), "interrupted:") || !strings.Contains(log.String(), "--resume") {
		t.Fatalf("interrupted host: %v\n%s", err, log.String())
	}
	if len(subs) == 0 {
		t.Fatal("no submission")
	}
	if o, _ := c.Command("squeue", "-h", "-j", subs[0].ArrayJob, "-t", "PENDING,RUNNING").Output(); len(bytes.TrimSpace(o)) > 0 {
		t.Errorf("the array still runs after Ctrl-C: %s", o)
	}
	done, _ := results.Finished(runDir)
	if len(done) == 0 || len(done) == 7 {
		t.Errorf("%d jobs journaled after cancelling mid-run", len(done))
	}

	code, text := runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--resume", "--detach"))
	if code != 0 || !strings.Contains(text, "detached from Slurm array") {
		t.Fatalf("detach: exit %d\n%s", code, text)
	}
	// Ctrl-C while status follows, answered "leave it running": status
	// reports what it has and succeeds, and the array goes on.
	var first bytes.Buffer
	asked := ""
	a := &app{stdout: &first, stderr: &first, log: zerolog.Nop(),
		cancelArray: func(arrayJob string) bool { asked = arrayJob; return false }}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	err = a.status(ctx, runDir, true)
	cancel()
	if err != nil || asked == "" || !strings.Contains(first.String(), "detached from Slurm array "+asked) ||
		!strings.Contains(first.String(), "jobs done") {
		t.Fatalf("status left running on Ctrl-C (asked about %q): %v\n%s", asked, err, first.String())
	}
	code, text = runProc(t, s.cmd(c, "status", runDir))
	if code != 0 || !strings.Contains(text, "7 of 7 jobs done, 0 failed") {
		t.Fatalf("status: exit %d\n%s", code, text)
	}
	if rows := parquetRows(t, filepath.Join(runDir, results.ParquetFile)); len(rows) != 7 {
		t.Errorf("%d rows after status followed the array", len(rows))
	}
	if recs, _ := results.ReadJournal(runDir); len(recs) != 7 {
		t.Errorf("journal has %d lines after status followed the array, want 7 (each job once)", len(recs))
	}
	// Each followed job shows its own time: the jobs sleep 1 s, so at least
	// that (a loaded machine makes it longer; the test must not care how
	// much). The tasks are counted by state and named: the array was left
	// running, so none was cancelled.
	followed := first.String() + text
	jobs := regexp.MustCompile(`\[\d+/7\] \S+ .* \((\d+(?:\.\d+)?)s\) ok`).FindAllStringSubmatch(followed, -1)
	if len(jobs) == 0 || strings.Contains(followed, "(0s)") {
		t.Errorf("status's progress does not show the jobs' times:\n%s", followed)
	}
	for _, m := range jobs {
		if secs, _ := strconv.ParseFloat(m[1], 64); secs < 1 {
			t.Errorf("a job that sleeps 1 s shows %ss:\n%s", m[1], m[0])
		}
	}
	if !regexp.MustCompile(`slurm array \d+ \(submitted [^)]*, \d+ tasks, \d+ jobs\): \d+ completed \(tasks? [0-9,-]+\)\n`).
		MatchString(text) || strings.Contains(text, "cancelled") {
		t.Errorf("status's tasks line:\n%s", text)
	}
	// Without SLURM_CONF (and no slurm.conf of the machine's own), status
	// says in one line what to set, and still reports the run.
	if _, err := os.Stat("/etc/slurm/slurm.conf"); err == nil {
		t.Skip("this machine has its own slurm.conf")
	}
	noConf := s.cmd(nil, "status", runDir)
	noConf.Env = slices.DeleteFunc(noConf.Env, func(kv string) bool { return strings.HasPrefix(kv, "SLURM_CONF=") })
	code, text = runProc(t, noConf)
	if code != 0 || !strings.Contains(text, "7 of 7 jobs done, 0 failed") ||
		!strings.Contains(text, "its tasks cannot be read: squeue finds no Slurm configuration here") ||
		!strings.Contains(text, "set SLURM_CONF") || strings.Contains(text, "DNS SRV") {
		t.Errorf("status without SLURM_CONF: exit %d\n%s", code, text)
	}
}

// Ctrl-C answered "leave it running" stops a script of several
// experiments there, saying which were not started: the run went on to the
// next experiment with the interrupted context, and failed with "sinfo:
// context canceled".
func TestSlurmCtrlCLeftRunningStopsTheScript(t *testing.T) {
	if _, err := exec.LookPath("script"); err != nil {
		t.Skip("no script(1) to give the run a terminal, where Ctrl-C asks")
	}
	c := testCluster(t)
	s := newSlurmSetup(t, 1.0)
	text, err := os.ReadFile(s.script)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(s.script, append(text, bytes.ReplaceAll(text, []byte(`"sweep"`), []byte(`"later"`))...), 0o644)
	out := filepath.Join(s.dir, "out")
	words := []string{}
	for _, w := range s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--shards", "1").Args {
		words = append(words, shellQuote(w))
	}
	host := exec.Command("script", "-qefc", strings.Join(words, " "), "/dev/null")
	host.Env = c.Env(os.Environ())
	answer, err := host.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer answer.Close()
	log := startProc(t, host)
	var subs []slurm.Submission
	for deadline := time.Now().Add(90 * time.Second); len(subs) == 0 && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		runDir, _ := results.Latest(out, "sweep")
		subs, _ = slurm.Submissions(runDir)
	}
	if len(subs) == 0 {
		t.Fatalf("no array submitted:\n%s", log.String())
	}
	defer c.Command("scancel", subs[0].ArrayJob).Run()
	if err := c.Command("pkill", "-INT", "-f", "^"+regexp.QuoteMeta(s.bin)+" .* run ").Run(); err != nil {
		t.Fatalf("signal the run: %v", err)
	}
	waitOutput(t, log, 0, 30*time.Second, "[y/N]")
	io.WriteString(answer, "n\n")
	host.Wait()
	got := log.String()
	if !strings.Contains(got, "detached from Slurm array "+subs[0].ArrayJob) ||
		!strings.Contains(got, "experiments later of "+s.script+" were not started") || strings.Contains(got, "context canceled") {
		t.Errorf("Ctrl-C, then leaving the array running:\n%s", got)
	}
	if dir, _ := results.Latest(out, "later"); dir != "" {
		t.Errorf("the next experiment was started after Ctrl-C: %s", dir)
	}
}

// What a user gets wrong gets a clear error: no Slurm on PATH, a partition
// the cluster lacks, a results directory the nodes cannot see, a shard out
// of range.
func TestSlurmErrors(t *testing.T) {
	s := newSlurmSetup(t, 0)
	out := filepath.Join(s.dir, "out")
	noSlurm := s.cmd(nil, "run", s.script, "--executor", "slurm", "--out", out)
	noSlurm.Env = append(noSlurm.Env, "PATH="+t.TempDir())
	if code, text := runProc(t, noSlurm); code != 1 || !strings.Contains(text, "no sbatch on PATH") {
		t.Errorf("no sbatch: exit %d\n%s", code, text)
	}
	if code, text := runProc(t, s.cmd(nil, "run", s.script, "--partition", "gpu")); code != 2 ||
		!strings.Contains(text, "--partition applies to --executor slurm") {
		t.Errorf("slurm flag without slurm: exit %d\n%s", code, text)
	}
	plan := filepath.Join(s.dir, "plan.json")
	data, _ := json.Marshal(slurm.Plan{Shards: make([][]runner.Job, 4)})
	os.WriteFile(plan, data, 0o644)
	if code, text := runProc(t, s.cmd(nil, "shard", plan, "--shard", "4")); code != 2 ||
		!strings.Contains(text, "shard 4 is out of range: the plan has 4 shards (0 to 3)") {
		t.Errorf("shard out of range: exit %d\n%s", code, text)
	}
	if code, text := runProc(t, s.cmd(nil, "shard", plan, "--shard", "1/8")); code != 2 ||
		!strings.Contains(text, "the plan has 4 shards, not 8") {
		t.Errorf("shard count: exit %d\n%s", code, text)
	}

	c := testCluster(t)
	if _, err := os.Stat("/etc/slurm/slurm.conf"); err != nil { // no configuration but SLURM_CONF's
		noConf := s.cmd(nil, "run", s.script, "--executor", "slurm", "--out", out)
		noConf.Env = slices.DeleteFunc(noConf.Env, func(kv string) bool { return strings.HasPrefix(kv, "SLURM_CONF=") })
		if code, text := runProc(t, noConf); code != 1 || !strings.Contains(text, "sbatch finds no Slurm configuration here") ||
			!strings.Contains(text, "set SLURM_CONF") || strings.Contains(text, "DNS SRV") {
			t.Errorf("no SLURM_CONF: exit %d\n%s", code, text)
		}
	}
	// A SLURM_CONF naming no file fails at once, not after Slurm's own minute of retries.
	badConf := s.cmd(nil, "run", s.script, "--executor", "slurm", "--out", out)
	badConf.Env = append(badConf.Env, "SLURM_CONF="+filepath.Join(s.dir, "nonexistent.conf"))
	start := time.Now()
	if code, text := runProc(t, badConf); code != 1 || !strings.Contains(text, "nonexistent.conf names no file") ||
		time.Since(start) > 10*time.Second {
		t.Errorf("SLURM_CONF naming no file: exit %d after %v\n%s", code, time.Since(start), text)
	}
	// Tasks that fail before their jobs start say why in their .done; the probe reads an extra line as
	// the array's script does.
	noPython := exec.Command(s.bin, "--python", "/nonexistent/python", "--kernels", s.root, "--log-format", "console",
		"run", s.script, "--executor", "slurm", "--out", out, "--shards", "2", "--sbatch-line", "--comment hello")
	noPython.Env = c.Env(os.Environ())
	if code, text := runProc(t, noPython); code != 1 ||
		!strings.Contains(text, "task 0 ended FAILED (NonZeroExitCode): could not start its jobs: python interpreter "+
			"/nonexistent/python (from --python) does not exist") || strings.Contains(text, "killed") {
		t.Errorf("tasks without their interpreter: exit %d\n%s", code, text)
	}
	if code, text := runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--partition", "gpu")); code != 1 ||
		!strings.Contains(text, `partition "gpu" does not exist on this cluster; its partitions: debug, hidden`) {
		t.Errorf("unknown partition: exit %d\n%s", code, text)
	}
	// A dry run where Slurm answers refuses it too, and prints the script of a partition it has.
	if code, text := runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--partition", "gpu", "--dry-run")); code != 1 ||
		!strings.Contains(text, `partition "gpu" does not exist on this cluster`) || strings.Contains(text, "#!/bin/bash") {
		t.Errorf("unknown partition, dry run: exit %d\n%s", code, text)
	}
	for _, p := range []string{slurmtest.Partition, slurmtest.HiddenPartition} { // a hidden one is a partition too
		if code, text := runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--partition", p,
			"--dry-run")); code != 0 || !strings.Contains(text, "#SBATCH --partition="+p) {
			t.Errorf("partition %s, dry run: exit %d\n%s", p, code, text)
		}
	}
	if c.Hidden == "" {
		t.Fatalf("no directory hidden from the node to test with: %v", c.HiddenErr)
	}
	hidden := filepath.Join(c.Hidden, t.Name())
	if code, text := runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", hidden)); code != 1 ||
		!strings.Contains(text, "the nodes cannot see the results directory") {
		t.Errorf("results directory the node cannot see: exit %d\n%s", code, text)
	}
	os.RemoveAll(hidden)
}

// Slurm flag values sbatch would refuse, or that mean nothing, are usage
// errors (exit 2, with the usage) before any script is written.
func TestSlurmBadFlagsAreUsageErrors(t *testing.T) {
	s := newSlurmSetup(t, 0)
	out := filepath.Join(s.dir, "out")
	tests := []struct {
		flags []string
		want  string
	}{
		{[]string{"--shards", "-1"}, "--shards must be positive"},
		{[]string{"--max-running", "-1"}, "--max-running must be positive"},
		{[]string{"--time", "bogus"}, `--time "bogus": want minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS`},
		{[]string{"--mem", "-5G"}, `--mem "-5G": want a positive size`},
		{[]string{"--cpus-per-task", "0"}, "--cpus-per-task must be at least 1"},
		{[]string{"--cpus-per-task", "-2"}, "--cpus-per-task must be at least 1"},
		{[]string{"--detach"}, "give one of them"},
		{[]string{"--out", out + " 2"}, "holds a space or a %, which sbatch's --output cannot take"},
		{[]string{"--sbatch-line", "qos=high"}, `--sbatch-line "qos=high": want sbatch options`},
		{[]string{"--sbatch-line=--array=0-1"}, "sets --array, which the workbench sets itself"},
		{[]string{"--sbatch-line", "-p gpu"}, "sets --partition, which the workbench sets itself: give --partition instead"},
		{[]string{"--sbatch-line", "--mem 4G"}, "give --mem instead"},
	}
	for _, tc := range tests {
		args := append([]string{"run", s.script, "--executor", "slurm", "--out", out, "--dry-run"}, tc.flags...)
		code, text := runProc(t, s.cmd(nil, args...))
		if code != 2 || !strings.Contains(text, tc.want) || !strings.Contains(text, "Usage:") || strings.Contains(text, "#!/bin/bash") {
			t.Errorf("%v: exit %d, want 2 with %q and the usage, and no script:\n%s", tc.flags, code, tc.want, text)
		}
	}
	if _, err := os.Stat(out + " 2"); !os.IsNotExist(err) {
		t.Errorf("the refused --out was created: %v", err)
	}
}

// The dry run prints the batch script with every option, and submits nothing.
func TestSlurmDryRun(t *testing.T) {
	s := newSlurmSetup(t, 0)
	out := filepath.Join(s.dir, "out")
	cmd := s.cmd(nil, "run", s.script, "--executor", "slurm", "--out", out, "--dry-run", "--shards", "2",
		"--max-running", "1", "--partition", "gpu", "--account", "lab", "--time", "1:00:00", "--gres", "gpu:1",
		"--cpus-per-task", "4", "--mem", "16G", "--sbatch-line", "--qos=high", "--sbatch-line", "--comment hello",
		"--runtime-cache", "/shared/cache", "--start-timeout", "3m")
	// No Slurm answers (a dry run needs none): where this machine's would, and lacks a partition gpu, the dry
	// run refuses it (TestSlurmErrors checks that on the test cluster).
	cmd.Env = append(cmd.Env, "SLURM_CONF="+filepath.Join(s.dir, "no-slurm.conf"))
	code, text := runProc(t, cmd)
	for _, want := range []string{"#SBATCH --array=0-1%1", "#SBATCH --partition=gpu", "#SBATCH --account=lab",
		"#SBATCH --comment hello\n",
		"#SBATCH --time=1:00:00", "#SBATCH --gres=gpu:1", "#SBATCH --cpus-per-task=4", "#SBATCH --mem=16G",
		"#SBATCH --qos=high", "export VLKV_CACHE_DIR='/shared/cache'", "'--start-timeout' '3m0s' shard '",
		`--shard "$SLURM_ARRAY_TASK_ID"`,
		"7 jobs of experiment sweep in 2 shards"} {
		if !strings.Contains(text, want) {
			t.Errorf("dry run lacks %q:\n%s", want, text)
		}
	}
	if code != 0 {
		t.Errorf("dry run: exit %d", code)
	}
	if runs, _ := filepath.Glob(filepath.Join(out, "sweep", "*")); len(runs) != 0 {
		t.Errorf("a dry run left %v", runs)
	}
}

// status works on any run: a local one reports its rows; what is not a run
// directory is an error that says what to give.
func TestStatusOfALocalRun(t *testing.T) {
	s := newSlurmSetup(t, 0)
	out := filepath.Join(s.dir, "out")
	if code, text := runProc(t, s.cmd(nil, "run", s.script, "--out", out, "--experiment", "sweep")); code != 0 {
		t.Fatalf("run: exit %d\n%s", code, text)
	}
	runDir, _ := results.Latest(out, "sweep")
	if code, text := runProc(t, s.cmd(nil, "status", runDir)); code != 0 || !strings.Contains(text, "7 of 7 jobs done, 0 failed") {
		t.Errorf("status: exit %d\n%s", code, text)
	}
	if code, text := runProc(t, s.cmd(nil, "status", out)); code != 1 || !strings.Contains(text, "is not a run directory") {
		t.Errorf("status of a results root: exit %d\n%s", code, text)
	}
}

// --resume --retry-failed on Slurm runs the failed jobs again, and only
// the new outcomes count: the old submission's failed lines are not read
// back.
func TestSlurmRetryFailed(t *testing.T) {
	c := testCluster(t)
	s := newSlurmSetup(t, 0)
	flag := filepath.Join(s.dir, "fail-h2o")
	os.WriteFile(flag, nil, 0o644)
	f, _ := os.OpenFile(filepath.Join(s.root, "kernels_py", "ablation.py"), os.O_APPEND|os.O_WRONLY, 0)
	fmt.Fprintf(f, "\n_unfailed_run = run\n\ndef run(**kw):\n    import os\n    if kw.get('method') == 'h2o' and os.path.exists(%q):\n        raise RuntimeError('boom')\n    return _unfailed_run(**kw)\n", flag)
	f.Close()
	out := filepath.Join(s.dir, "out")
	code, text := runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--shards", "2"))
	if code != 1 || !strings.Contains(text, "sweep: 7 jobs, 2 failed") {
		t.Fatalf("first run: exit %d\n%s", code, text)
	}
	// Followed by the host that submits it: the retried jobs fail again, once each.
	code, text = runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--shards", "2", "--resume", "--retry-failed"))
	if code != 1 || !strings.Contains(text, "sweep: 7 jobs, 2 failed") || !strings.Contains(text, "[7/7]") ||
		strings.Contains(text, "[8/7]") {
		t.Fatalf("retry, failing again: exit %d\n%s", code, text)
	}
	os.Remove(flag)
	// Submitted and followed by status: the retried jobs count once each.
	code, text = runProc(t, s.cmd(c, "run", s.script, "--executor", "slurm", "--out", out, "--resume", "--retry-failed", "--detach"))
	if code != 0 {
		t.Fatalf("retry: exit %d\n%s", code, text)
	}
	runDir, _ := results.Latest(out, "sweep")
	code, text = runProc(t, s.cmd(c, "status", runDir))
	if code != 0 || !strings.Contains(text, "7 of 7 jobs done, 0 failed") || !strings.Contains(text, "[7/7]") ||
		strings.Contains(text, "[8/7]") {
		t.Fatalf("status following the retry: exit %d\n%s", code, text)
	}
	recs, _ := results.ReadJournal(runDir)
	if len(recs) != 11 {
		t.Errorf("journal has %d lines, want 7 + the 2 retried twice", len(recs))
	}
	for _, row := range parquetRows(t, filepath.Join(runDir, results.ParquetFile)) {
		if row["status"] != "ok" {
			t.Errorf("row %v", row)
		}
	}
}
