package slurm

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/vlkv/vlkv/gohost/runner"
)

// Plan is what every task of one submission reads: its jobs, and what they
// must run on.
type Plan struct {
	Submission string `json:"submission"`
	Experiment string `json:"experiment"`
	RunDir     string `json:"run_dir"`
	// File and FileHash are the experiment script: a task checks it sees
	// the same one.
	File     string `json:"file"`
	FileHash string `json:"file_sha256"`
	// KernelsDigest and KernelsHash are the kernels_py sources the run's rows
	// come from: a task on other sources fails rather than mix results.
	KernelsDigest string            `json:"kernels_digest"`
	KernelsHash   map[string]string `json:"kernels_sha256"`
	Shards        [][]runner.Job    `json:"shards"`
}

// Submission is one submitted array of a run.
type Submission struct {
	ID        string    `json:"id"`        // names its folder: slurm/<id>/
	ArrayJob  string    `json:"array_job"` // Slurm's job id
	Tasks     int       `json:"tasks"`
	Jobs      int       `json:"jobs"`
	Submitted time.Time `json:"submitted"`
	// Resume is the command that resumes the run, as its host was given
	// it: what `workbench status` says to run once the array ends short.
	Resume string `json:"resume,omitempty"`
}

const (
	submissionsFile = "submissions.jsonl"
	planFile        = "plan.json"
	scriptFile      = "submit.sh"
)

// newSubmissionID is sortable by time, unique enough for one run.
func newSubmissionID(now time.Time) string {
	var b [2]byte
	rand.Read(b[:])
	return now.UTC().Format("20060102-150405") + "-" + hex.EncodeToString(b[:])
}

// shard splits jobs into n contiguous shards of near-equal size, in plan
// order (jobs on one workload stay together, so a task loads it once).
func shard(jobs []runner.Job, n int) [][]runner.Job {
	if n > len(jobs) {
		n = len(jobs)
	}
	shards := make([][]runner.Job, n)
	for i := range shards {
		shards[i] = jobs[i*len(jobs)/n : (i+1)*len(jobs)/n]
	}
	return shards
}

// PlanPath is where the plan of a submission lies.
func PlanPath(runDir, submission string) string {
	return filepath.Join(runDir, Dir, submission, planFile)
}

func writePlan(p Plan) (string, error) {
	path := PlanPath(p.RunDir, p.Submission)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return "", err
	}
	data, err := json.MarshalIndent(p, "", " ")
	if err != nil {
		return "", err
	}
	// Whole or not at all: a resume reads it to find the array it names.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(data, '\n'), 0o644); err != nil {
		return "", err
	}
	return path, os.Rename(tmp, path)
}

// ReadPlan reads a submission's plan, on a node or on the host.
func ReadPlan(path string) (Plan, error) {
	data, err := os.ReadFile(path)
	if err != nil && os.Getenv("SLURM_JOB_ID") != "" {
		return Plan{}, fmt.Errorf("read plan %s (%w): the results directory must be on a filesystem the nodes share", path, err)
	}
	if err != nil {
		return Plan{}, fmt.Errorf("read plan %s: %w", path, err)
	}
	var p Plan
	if err := json.Unmarshal(data, &p); err != nil {
		return Plan{}, fmt.Errorf("plan %s does not parse: %w", path, err)
	}
	return p, nil
}

func appendSubmission(runDir string, s Submission) error {
	f, err := os.OpenFile(filepath.Join(runDir, Dir, submissionsFile), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	line, _ := json.Marshal(s)
	if _, err := f.Write(append(line, '\n')); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Submissions lists a run's submitted arrays, oldest first (none for a run
// that never ran on Slurm).
func Submissions(runDir string) ([]Submission, error) {
	f, err := os.Open(filepath.Join(runDir, Dir, submissionsFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var subs []Submission
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var s Submission
		if json.Unmarshal(sc.Bytes(), &s) == nil && s.ArrayJob != "" {
			subs = append(subs, s)
		}
	}
	return subs, sc.Err()
}

// taskDone is what a task writes when it ends by itself: a task that
// Slurm killed (time limit, preemption, node failure) leaves none.
type taskDone struct {
	Jobs     int       `json:"jobs"`
	Recorded int       `json:"recorded"`
	Failed   int       `json:"failed"`
	Error    string    `json:"error,omitempty"`
	Ended    time.Time `json:"ended"`
}

func donePath(runDir, submission string, task int) string {
	return filepath.Join(runDir, Dir, submission, fmt.Sprintf("task-%d.done", task))
}

func readDone(runDir, submission string, task int) (taskDone, bool) {
	data, err := os.ReadFile(donePath(runDir, submission, task))
	if err != nil {
		return taskDone{}, false
	}
	var d taskDone
	return d, json.Unmarshal(data, &d) == nil
}

// DescribeEnded says how the tasks of a submission ended by their own
// word (task-<i>.done), for when Slurm no longer remembers them: those
// that recorded all their jobs, each one that stopped with its reason, and
// those that left no word (killed outright, or never started).
func DescribeEnded(runDir string, sub Submission) string {
	var finished, silent []int
	var stopped []string
	for i := 0; i < sub.Tasks; i++ {
		d, ok := readDone(runDir, sub.ID, i)
		switch {
		case !ok:
			silent = append(silent, i)
		case d.Error != "":
			stopped = append(stopped, fmt.Sprintf("task %d: %s", i, d.Error))
		default:
			finished = append(finished, i)
		}
	}
	var parts []string
	if len(finished) > 0 {
		whose := "their"
		if len(finished) == 1 {
			whose = "its"
		}
		parts = append(parts, fmt.Sprintf("%s ran all %s jobs (%s)", plural(len(finished), "task"), whose, ranges(finished)))
	}
	parts = append(parts, stopped...)
	if len(silent) > 0 {
		parts = append(parts, fmt.Sprintf("%s left no word (%s: killed outright, or never started; see %s)",
			plural(len(silent), "task"), ranges(silent), filepath.Join(runDir, Dir, sub.ID, "task-<i>.log")))
	}
	return strings.Join(parts, "; ")
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
