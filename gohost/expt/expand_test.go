package expt

import (
	"fmt"
	"testing"
)

// A workload that declares expand knobs spreads over one job per item and
// per index, for grid and extra jobs alike, and the job count says so.
func TestExpandSpreadsAWorkloadOverJobs(t *testing.T) {
	s := testSchema(t)
	s.Workloads["bench"] = &Workload{Name: "bench", Params: Params{
		"tasks":  {Name: "tasks", Type: TypeStr, Default: ""},
		"shards": {Name: "shards", Type: TypeInt, Default: int64(1)},
		"shard":  {Name: "shard", Type: TypeInt, Default: int64(0)},
	}, Expand: map[string]string{"tasks": "each", "shards": "index:shard"}}
	plan := mustLoad(t, s, `experiment(name = "a", methods = ["full"],
    workloads = [workload("bench", tasks = "x, y,x,", shards = 2)],
    extra = [{"method": "full", "workload": workload("bench", tasks = "z")}])`)
	var got []string
	for _, j := range plan.Experiments[0].Jobs {
		got = append(got, fmt.Sprintf("%v/%v", j.Workload["tasks"], j.Workload["shard"]))
	}
	if fmt.Sprint(got) != "[x/0 y/0 x/1 y/1 z/0]" {
		t.Errorf("jobs %v, want one per task and shard (duplicates and blanks dropped), then the extra", got)
	}

	for expand, want := range map[string]string{
		"each":        "<nil>",
		"index:shard": `expand "tasks": index:shard needs int params on both sides`, // tasks is a str
		"index:nope":  `expand "tasks": index:nope needs int params on both sides`,
		"sometimes":   `expand "tasks": "sometimes" is neither each nor index:KNOB`,
	} {
		if err := checkExpand(map[string]string{"tasks": expand}, s.Workloads["bench"].Params); fmt.Sprint(err) != want {
			t.Errorf("%s: err = %v, want %s", expand, err, want)
		}
	}
}
