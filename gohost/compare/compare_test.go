package compare

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/vlkv/vlkv/gohost/results"
)

func rec(id, method string, params map[string]any, metrics map[string]any) results.Record {
	return results.Record{JobID: id, Method: method, Params: params, Workload: map[string]any{"seed": 0.0},
		Status: results.StatusOK, Metrics: metrics, KernelsDigest: "d1"}
}

func runOf(experiment string, rows ...results.Record) *Run {
	return &Run{Dir: experiment, Manifest: results.Manifest{Experiment: experiment, FileHash: "h"}, Rows: rows}
}

func TestCompare(t *testing.T) {
	base := func() *Run {
		return runOf("e",
			rec("a", "full", nil, map[string]any{"err": 0.0, "bytes": 100.0, "prefill_seconds": 1.0}),
			rec("b", "h2o", map[string]any{"budget": 0.25, "recent": 0.5}, map[string]any{"err": 0.3, "bytes": 25.0, "prefill_seconds": 1.0}),
			rec("c", "h2o", map[string]any{"budget": 0.5, "recent": 0.5}, map[string]any{"err": 0.2, "bytes": 50.0, "prefill_seconds": 1.0}),
		)
	}
	t.Run("identical runs", func(t *testing.T) {
		b := base()
		b.Rows[0].Metrics["prefill_seconds"] = 2.0 // times differ run to run: not a change
		r, err := Compare(base(), b, Options{Tolerance: 1e-9})
		if err != nil || r.Changed != 0 || len(r.Rows) != 3 || len(r.OnlyA)+len(r.OnlyB) != 0 || len(r.Warnings) != 0 {
			t.Fatalf("%+v %v", r, err)
		}
	})
	t.Run("a method one run lacks", func(t *testing.T) {
		// A stopped run, or a script that added a method: its rows are listed
		// one by one, by their own knobs, and the others still join.
		a := base()
		a.Rows = append(a.Rows, rec("d", "kivi", map[string]any{"bits": 2.0}, map[string]any{"err": 0.4}),
			rec("e", "kivi", map[string]any{"bits": 4.0}, map[string]any{"err": 0.1}))
		r, err := Compare(a, base(), Options{})
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Join(r.OnlyA, "|"); got != "bits=2 method=kivi|bits=4 method=kivi" || len(r.Rows) != 3 || r.Changed != 0 {
			t.Errorf("only in A %q, %d rows joined (%d changed); want the two kivi rows apart and 3 joined", got, len(r.Rows), r.Changed)
		}
	})
	t.Run("a knob added since", func(t *testing.T) {
		// B's version gave h2o a knob A's rows lack: the rows still join.
		b := base()
		for i := 1; i < 3; i++ {
			b.Rows[i].Params["sink"] = 4.0
		}
		r, err := Compare(base(), b, Options{})
		if err != nil || len(r.Rows) != 3 || len(r.OnlyA)+len(r.OnlyB) != 0 {
			t.Fatalf("%d rows joined, only %v %v: %v", len(r.Rows), r.OnlyA, r.OnlyB, err)
		}
	})
	t.Run("a knob added to another method", func(t *testing.T) {
		// B's version gave full a budget knob: full's rows join without it, and
		// h2o's sweep over budget still joins row by row, not averaged.
		b := base()
		b.Rows[0].Params = map[string]any{"budget": 1.0}
		r, err := Compare(base(), b, Options{})
		if err != nil || len(r.Rows) != 3 || len(r.OnlyA)+len(r.OnlyB) != 0 {
			t.Fatalf("%d rows joined, only %v %v: %v", len(r.Rows), r.OnlyA, r.OnlyB, err)
		}
		for _, row := range r.Rows {
			if row.A != 1 || row.B != 1 {
				t.Errorf("row %s joins %d rows of A and %d of B, want one each", row.Key, row.A, row.B)
			}
		}
	})
	t.Run("one knob changed", func(t *testing.T) {
		b := base()
		for i := 1; i < 3; i++ {
			b.Rows[i].Params = map[string]any{"budget": b.Rows[i].Params["budget"], "recent": 0.25}
			b.Rows[i].JobID += "'"
		}
		b.Rows[2].Metrics = map[string]any{"err": 0.1, "bytes": 50.0, "prefill_seconds": 1.0}
		r, err := Compare(base(), b, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Varied) != 1 || r.Varied[0] != "recent: 0.5 -> 0.25 (h2o)" || strings.Join(r.Keys, ",") != "budget,method" {
			t.Fatalf("varied %v keys %v", r.Varied, r.Keys)
		}
		if r.Changed != 1 || len(r.Rows) != 3 {
			t.Fatalf("changed %d of %d rows", r.Changed, len(r.Rows))
		}
		for _, row := range r.Rows {
			if row.Changed != (row.Key == "budget=0.5 method=h2o") {
				t.Errorf("row %s changed=%v", row.Key, row.Changed)
			}
			for _, d := range row.Deltas {
				if d.Metric == "err" && row.Changed && (d.Abs > -0.0999 || d.Abs < -0.1001 || d.Rel > -0.4999 || d.Rel < -0.5001) {
					t.Errorf("delta %+v", d)
				}
			}
		}
		// --fail-if on the change.
		worse, _ := ParseGuard("err<-10%")
		if v, err := r.Violations(worse); err != nil || len(v) != 1 {
			t.Errorf("violations %v %v", v, err)
		}
		better, _ := ParseGuard("err>0")
		if v, _ := r.Violations(better); len(v) != 0 {
			t.Errorf("violations %v", v)
		}
	})
	t.Run("rows in one run only and code differences", func(t *testing.T) {
		b := base()
		b.Rows = b.Rows[:2]
		b.Rows[1].KernelsDigest = "d2"
		b.Rows = append(b.Rows, rec("d", "snapkv", map[string]any{"budget": 0.5}, map[string]any{"err": 0.1}))
		r, _ := Compare(base(), b, Options{})
		if len(r.OnlyA) != 1 || r.OnlyA[0] != "budget=0.5 method=h2o" || len(r.OnlyB) != 1 || !strings.Contains(r.OnlyB[0], "snapkv") {
			t.Errorf("only A %v only B %v", r.OnlyA, r.OnlyB)
		}
		for _, row := range r.Rows {
			if row.KernelsDiffer != (row.Key == "budget=0.25 method=h2o") {
				t.Errorf("row %s kernels differ %v", row.Key, row.KernelsDiffer)
			}
		}
	})
	t.Run("different experiments, by keys, unknown names", func(t *testing.T) {
		b := base()
		b.Manifest.Experiment = "other"
		r, err := Compare(base(), b, Options{By: []string{"method"}})
		if err != nil || len(r.Warnings) != 1 || !strings.Contains(r.Warnings[0], "different experiments (e, other)") {
			t.Fatalf("%v %v", r.Warnings, err)
		}
		if len(r.Rows) != 2 || r.Rows[1].A != 2 { // h2o's two rows averaged
			t.Errorf("rows %+v", r.Rows)
		}
		if _, err := Compare(base(), b, Options{By: []string{"nope"}}); err == nil || !strings.Contains(err.Error(), "--by nope") {
			t.Errorf("unknown key: %v", err)
		}
		if _, err := Compare(base(), b, Options{Metrics: []string{"erro"}}); err == nil ||
			!strings.Contains(err.Error(), `unknown metric "erro": the runs share bytes, err, prefill_seconds`) {
			t.Errorf("unknown metric: %v", err)
		}
	})
}

