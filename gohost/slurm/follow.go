package slurm

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
)

// Follow watches one submitted array: it hands each record its tasks
// append to their segments to Deliver, once, and reports the tasks' states
// as squeue gives them, until every pending job is recorded or every task
// has ended.
type Follow struct {
	RunDir     string
	Submission Submission
	Plan       Plan
	Pending    map[string]bool // job ids not recorded yet; emptied as records arrive
	Deliver    func(results.Record) error
	Log        zerolog.Logger
	Poll       time.Duration
	Interrupt  func(arrayJob string) bool // see Executor.Interrupt
}

// endedGrace is how long a cancelled array's tasks get to leave the queue
// while the host keeps journaling what they finished.
const endedGrace = 20 * time.Second

// Run follows the array. It returns nil when every pending job is recorded,
// an *IncompleteError when the array ended without recording some, a
// *DetachedError when the user chose to leave it running, and the
// context's error after cancelling it.
func (f *Follow) Run(ctx context.Context) error {
	poll := f.Poll
	if poll <= 0 {
		poll = 2 * time.Second
	}
	reader := results.NewSubmissionReader(f.RunDir, f.Submission.ID)
	id := f.Submission.ArrayJob
	last := map[int]TaskState{}
	shown, failures, polls := "", 0, 0
	warned := map[string]bool{} // what Stuck said, once each
	for {
		if err := f.deliver(reader); err != nil {
			return err
		}
		if len(f.Pending) == 0 {
			f.awaitEnd(ctx)
			return nil
		}
		tasks, err := Tasks(ctx, id)
		if ctx.Err() != nil {
			return f.interrupted(reader)
		}
		polls++
		if err != nil {
			failures++
			if failures == 1 || failures%30 == 0 {
				f.Log.Warn().Err(err).Str("array", id).Msg("squeue failed; the array is still followed")
			}
		} else {
			failures = 0
			for _, t := range tasks {
				last[t.Task] = t
			}
			if s := summarize(tasks); s != shown && s != "" {
				f.Log.Info().Str("array", id).Str("tasks", s).Int("jobs_left", len(f.Pending)).Msg("slurm")
				shown = s
				for _, msg := range Stuck(id, tasks) {
					if !warned[msg] {
						warned[msg] = true
						f.Log.Warn().Str("array", id).Msg(msg)
					}
				}
			}
			if ended(tasks) && (len(last) > 0 || polls > 5) {
				if err := f.deliver(reader); err != nil {
					return err
				}
				if len(f.Pending) == 0 {
					return nil
				}
				return f.incomplete(last)
			}
		}
		select {
		case <-ctx.Done():
			return f.interrupted(reader)
		case <-time.After(poll):
		}
	}
}

