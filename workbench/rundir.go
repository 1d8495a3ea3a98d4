package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/slurm"
)

// checkRunPath says, when dir is not a run directory, what it is instead
// and what to give: nothing there, a file, an experiment's folder (its runs
// listed) or something else.
func checkRunPath(dir string) error {
	info, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("run directory %s does not exist: give OUT/<experiment>/<run-id>", dir)
	case err != nil:
		return fmt.Errorf("run directory %s: %w", dir, err)
	case !info.IsDir():
		return fmt.Errorf("%s is not a run directory but a file: give OUT/<experiment>/<run-id>", dir)
	case results.IsRun(dir):
		return nil
	}
	runs, err := results.Runs(dir)
	if err != nil {
		return fmt.Errorf("run directory %s: %w", dir, err)
	}
	if len(runs) == 0 {
		if newest := newestRuns(dir); len(newest) > 0 {
			// The results root (--out, "results" by default): its experiments' newest runs are what was meant.
			return fmt.Errorf("%s is not a run directory but a results root: give a run of one of its experiments, "+
				"OUT/<experiment>/<run-id>; the newest of each:\n  %s", dir, strings.Join(newest, "\n  "))
		}
		return fmt.Errorf("%s is not a run directory (no %s or %s): give OUT/<experiment>/<run-id>", dir,
			results.ManifestFile, results.JournalFile)
	}
	runs[len(runs)-1] += " (the newest)"
	return fmt.Errorf("%s is not a run directory but an experiment's folder: give one of its runs:\n  %s", dir,
		strings.Join(runs, "\n  "))
}

// newestRuns is the newest run of each experiment's folder in root, in the
// folders' order; none when root holds no experiment's folder.
func newestRuns(root string) []string {
	entries, err := os.ReadDir(root)
	if err != nil {
		return nil
	}
	var newest []string
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		if runs, err := results.Runs(filepath.Join(root, e.Name())); err == nil && len(runs) > 0 {
			newest = append(newest, runs[len(runs)-1])
		}
	}
	return newest
}

// syncRun brings the results.parquet of a run this process holds in step
// with its journal, which a killed run leaves ahead of the table (or
// without one): it journals what Slurm tasks recorded in segments, rebuilds
// the table, and records the run's end once every job of its plan has a
// row. It returns the rows.
func syncRun(run *results.Run, log zerolog.Logger) (int, error) {
	if err := mergeSegments(run); err != nil {
		return 0, err
	}
	last, err := results.Finished(run.Dir)
	if err != nil {
		return 0, err
	}
	// A journal behind its table (lost, or cut short in a copy) must not shrink it.
	if had, ahead := results.TableAhead(run.Dir, len(last)); ahead {
		log.Warn().Str("run", run.Dir).Msgf("the journal has %d jobs and %s %d rows: the table is kept as it is",
			len(last), results.ParquetFile, had)
		return had, nil
	}
	rows, err := results.BuildParquet(run.Dir)
	if err != nil {
		return 0, err
	}
	complete, err := runComplete(run, rows, last)
	if err != nil || !complete {
		return rows, err
	}
	end := time.Now()
	return rows, run.UpdateManifest(func(m *results.Manifest) { m.Ended = &end })
}

// runComplete says whether a run without an end has a row for every job of
// its newest plan (the job ids it records, else as many rows as jobs); last
// is each job's last journaled record.
func runComplete(run *results.Run, rows int, last map[string]results.Record) (bool, error) {
	m := run.Manifest()
	if m.Ended != nil || m.Jobs == 0 {
		return false, nil
	}
	planned, err := results.ReadJobs(run.Dir)
	if err != nil || planned == nil {
		return rows >= m.Jobs, err
	}
	return results.Count(last, planned, nil).Done == len(planned), nil
}

// syncForReading brings a run's results.parquet in step with its journal
// before something reads the table (a notebook). A run another workbench is
// writing cannot be rebuilt here: its table is read as it is, with a
// warning, or, with none yet, refused.
func (a *app) syncForReading(dir string) error {
	if err := checkRunPath(dir); err != nil {
		return err
	}
	if tableCurrent(dir) {
		return nil // a finished run is only read: nothing written into it, which may be read-only
	}
	run, err := results.Open(dir)
	if err == nil {
		defer run.Close()
		if _, err := syncRun(run, a.log); err != nil {
			return fmt.Errorf("rebuild %s from the journal: %w", filepath.Join(dir, results.ParquetFile), err)
		}
		return nil
	}
	_, perr := os.Stat(filepath.Join(dir, results.ParquetFile))
	hasTable := perr == nil
	var locked *results.LockedError
	switch {
	case errors.As(err, &locked) && hasTable:
		a.log.Warn().Str("run", dir).Msgf("%s is being written by %s: reading its %s as last rebuilt, which may lack jobs its journal has",
			dir, locked.Holder.Name(), results.ParquetFile)
		return nil
	case errors.As(err, &locked):
		return fmt.Errorf("%s is being written by %s and has no %s yet: wait for it to end (workbench status %s says how far it got)",
			dir, locked.Holder.Name(), results.ParquetFile, dir)
	case hasTable:
		a.log.Warn().Str("run", dir).Err(err).Msgf("cannot rebuild %s from the journal: reading it as it is", results.ParquetFile)
		return nil
	}
	return fmt.Errorf("%s has no %s, and it cannot be rebuilt from the journal: %w", dir, results.ParquetFile, err)
}