func TestParseGuard(t *testing.T) {
	for _, tc := range []struct {
		in  string
		ok  bool
		rel bool
		x   float64
	}{{"err>0.01", true, false, 0.01}, {"ratio<-5%", true, true, -0.05}, {"err", false, false, 0}, {">1", false, false, 0}, {"err>x", false, false, 0},
		{"err>nan", false, false, 0}, {"err<-inf", false, false, 0}, {"err>Inf%", false, false, 0}} {
		g, err := ParseGuard(tc.in)
		if (err == nil) != tc.ok || (tc.ok && (g.Relative != tc.rel || g.Threshold != tc.x)) {
			t.Errorf("ParseGuard(%q) = %+v, %v", tc.in, g, err)
		}
	}
}

// A guard also fails on a job B failed or dropped; JSON carries a relative
// change from 0 as null; explicit --by keys stay as given.
func TestGuardsJSONAndExplicitKeys(t *testing.T) {
	a := runOf("e",
		rec("a", "full", nil, map[string]any{"err": 0.0}),
		rec("b", "h2o", map[string]any{"budget": 0.5}, map[string]any{"err": 0.2}),
		rec("c", "h2o", map[string]any{"budget": 0.25}, map[string]any{"err": 0.3}))
	b := runOf("e",
		rec("a", "full", nil, map[string]any{"err": 0.1}),
		rec("b", "h2o", map[string]any{"budget": 0.5}, nil))
	b.Rows[1].Status = results.StatusFailed
	r, err := Compare(a, b, Options{})
	if err != nil {
		t.Fatal(err)
	}
	g, _ := ParseGuard("err>1")
	v, err := r.Failures([]Guard{g})
	if err != nil || len(v) != 2 || !strings.Contains(strings.Join(v, "\n"), "ok in A, failed in B") ||
		!strings.Contains(strings.Join(v, "\n"), "budget=0.25 method=h2o: ok in A, missing from B") {
		t.Errorf("violations %q %v", v, err)
	}
	data, err := json.Marshal(r)
	if err != nil || !strings.Contains(string(data), `"rel":null`) {
		t.Errorf("json %s %v", data, err)
	}
	r, _ = Compare(a, b, Options{By: []string{"budget", "budget"}})
	if strings.Join(r.Keys, ",") != "budget" || len(r.Rows) == 0 || r.Rows[0].Key != "budget=-" {
		t.Errorf("keys %v rows %+v", r.Keys, r.Rows)
	}
	if _, err := ParseGuard("err>=0"); err == nil || !strings.Contains(err.Error(), "only > and <") {
		t.Errorf(">=: %v", err)
	}
}