// awaitEnd gives the tasks, whose jobs are all recorded, a moment to end,
// so that nothing writes into the run once Run has returned.
func (f *Follow) awaitEnd(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, endedGrace)
	defer cancel()
	for ctx.Err() == nil {
		if tasks, err := Tasks(ctx, f.Submission.ArrayJob); err != nil || ended(tasks) {
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func ended(tasks []TaskState) bool {
	for _, t := range tasks {
		if !t.Terminal() {
			return false
		}
	}
	return true
}

// deliver hands on the new records of pending jobs.
func (f *Follow) deliver(reader *results.SegmentReader) error {
	recs, err := reader.Read()
	for _, rec := range recs {
		if !f.Pending[rec.JobID] {
			continue
		}
		delete(f.Pending, rec.JobID)
		if err := f.Deliver(rec); err != nil {
			return err
		}
	}
	if err != nil {
		return fmt.Errorf("read the tasks' journal segments: %w", err)
	}
	return nil
}

// interrupted asks whether to cancel the array or leave it running; after
// cancelling, it journals what the tasks finish while they stop.
func (f *Follow) interrupted(reader *results.SegmentReader) error {
	id := f.Submission.ArrayJob
	if f.Interrupt != nil && !f.Interrupt(id) {
		return &DetachedError{Dir: f.RunDir, ArrayJob: id}
	}
	ctx, cancel := context.WithTimeout(context.Background(), endedGrace)
	defer cancel()
	if err := Cancel(ctx, id); err != nil {
		return fmt.Errorf("interrupted, and cancelling Slurm array %s failed (%w): stop it with scancel %s", id, err, id)
	}
	f.Log.Warn().Str("array", id).Msg("cancelled the Slurm array; journaling what its tasks finished")
	for ctx.Err() == nil {
		if err := f.deliver(reader); err != nil {
			return err
		}
		tasks, err := Tasks(ctx, id)
		if err == nil && ended(tasks) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := f.deliver(reader); err != nil {
		return err
	}
	return context.Canceled
}

// IncompleteError is an array that ended with jobs not recorded.
type IncompleteError struct {
	ArrayJob string
	Missing  int
	Tasks    []string // what each task with missing jobs says of its end
	Resume   string   // the command that resumes the run; "" when not known
}

func (e *IncompleteError) Error() string {
	return fmt.Sprintf("Slurm array %s ended with %d job(s) not run: %s. The jobs its tasks finished are kept; "+
		"to submit the rest: %s", e.ArrayJob, e.Missing, strings.Join(e.Tasks, "; "), resumeCommand(e.Resume))
}

// ResumeCommand is how a message says to resume the submission's run.
func (s Submission) ResumeCommand() string { return resumeCommand(s.Resume) }

// resumeCommand is how a message says to resume a run: the command its
// host was given where known.
func resumeCommand(command string) string {
	if command == "" || command == "--resume" {
		return "`workbench run SCRIPT --out DIR --executor slurm ... --resume`, with the run's script and flags"
	}
	return command
}

// incomplete explains which tasks left jobs unrecorded, and why if known.
func (f *Follow) incomplete(last map[int]TaskState) error {
	e := &IncompleteError{ArrayJob: f.Submission.ArrayJob, Missing: len(f.Pending), Resume: f.Submission.Resume}
	var shards []int
	for i, jobs := range f.Plan.Shards {
		for _, j := range jobs {
			if f.Pending[j.ID] {
				shards = append(shards, i)
				break
			}
		}
	}
	sort.Ints(shards)
	for _, i := range shards {
		state := "ended"
		t, known := last[i]
		if known {
			state = "ended " + t.State
			if t.Reason != "" {
				state += " (" + t.Reason + ")"
			}
		}
		log := filepath.Join(f.RunDir, Dir, f.Submission.ID, fmt.Sprintf("task-%d.log", i))
		var why string
		switch d, ok := readDone(f.RunDir, f.Submission.ID, i); {
		case ok && d.Error != "":
			why = d.Error
		case known && exitedNonZero(t):
			// The task's own process failed before it could write its .done (the workbench binary missing
			// on the node, a plan it cannot read): its log says why, Slurm's state does not.
			why = "exited with an error before it could say why in its .done"
			if tail := logTail(log, logTailLines); tail != "" {
				why += "; its log ends: " + tail
			}
		case known:
			why = "before finishing its jobs, leaving no word (killed: a node failure, or SIGKILL after its time limit)"
		default:
			why = "before finishing its jobs, leaving no word"
			if tail := logTail(log, logTailLines); tail != "" {
				why += "; its log ends: " + tail
			}
		}
		e.Tasks = append(e.Tasks, fmt.Sprintf("task %d %s: %s (its log: %s)", i, state, why, log))
	}
	return e
}

// exitedNonZero says whether Slurm saw the task's script exit with an error
// code, as opposed to it being killed (a signal, its time limit, its node).
func exitedNonZero(t TaskState) bool {
	return t.State == "FAILED" && !strings.HasPrefix(t.Reason, "RaisedSignal")
}

// logTailLines is how many of a log's last lines an error quotes.
const logTailLines = 3

// logTail is the last n non-empty lines of a task's log, joined in one
// line; "" when it cannot be read or is empty.
func logTail(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	const most = 16 << 10 // the end of a long log is enough
	if fi, err := f.Stat(); err == nil && fi.Size() > most {
		f.Seek(fi.Size()-most, io.SeekStart)
	}
	data, _ := io.ReadAll(f)
	var lines []string
	for _, line := range strings.Split(string(data), "\n") {
		if line = strings.TrimSpace(line); line != "" {
			if len(line) > 400 {
				line = line[:400] + "..."
			}
			lines = append(lines, line)
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
