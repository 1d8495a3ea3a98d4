package results

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/parquet-go/parquet-go"
)

// Table columns: fixed ones, then param_<name>, workload_<name>, metric_<name>
// for every scalar that any record has (null where a record lacks it).
// Non-scalar values (per-layer lists, ...) become JSON text columns.

type column struct {
	name string
	kind string // "double", "int64", "string", "bool"
}

// BuildParquet rewrites results.parquet from the journal: the journal is the
// source of truth, so the table can always be rebuilt.
func BuildParquet(dir string) (int, error) {
	recs, err := ReadJournal(dir)
	if err != nil {
		return 0, err
	}
	// The last record of a job wins (a resumed run may journal it again).
	last := map[string]int{}
	for i, r := range recs {
		last[r.JobID] = i
	}
	var rows []map[string]any
	for i, r := range recs {
		if last[r.JobID] == i {
			rows = append(rows, flatten(r))
		}
	}
	cols := columns(rows)
	group := parquet.Group{}
	for _, c := range cols {
		group[c.name] = parquet.Optional(leaf(c.kind))
	}
	schema := parquet.NewSchema("results", group)
	kinds := map[string]string{}
	for _, c := range cols {
		kinds[c.name] = c.kind
	}
	// Rows are built value by value with explicit definition levels: writing
	// Go maps would store zero values (an error of 0, false, "") as nulls.
	leaves := schema.Columns()
	var buf bytes.Buffer
	w := parquet.NewGenericWriter[any](&buf, schema)
	for _, row := range rows {
		out := make(parquet.Row, len(leaves))
		for i, path := range leaves {
			v, ok := row[path[0]]
			if !ok || v == nil {
				out[i] = parquet.NullValue().Level(0, 0, i)
				continue
			}
			out[i] = parquet.ValueOf(convert(v, kinds[path[0]])).Level(0, 1, i)
		}
		if _, err := w.WriteRows([]parquet.Row{out}); err != nil {
			return 0, fmt.Errorf("write results.parquet: %w", err)
		}
	}
	if err := w.Close(); err != nil {
		return 0, fmt.Errorf("write results.parquet: %w", err)
	}
	return len(rows), writeAtomic(filepath.Join(dir, ParquetFile), buf.Bytes())
}

func flatten(r Record) map[string]any {
	row := map[string]any{
		"job_id": r.JobID, "experiment": r.Experiment, "method": r.Method, "status": r.Status,
		"attempts": int64(r.Attempts), "duration_seconds": r.Seconds, "finished": r.Finished.UTC().Format(finishedLayout),
	}
	if r.Error != "" {
		row["error"] = r.Error
	}
	if r.WorkloadName != "" {
		row["workload"] = r.WorkloadName
	}
	if r.WallSeconds > 0 {
		row["wall_seconds"] = r.WallSeconds
	}
	if r.KernelsDigest != "" {
		row["kernels_digest"] = r.KernelsDigest
	}
	for prefix, m := range map[string]map[string]any{"param_": r.Params, "workload_": r.Workload, "metric_": r.Metrics, "extra_": r.Extra} {
		for k, v := range m {
			row[prefix+k] = v
		}
	}
	return row
}

func kindOf(v any) string {
	switch x := v.(type) {
	case bool:
		return "bool"
	case string:
		return "string"
	case float64:
		if x == float64(int64(x)) && x < 1<<53 && x > -(1<<53) {
			return "int64"
		}
		return "double"
	case int, int64:
		return "int64"
	case json.Number:
		if _, err := x.Int64(); err == nil {
			return "int64"
		}
		return "double"
	case nil:
		return ""
	}
	return "json"
}

// columns picks each column's type from all rows: ints widen to doubles,
// anything mixed becomes JSON text.
func columns(rows []map[string]any) []column {
	kinds := map[string]string{}
	if len(rows) == 0 {
		// A run with no finished job yet (interrupted before the first)
		// still has the columns every row carries, so that a reader
		// selecting by status or job_id finds no rows instead of no column.
		kinds = map[string]string{"job_id": "string", "experiment": "string", "method": "string", "status": "string",
			"attempts": "int64", "duration_seconds": "double", "finished": "string"}
	}
	for _, row := range rows {
		for k, v := range row {
			kinds[k] = merge(kinds[k], kindOf(v))
		}
	}
	var cols []column
	for name, kind := range kinds {
		if kind == "" {
			kind = "string" // only nulls seen
		}
		if kind == "json" {
			kind = "string"
		}
		cols = append(cols, column{name, kind})
	}
	// By name: a parquet group's columns are in name order whatever order
	// they are given in (parquet.Group is a map), and so are the table's.
	sort.Slice(cols, func(i, j int) bool { return cols[i].name < cols[j].name })
	return cols
}

func merge(a, b string) string {
	switch {
	case a == "" || a == b:
		return b
	case b == "":
		return a
	case (a == "int64" && b == "double") || (a == "double" && b == "int64"):
		return "double"
	}
	return "json"
}

