package slurm

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/runner"
)

// fakeSlurm puts an sbatch and a scancel on PATH. sbatch keeps the script
// it reads and, as sbatch --parsable --wait does, prints the job id; then
// it runs the script (FAKE_SBATCH=run) or waits in the queue until
// scancel ends it (FAKE_SBATCH=queue). scancel records its arguments.
func fakeSlurm(t *testing.T) string {
	t.Helper()
	bin := t.TempDir()
	sbatch := `#!/bin/bash
cat > "$(dirname "$0")/script"
echo "$@" > "$(dirname "$0")/args"
echo 123
if [ "$FAKE_SBATCH" = run ]; then exec bash "$(dirname "$0")/script"; fi
echo $$ > "$(dirname "$0")/pid"
exec sleep 60
`
	scancel := `#!/bin/bash
echo "$@" >> "$(dirname "$0")/scancel.args"
kill "$(cat "$(dirname "$0")/pid")"
`
	putOnPath(t, bin, map[string]string{"sbatch": sbatch, "scancel": scancel})
	t.Setenv("PATH", bin+":/usr/bin:/bin") // no real Slurm command behind them
	return bin
}

// putOnPath writes each command's script into bin and puts bin first on
// PATH, with no SLURM_CONF: Slurm's commands faked for a test.
func putOnPath(t *testing.T, bin string, commands map[string]string) {
	t.Helper()
	for name, script := range commands {
		if err := os.WriteFile(filepath.Join(bin, name), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	t.Setenv("SLURM_CONF", "")
}

// The probe is a batch script with the array's #SBATCH lines, so sbatch
// reads an extra line ("--comment hello") as the array's script has it.
func TestProbeScriptHasTheArraysLines(t *testing.T) {
	bin := fakeSlurm(t)
	t.Setenv("FAKE_SBATCH", "run")
	dir := t.TempDir()
	e := &Executor{Workbench: "/bin/true", Options: Options{Partition: "debug", GRES: "gpu:1", CPUsPerTask: 8,
		Mem: "64G", Time: "2-00:00:00", Extra: []string{"--comment hello", "#SBATCH --qos=high"}}}
	if err := e.probe(context.Background(), dir, "s1", zerolog.Nop()); err != nil {
		t.Fatalf("probe: %v", err)
	}
	data, _ := os.ReadFile(filepath.Join(bin, "script"))
	script := string(data)
	for _, want := range []string{"#SBATCH --job-name=vlkv-probe.s1\n", "#SBATCH --partition=debug\n",
		"#SBATCH --time=5:00\n", "#SBATCH --gres=gpu:1\n", "#SBATCH --comment hello\n", "#SBATCH --qos=high\n"} {
		if !strings.Contains(script, want) {
			t.Errorf("the probe's script lacks %q:\n%s", want, script)
		}
	}
	if strings.Contains(script, "--cpus-per-task") || strings.Contains(script, "--mem") {
		t.Errorf("the probe asks for a task's CPUs or memory:\n%s", script)
	}
	if args, _ := os.ReadFile(filepath.Join(bin, "args")); strings.TrimSpace(string(args)) != "--parsable --wait" {
		t.Errorf("sbatch's arguments: %q, want only --parsable --wait", args)
	}
	if marks, _ := filepath.Glob(filepath.Join(dir, ".vlkv-probe-*")); len(marks) != 0 {
		t.Errorf("the probe left %v", marks)
	}
}

// A host interrupted while its probe waits in the queue cancels the probe
// job, which would otherwise run later and leave its mark in the results.
func TestInterruptedProbeIsCancelled(t *testing.T) {
	bin := fakeSlurm(t)
	t.Setenv("FAKE_SBATCH", "queue")
	ctx, cancel := context.WithCancel(context.Background())
	go func() { // Ctrl-C once the probe is queued
		for {
			if _, err := os.Stat(filepath.Join(bin, "pid")); err == nil {
				cancel()
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	start := time.Now()
	e := &Executor{Workbench: "/bin/true"}
	err := e.probe(ctx, t.TempDir(), "s1", zerolog.Nop())
	if !errors.Is(err, context.Canceled) {
		t.Errorf("probe: %v, want it cancelled", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the interrupted probe took %v", d)
	}
	if got, _ := os.ReadFile(filepath.Join(bin, "scancel.args")); strings.TrimSpace(string(got)) != "123" {
		t.Errorf("scancel's arguments: %q, want the probe's job id 123", got)
	}
}

// The experiments of one script share their results root: one probe job
// checks it, not one each (the next would wait behind the array just
// submitted).
func TestOneProbeForTheExperimentsOfAScript(t *testing.T) {
	bin := t.TempDir()
	putOnPath(t, bin, map[string]string{
		// The probe (--wait) runs and is counted; an array is queued as job 42.
		"sbatch": "#!/bin/sh\ncase \"$*\" in *--wait*) echo probe >> \"$(dirname \"$0\")/probes\"; echo 7; exec sh ;; esac\n" +
			"echo 42\n",
		"squeue": "#!/bin/sh\n", "sinfo": "#!/bin/sh\necho debug\n", "scancel": "#!/bin/sh\n",
	})
	e := &Executor{Workbench: "/bin/sh", Detach: true, Out: io.Discard}
	out := t.TempDir()
	for _, experiment := range []string{"alpha", "beta"} {
		o := runner.Options{Out: out, Experiment: experiment, File: "x.star", FileHash: "h", Jobs: testJobs("a", "b"),
			KernelsDir: t.TempDir(), Executor: e, Log: zerolog.Nop()}
		var detached *DetachedError
		if _, err := runner.Run(context.Background(), o); !errors.As(err, &detached) {
			t.Fatalf("%s: %v, want it submitted and detached", experiment, err)
		}
	}
	if probes, _ := os.ReadFile(filepath.Join(bin, "probes")); strings.Count(string(probes), "probe") != 1 {
		t.Errorf("%d probe jobs for two experiments under one results root, want 1", strings.Count(string(probes), "probe"))
	}
}
