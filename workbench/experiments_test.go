package main

import (
	"maps"
	"testing"

	"github.com/vlkv/vlkv/gohost/expt"
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