// Guards judge B's regressions: a job ok in A and failed or missing in B,
// listed once whatever the number of guards, and a metric B lost (null).
func TestFailures(t *testing.T) {
	failed := func(r results.Record) results.Record { r.Status = results.StatusFailed; return r }
	a1 := rec("1", "h2o", map[string]any{"budget": 0.1}, map[string]any{"err": 0.1})
	a2 := rec("2", "h2o", map[string]any{"budget": 0.2}, map[string]any{"err": 0.2})
	a3 := rec("3", "h2o", map[string]any{"budget": 0.3}, map[string]any{"err": 0.3})
	for _, tc := range []struct {
		name   string
		a, b   []results.Record
		guards []string
		want   []string
	}{
		{"failed in A already, missing from B", []results.Record{a1, failed(a2)}, []results.Record{a1},
			[]string{"err>1"}, nil},
		{"ok in A, missing from B", []results.Record{a1, a2}, []results.Record{a1},
			[]string{"err>1"}, []string{"budget=0.2 method=h2o: ok in A, missing from B"}},
		{"one line per lost job, whatever the guards", []results.Record{a1, a2}, []results.Record{a1, failed(a2)},
			[]string{"err>1", "err<-1"}, []string{"budget=0.2 method=h2o: ok in A, failed in B"}},
		{"metric lost in B", []results.Record{a1, a2}, []results.Record{a1, rec("2", "h2o", map[string]any{"budget": 0.2}, map[string]any{"err": nil})},
			[]string{"err>0.001"}, []string{"err>0.001: budget=0.2 method=h2o: err 0.2 -> NaN"}},
		{"metric absent in B", []results.Record{a1, a2}, []results.Record{a1, rec("2", "h2o", map[string]any{"budget": 0.2}, map[string]any{})},
			[]string{"err<-50%"}, []string{"err<-50%: budget=0.2 method=h2o: err 0.2 -> NaN"}},
		{"B with no rows", []results.Record{a1, failed(a2), a3}, nil,
			[]string{"err>1"}, []string{"budget=0.1 method=h2o: ok in A, missing from B", "budget=0.3 method=h2o: ok in A, missing from B"}},
		{"no guards", []results.Record{a1, a2}, []results.Record{a1}, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := Compare(runOf("e", tc.a...), runOf("e", tc.b...), Options{Tolerance: 1e-9})
			if err != nil {
				t.Fatal(err)
			}
			var guards []Guard
			for _, s := range tc.guards {
				g, err := ParseGuard(s)
				if err != nil {
					t.Fatal(err)
				}
				guards = append(guards, g)
			}
			got, err := r.Failures(guards)
			if err != nil || strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Errorf("failures %q %v, want %q", got, err, tc.want)
			}
		})
	}
}