func leaf(kind string) parquet.Node {
	switch kind {
	case "double":
		return parquet.Leaf(parquet.DoubleType)
	case "int64":
		return parquet.Int(64)
	case "bool":
		return parquet.Leaf(parquet.BooleanType)
	}
	return parquet.String()
}

func convert(v any, kind string) any {
	switch kind {
	case "double":
		switch x := v.(type) {
		case float64:
			return x
		case int64:
			return float64(x)
		case int:
			return float64(x)
		}
	case "int64":
		switch x := v.(type) {
		case float64:
			return int64(x)
		case int:
			return int64(x)
		case int64:
			return x
		}
	case "bool":
		return v
	case "string":
		if s, ok := v.(string); ok {
			return s
		}
		b, _ := json.Marshal(v)
		return string(b)
	}
	return v
}

// finishedLayout is how the table writes a record's finish time.
const finishedLayout = "2006-01-02T15:04:05.000Z"

// openParquet opens dir's results.parquet; nil, with no error, when there
// is none. The caller closes f.
func openParquet(dir string) (pf *parquet.File, f *os.File, err error) {
	path := filepath.Join(dir, ParquetFile)
	f, err = os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	info, err := f.Stat()
	if err == nil {
		pf, err = parquet.OpenFile(f, info.Size())
	}
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("read %s: %w", path, err)
	}
	return pf, f, nil
}

// ParquetRows is how many rows dir's results.parquet holds, read from its
// footer; exists is false when there is none.
func ParquetRows(dir string) (rows int, exists bool, err error) {
	pf, f, err := openParquet(dir)
	if pf == nil {
		return 0, err != nil, err
	}
	defer f.Close()
	return int(pf.NumRows()), true, nil
}

// TableAhead says whether dir's results.parquet holds more rows than jobs,
// the jobs its journal has, and returns the table's rows: the table is built
// from the journal, so only a journal lost or cut short falls behind it.
func TableAhead(dir string, jobs int) (rows int, ahead bool) {
	rows, exists, err := ParquetRows(dir)
	return rows, err == nil && exists && rows > jobs
}

// ReadParquet reads dir's results.parquet back into records, for a run that
// holds its table but no journal (a run copied as its table); nil when there
// is no table. Columns map back as BuildParquet wrote them; JSON text
// columns (lists, mixed kinds) come back as text.
func ReadParquet(dir string) ([]Record, error) {
	pf, f, err := openParquet(dir)
	if pf == nil {
		return nil, err
	}
	defer f.Close()
	path := filepath.Join(dir, ParquetFile)
	names := pf.Schema().Columns()
	rd := parquet.NewReader(pf)
	defer rd.Close()
	var recs []Record
	rows := make([]parquet.Row, 64)
	for {
		n, err := rd.ReadRows(rows)
		for _, row := range rows[:n] {
			recs = append(recs, unflatten(row, names))
		}
		if errors.Is(err, io.EOF) {
			return recs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", path, err)
		}
	}
}

// unflatten is flatten's inverse, for one table row.
func unflatten(row parquet.Row, names [][]string) Record {
	r := Record{Params: map[string]any{}, Workload: map[string]any{}, Metrics: map[string]any{}}
	for _, v := range row {
		name := names[v.Column()][0]
		var x any // null: a metric the job wrote as NaN stays, as null, like the journal's
		if !v.IsNull() {
			switch v.Kind() {
			case parquet.Double:
				x = v.Double()
			case parquet.Int64:
				x = float64(v.Int64()) // as the journal's JSON decodes
			case parquet.Boolean:
				x = v.Boolean()
			default:
				x = string(v.ByteArray())
			}
		}
		str, _ := x.(string)
		num, _ := x.(float64)
		switch {
		case name == "job_id":
			r.JobID = str
		case name == "experiment":
			r.Experiment = str
		case name == "method":
			r.Method = str
		case name == "status":
			r.Status = str
		case name == "error":
			r.Error = str
		case name == "attempts":
			r.Attempts = int(num)
		case name == "duration_seconds":
			r.Seconds = num
		case name == "wall_seconds":
			r.WallSeconds = num
		case name == "finished":
			r.Finished, _ = time.Parse(finishedLayout, str)
		case name == "kernels_digest":
			r.KernelsDigest = str
		case name == "workload":
			r.WorkloadName = str
		case strings.HasPrefix(name, "param_"):
			if x != nil {
				r.Params[strings.TrimPrefix(name, "param_")] = x
			}
		case strings.HasPrefix(name, "workload_"):
			if x != nil {
				r.Workload[strings.TrimPrefix(name, "workload_")] = x
			}
		case strings.HasPrefix(name, "metric_"):
			r.Metrics[strings.TrimPrefix(name, "metric_")] = x
		}
	}
	return r
}
