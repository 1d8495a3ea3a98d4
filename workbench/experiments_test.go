package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vlkv/vlkv/gohost/expt"
	"github.com/vlkv/vlkv/gohost/testpy"
	"github.com/vlkv/vlkv/gohost/worker"
)

// Progress lines tell apart jobs that differ only in their workload: by
// the knobs that vary between the experiment's jobs, or by its name.
func TestWorkloadLabelsShowWhatVaries(t *testing.T) {
	lmms := func(id, task string, shard int) expt.Job {
		return expt.Job{ID: id, WorkloadName: "lmms", Workload: map[string]any{"model": "/m", "tasks": task, "shard": shard, "shards": 2}}
	}
	tests := []struct {
		name string
		jobs []expt.Job
		want map[string]string
	}{
		{name: "one workload", jobs: []expt.Job{{ID: "a", WorkloadName: "synthetic", Workload: map[string]any{"seed": 0}},
			{ID: "b", WorkloadName: "synthetic", Workload: map[string]any{"seed": 0}}}, want: map[string]string{}},
		{name: "tasks and shards", jobs: []expt.Job{lmms("a", "chartqa", 0), lmms("b", "chartqa", 1), lmms("c", "docvqa_val", 0)},
			want: map[string]string{"a": "@lmms(shard=0 tasks=chartqa)", "b": "@lmms(shard=1 tasks=chartqa)", "c": "@lmms(shard=0 tasks=docvqa_val)"}},
		{name: "two workloads on their defaults", jobs: []expt.Job{{ID: "a", WorkloadName: "synthetic"}, {ID: "b", WorkloadName: "trace"}},
			want: map[string]string{"a": "@synthetic", "b": "@trace"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := workloadLabels(tc.jobs); !maps.Equal(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
}

// A prompt's newline and spaces stay inside its value: plan prints one line
// per job, the prompt quoted.
func TestPlanQuotesAPromptOnTheJobsLine(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "own.star")
	os.WriteFile(script, []byte(`experiment(name = "own", methods = ["full", "h2o"], grid = {"budget": [0.5]},
    workloads = [workload("vlm", model = "/m", images = "/m/cat.png", prompt = "USER: <image>\nWhat is it? ASSISTANT:", decode_steps = f)
                 for f in [4, 8]])
`), 0o644)
	code, stdout, stderr := runCLI(t, "plan", script)
	if code != 0 {
		t.Fatalf("plan: exit %d: %s", code, stderr)
	}
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	if len(lines) != 5 {
		t.Fatalf("want a header and 4 job lines, got %d lines:\n%s", len(lines), stdout)
	}
	for _, line := range lines[1:] {
		if !strings.Contains(line, `prompt="USER: <image>\nWhat is it? ASSISTANT:"`) || !strings.HasSuffix(line, ")") {
			t.Errorf("job line without its quoted prompt: %q", line)
		}
	}
}

// The defaults and protocol values every job carries (plannedDefaults) are
// the sources' as the worker compares them: today's schema.json, sent as
// JSON the way Go encodes it (1.0 as 1, lists, bools), refuses no method,
// workload or protocol. A false
// refusal would fail every job of every run.
func TestPlannedDefaultsOfTodaysSchemaAreTheSources(t *testing.T) {
	py := testpy.Python(t)
	s, err := expt.LoadSchema("../kernels_py/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	sent := map[string]map[string]map[string]any{"method": {}, "workload": {}, "protocol": {}}
	for name, m := range s.Methods {
		sent["method"][name] = m.Params.Defaults()
		for protocol := range s.Protocols {
			sent["protocol"][name+" "+protocol] = m.ProtocolParams(protocol)
		}
	}
	for name, w := range s.Workloads {
		sent["workload"][name] = w.Params.Defaults()
	}
	data, err := json.Marshal(sent)
	if err != nil {
		t.Fatal(err)
	}
	check := `import json, sys
from kernels_py.methods import METHODS
from kernels_py.workloads import WORKLOADS
sent = json.load(sys.stdin)
for kind, registry in (("method", METHODS), ("workload", WORKLOADS)):
    assert set(sent[kind]) == set(registry), (kind, sorted(set(sent[kind]) ^ set(registry)))
    for name, defaults in sent[kind].items():
        registry[name].check_planned_defaults(defaults)
for key, sets in sent["protocol"].items():
    name, protocol = key.split(" ")
    METHODS[name].check_planned_protocol(protocol, sets, {**sent["method"][name], **sets})
print(len(sent["method"]), len(sent["workload"]), len(sent["protocol"]))
`
	cmd := exec.Command(py, "-c", check)
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "PYTHONPATH=..")
	cmd.Stdin = bytes.NewReader(data)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	if want := fmt.Sprintf("%d %d %d", len(s.Methods), len(s.Workloads), len(s.Methods)*len(s.Protocols)); strings.TrimSpace(string(out)) != want {
		t.Errorf("checked %q, want %q", out, want)
	}
}

func TestTooManyWorkersWarns(t *testing.T) {
	for _, tc := range []struct {
		asked, starting int
		device          worker.Device
		want            string // "" for no warning
	}{
		{0, 1, worker.CPU, ""},
		{2, 2, worker.CPU, ""},
		{8, 3, worker.CPU, ""}, // 3 jobs: 3 workers start
		{8, 8, worker.CUDA, ""},
		{8, 5, worker.CPU, "--workers 8: 5 workers (each a Python process with torch) will share 4 CPUs, so each job runs slower; --workers 4 or fewer keeps a CPU each"},
	} {
		if got := tooManyWorkers(tc.asked, tc.starting, tc.device, 4); got != tc.want {
			t.Errorf("%d asked, %d starting on %s: %q, want %q", tc.asked, tc.starting, tc.device, got, tc.want)
		}
	}
}