// A run with no rows joins on the other's parameters: each row of the other
// is listed by its own key, with its status; a job new in B keeps its status.
func TestOneSideEmpty(t *testing.T) {
	a := []results.Record{rec("1", "full", nil, map[string]any{"err": 0.0}),
		rec("2", "h2o", map[string]any{"budget": 0.5}, map[string]any{"err": 0.2})}
	a[1].Status = results.StatusFailed
	for _, tc := range []struct {
		name         string
		a, b         *Run
		only, status []string
	}{
		{"B empty", runOf("e", a...), runOf("e"), []string{"method=full", "method=h2o"}, []string{"ok", "failed"}},
		{"A empty", runOf("e"), runOf("e", a...), []string{"method=full", "method=h2o"}, []string{"ok", "failed"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := Compare(tc.a, tc.b, Options{})
			if err != nil {
				t.Fatal(err)
			}
			only, status := r.OnlyA, r.OnlyAStatus
			if len(tc.a.Rows) == 0 {
				only, status = r.OnlyB, r.OnlyBStatus
			}
			if strings.Join(only, "|") != strings.Join(tc.only, "|") || strings.Join(status, "|") != strings.Join(tc.status, "|") ||
				strings.Join(r.Keys, ",") != "method" || strings.Join(r.Metrics, ",") != "err" {
				t.Errorf("only %q status %q keys %v metrics %v", only, status, r.Keys, r.Metrics)
			}
		})
	}
}

// The JSON holds lists where there is nothing to list, as compare_runs
// does, and null for a value B lost.
func TestJSONLists(t *testing.T) {
	a := rec("1", "full", nil, map[string]any{"err": 0.1})
	for _, tc := range []struct {
		name string
		a, b *Run
		want []string
	}{
		{"both empty", runOf("e"), runOf("e"), []string{`"keys":[]`, `"varied":[]`, `"warnings":[]`, `"rows":[]`,
			`"only_a":[]`, `"only_b":[]`, `"metrics":[]`, `"only_a_params":[]`}},
		{"identical", runOf("e", a), runOf("e", a), []string{`"only_a":[]`, `"only_b":[]`, `"varied":[]`, `"rows":[{`}},
		{"no metrics", runOf("e", rec("1", "full", nil, nil)), runOf("e", rec("1", "full", nil, nil)), []string{`"deltas":[]`}},
		{"lost metric", runOf("e", a), runOf("e", rec("1", "full", nil, map[string]any{"err": nil})),
			[]string{`"a":0.1`, `"b":null`, `"abs":null`, `"rel":null`, `"changed":true`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := Compare(tc.a, tc.b, Options{})
			if err != nil {
				t.Fatal(err)
			}
			data, err := json.Marshal(r)
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range tc.want {
				if !strings.Contains(string(data), w) {
					t.Errorf("no %s in %s", w, data)
				}
			}
			if strings.Contains(string(data), ":null,") && tc.name != "lost metric" {
				t.Errorf("null in %s", data)
			}
		})
	}
}