// tableCurrent says whether dir's results.parquet already holds what its
// journal has: a finished run with a row per journaled job, or a table
// without a journal beside it (a run copied as its table).
func tableCurrent(dir string) bool {
	rows, exists, err := results.ParquetRows(dir)
	if err != nil || !exists {
		return false
	}
	if _, err := os.Stat(filepath.Join(dir, results.JournalFile)); errors.Is(err, fs.ErrNotExist) {
		return true
	}
	if m, err := results.ReadManifest(dir); err != nil || m.Ended == nil {
		return false
	}
	last, err := results.Finished(dir)
	return err == nil && len(last) == rows
}

// beingWritten is what status says of a run another workbench holds.
func beingWritten(dir string, locked *results.LockedError) string {
	if subs, _ := slurm.Submissions(dir); len(subs) > 0 {
		return fmt.Sprintf("%s is being written by %s (it follows the run's Slurm array); reporting only", dir, locked.Holder.Name())
	}
	return fmt.Sprintf("%s is being written by %s (a run or resume of it is under way); reporting only, "+
		"from the journal (results.parquet is rebuilt when that ends)", dir, locked.Holder.Name())
}

// describeRows is status's line on a run's rows against its newest plan:
// jobs done and failed, and the rows of jobs an earlier script planned.
func describeRows(dir string, last map[string]results.Record) string {
	m, _ := results.ReadManifest(dir) // none: a plan of unknown size
	total := m.Jobs
	planned, _ := results.ReadJobs(dir)
	if planned == nil { // a run from before job ids were recorded: counts only
		failed := 0
		for _, rec := range last {
			if rec.Status != results.StatusOK {
				failed++
			}
		}
		if total > 0 && len(last) > total {
			return fmt.Sprintf("%s: %d rows for a plan of %s (some are of jobs an earlier script planned), %d failed",
				dir, len(last), plural(total, "job"), failed)
		}
		return fmt.Sprintf("%s: %d of %d jobs done, %d failed", dir, len(last), total, failed)
	}
	t := results.Count(last, planned, nil)
	return fmt.Sprintf("%s: %d of %d jobs done, %d failed", dir, t.Done, len(planned), t.Failed) +
		unplannedRows(len(last), t, "its latest script's plan")
}

// localResumeHint is the command that goes on with a local run that status
// finds short of its plan or holding failed jobs: --resume continues the
// newest run of the experiment under the run's results root, so the hint is
// given for that run only; "" otherwise, or when the manifest names no
// script.
func (a *app) localResumeHint(dir string, last map[string]results.Record) string {
	m, err := results.ReadManifest(dir)
	planned, _ := results.ReadJobs(dir)
	script := m.CurrentScript().File
	if err != nil || planned == nil || script == "" {
		return ""
	}
	// From the absolute path: a trailing slash (a shell's completion) or "."
	// would make the run's own folder pass for its experiment's.
	abs, err := filepath.Abs(dir)
	if err != nil {
		return ""
	}
	experiment, root := filepath.Base(filepath.Dir(abs)), filepath.Dir(filepath.Dir(abs))
	if newest, err := results.Latest(root, experiment); err != nil || newest != abs {
		return ""
	}
	if rows, ahead := results.TableAhead(dir, len(last)); ahead { // a resume refuses it, and says why
		return fmt.Sprintf("its %s has %s but its %s only %s: the journal was lost or cut short, and a --resume "+
			"would refuse the run; restore %s (from a backup or the copy it came from), or start a new run without "+
			"--resume (this one keeps its table)", results.ParquetFile, plural(rows, "row"), results.JournalFile,
			plural(len(last), "finished job"), results.JournalFile)
	}
	cmd := strings.Join([]string{shellQuote(a.prog), "run", shellQuote(script), "--experiment", shellQuote(experiment),
		"--out", shellQuote(root), "--resume"}, " ")
	t := results.Count(last, planned, nil)
	switch {
	case t.Done < len(planned):
		return "to continue it: " + cmd + " (add the --workers, --python and --device it ran with)"
	case t.Failed > 0:
		return "to run its failed jobs again, once their cause is fixed: " + cmd + " --retry-failed"
	}
	return ""
}
