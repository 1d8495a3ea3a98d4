// Package slurm runs a run's jobs on a Slurm cluster as one job array.
//
// The host (Executor) splits the jobs into shards, writes them to a plan
// file in the run directory and submits an array with one task per shard;
// each task runs `workbench shard PLAN --shard I` on its node (RunTask),
// which runs its jobs on local workers and records each in its own journal
// segment (results.SegmentsDir). The host follows the array (Follow): it
// merges the segments into the run's journal as lines arrive and watches
// the tasks in squeue, so a Slurm run's directory is the same as a local
// run's. Everything a resume needs stays in the run directory:
//
//	slurm/submissions.jsonl   one line per submitted array
//	slurm/<submission>/plan.json, submit.sh, task-<i>.log, task-<i>.done
//	segments/<submission>-task<i>.jsonl
package slurm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Dir is the run directory's folder for what the host and tasks share.
const Dir = "slurm"

// Options are the sbatch settings of an array.
type Options struct {
	Partition   string
	Account     string
	Time        string   // sbatch --time, e.g. "2:00:00"
	GRES        string   // sbatch --gres per task, e.g. "gpu:1"
	CPUsPerTask int      // 0: Slurm's default
	Mem         string   // per task, e.g. "32G"
	MaxRunning  int      // tasks at once (the array's %K); 0: no limit
	Shards      int      // array tasks; 0: one per job, at most DefaultShards
	Extra       []string // more #SBATCH lines, e.g. "--qos=high" or "#SBATCH --constraint=a100"
}

// DefaultShards caps the array when Options.Shards is zero.
const DefaultShards = 64

// timeFormat is sbatch --time's: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM
// or D-HH:MM:SS, or no limit.
var timeFormat = regexp.MustCompile(`^(\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:unlimited|infinite))$`)

// memFormat is sbatch --mem's: a size, in megabytes unless it carries a
// K, M, G or T suffix; 0 asks for all of a node's memory.
var memFormat = regexp.MustCompile(`^(0|[1-9]\d*[KMGTkmgt]?)$`)

// Check rejects values sbatch would refuse later, or that cannot mean
// what the user wants: before a batch script is written, not when the
// array is already queued.
func (o Options) Check() error {
	switch {
	case o.Time != "" && !timeFormat.MatchString(o.Time):
		return fmt.Errorf("--time %q: want minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (sbatch's formats), "+
			"e.g. 2:00:00", o.Time)
	case o.Mem != "" && !memFormat.MatchString(o.Mem):
		return fmt.Errorf("--mem %q: want a positive size with an optional K, M, G or T suffix (megabytes without), "+
			"e.g. 32G, or 0 for all of a node's memory", o.Mem)
	case o.CPUsPerTask < 0:
		return fmt.Errorf("--cpus-per-task must be at least 1, got %d", o.CPUsPerTask)
	case o.MaxRunning < 0:
		return fmt.Errorf("--max-running must be positive (0: no limit), got %d", o.MaxRunning)
	case o.Shards < 0:
		return fmt.Errorf("--shards must be positive (0: one per job, at most %d), got %d", DefaultShards, o.Shards)
	}
	for _, line := range o.Extra {
		if err := checkLine(line); err != nil {
			return err
		}
	}
	return nil
}

// sbatchArgs are the options every submission (the array, the probe) gets.
func (o Options) sbatchArgs() []string {
	var args []string
	add := func(flag, value string) {
		if value != "" {
			args = append(args, flag+"="+value)
		}
	}
	add("--partition", o.Partition)
	add("--account", o.Account)
	add("--time", o.Time)
	return args
}

// directives are the #SBATCH lines of a task.
func (o Options) directives() []string {
	lines := []string{}
	for _, a := range o.sbatchArgs() {
		lines = append(lines, "#SBATCH "+a)
	}
	if o.GRES != "" {
		lines = append(lines, "#SBATCH --gres="+o.GRES)
	}
	if o.CPUsPerTask > 0 {
		lines = append(lines, "#SBATCH --cpus-per-task="+strconv.Itoa(o.CPUsPerTask))
	}
	if o.Mem != "" {
		lines = append(lines, "#SBATCH --mem="+o.Mem)
	}
	return append(lines, o.extraDirectives()...)
}

// extraDirectives are the #SBATCH lines of --sbatch-line.
func (o Options) extraDirectives() []string {
	var lines []string
	for _, line := range o.Extra {
		lines = append(lines, "#SBATCH "+sbatchLine(line))
	}
	return lines
}

// NotInstalledError is a Slurm command missing from PATH.
type NotInstalledError struct{ Command string }

func (e *NotInstalledError) Error() string {
	return fmt.Sprintf("no %s on PATH: the slurm executor submits and watches jobs with Slurm's commands "+
		"(sbatch, squeue, scancel, sinfo); run on a machine of the cluster (a login node), or use --executor local",
		e.Command)
}

// NotConfiguredError is a Slurm command that found no cluster
// configuration: SLURM_CONF unset on a machine without a slurm.conf of
// its own, or naming a file that cannot be read.
type NotConfiguredError struct {
	Command string
	Conf    string // $SLURM_CONF, "" when unset
	Missing error  // why SLURM_CONF names no file, when it does not
}

func (e *NotConfiguredError) Error() string {
	if e.Missing != nil {
		return fmt.Sprintf("SLURM_CONF=%s names no file (%v), so %s cannot find the cluster: point SLURM_CONF at the "+
			"cluster's slurm.conf, or unset it on a machine of the cluster", e.Conf, e.Missing, e.Command)
	}
	if e.Conf == "" {
		return fmt.Sprintf("%s finds no Slurm configuration here (SLURM_CONF is unset and this machine has no "+
			"slurm.conf): set SLURM_CONF to the cluster's slurm.conf, or run on a machine of the cluster (a login node)",
			e.Command)
	}
	return fmt.Sprintf("%s cannot read the Slurm configuration SLURM_CONF=%s: point SLURM_CONF at the cluster's "+
		"slurm.conf, or unset it on a machine of the cluster", e.Command, e.Conf)
}

// notConfigured returns a *NotConfiguredError when a failed command's
// output is Slurm's fatal error for a missing configuration (its other
// lines only say how the search failed), else nil.
func notConfigured(name, output string) error {
	for _, m := range []string{"Could not establish a configuration source", "Unable to process configuration file"} {
		if strings.Contains(output, m) {
			return &NotConfiguredError{Command: name, Conf: os.Getenv("SLURM_CONF")}
		}
	}
	return nil
}

// checkConf refuses a SLURM_CONF that names no file: Slurm's commands
// would retry reading it for about a minute before failing.
func checkConf(name string) error {
	conf := os.Getenv("SLURM_CONF")
	if conf == "" {
		return nil
	}
	fi, err := os.Stat(conf)
	if err == nil && fi.IsDir() {
		err = errors.New("a directory")
	}
	if err != nil {
		var pe *os.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return &NotConfiguredError{Command: name, Conf: conf, Missing: err}
	}
	return nil
}

// command runs a Slurm command and returns its stdout; its stderr is the
// error's text.
func command(ctx context.Context, name string, args ...string) (string, error) {
	path, err := exec.LookPath(name)
	if err != nil {
		return "", &NotInstalledError{Command: name}
	}
	if err := checkConf(name); err != nil {
		return "", err
	}
	var stdout, stderr bytes.Buffer
	c := exec.CommandContext(ctx, path, args...)
	c.Stdout, c.Stderr = &stdout, &stderr
	if err := c.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if err := notConfigured(name, msg); err != nil {
			return stdout.String(), err
		}
		if msg == "" {
			msg = err.Error()
		}
		if !strings.HasPrefix(msg, name+":") {
			msg = name + ": " + msg
		}
		return stdout.String(), errors.New(msg)
	}
	return stdout.String(), nil
}

// Installed checks that Slurm's commands are on PATH.
func Installed() error {
	for _, name := range []string{"sbatch", "squeue", "scancel", "sinfo"} {
		if _, err := exec.LookPath(name); err != nil {
			return &NotInstalledError{Command: name}
		}
	}
	return nil
}

// Partitions lists the cluster's partitions.
func Partitions(ctx context.Context) ([]string, error) {
	// --all: hidden partitions too (sinfo shows them to root only without it),
	// which a user may be allowed to submit to.
	out, err := command(ctx, "sinfo", "--all", "-h", "-o", "%R")
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var names []string
	for _, f := range strings.Fields(out) {
		if !seen[f] {
			seen[f] = true
			names = append(names, f)
		}
	}
	sort.Strings(names)
	return names, nil
}

// CheckPartition refuses a partition the cluster does not have; name may be
// sbatch's comma-separated list of partitions, each of which must exist.
func CheckPartition(ctx context.Context, name string) error {
	if name == "" {
		return nil
	}
	names, err := Partitions(ctx)
	if err != nil {
		return err
	}
	return partitionIn(names, name)
}

// partitionIn refuses a partition not among the cluster's names; name may
// be a comma-separated list (sbatch --partition=a,b: the job starts in
// whichever of them can start it first).
func partitionIn(names []string, name string) error {
	for _, one := range strings.Split(name, ",") {
		if !slices.Contains(names, one) {
			return fmt.Errorf("partition %q does not exist on this cluster; its partitions: %s", one,
				strings.Join(names, ", "))
		}
	}
	return nil
}

// errNoJobID is sbatch succeeding without a job id: what it queued is unknown.
var errNoJobID = errors.New("sbatch printed no job id")

// Submit submits a batch script and returns the job id.
func Submit(ctx context.Context, script string, args ...string) (string, error) {
	out, err := command(ctx, "sbatch", append(append([]string{"--parsable"}, args...), script)...)
	if err != nil {
		return "", fmt.Errorf("submit %s: %w", script, err)
	}
	id, _, _ := strings.Cut(strings.TrimSpace(out), ";") // "id;cluster" on federated clusters
	if id == "" {
		return "", fmt.Errorf("submit %s: %w", script, errNoJobID)
	}
	return id, nil
}

// Cancel cancels every task of an array.
func Cancel(ctx context.Context, id string) error {
	_, err := command(ctx, "scancel", id)
	return err
}

// TaskState is one array task as squeue sees it.
type TaskState struct {
	Task   int
	State  string // PENDING, RUNNING, COMPLETED, TIMEOUT, ...
	Reason string // why it waits or ended, when Slurm says
}

// Terminal says whether the task has ended: a state squeue lists as a
// job's end. Any other, held ones (RESV_DEL_HOLD, REQUEUE_HOLD) and any a
// later Slurm adds included, may still run the task's jobs.
func (t TaskState) Terminal() bool {
	switch t.State {
	case "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
		"REVOKED", "TIMEOUT":
		return true
	}
	return false
}

// Tasks returns the tasks of array id that slurmctld still knows, ended
// ones included until they age out (MinJobAge). An array it no longer
// knows gives none.
func Tasks(ctx context.Context, id string) ([]TaskState, error) {
	out, err := command(ctx, "squeue", "-h", "-r", "-t", "all", "-j", id, "-o", "%K|%T|%r")
	if err != nil {
		if strings.Contains(err.Error(), "Invalid job id") {
			return nil, nil
		}
		return nil, err
	}
	var tasks []TaskState
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		parts := strings.Split(line, "|")
		if len(parts) != 3 {
			continue
		}
		task, err := strconv.Atoi(parts[0])
		if err != nil { // "N/A": the array's record before it is split into tasks
			continue
		}
		reason := parts[2]
		if reason == "None" {
			reason = ""
		}
		tasks = append(tasks, TaskState{Task: task, State: parts[1], Reason: reason})
	}
	sort.Slice(tasks, func(i, j int) bool { return tasks[i].Task < tasks[j].Task })
	return tasks, nil
}

// stateOf is a task's state as the host shows it: a pending task's with
// the reason Slurm gives, e.g. "pending (PartitionConfig)".
func stateOf(t TaskState) string {
	s := strings.ToLower(t.State)
	if t.State == "PENDING" && t.Reason != "" {
		s += " (" + t.Reason + ")"
	}
	return s
}

// summarize counts tasks by state, e.g. "2 pending (Priority), 1 running,
// 3 completed".
func summarize(tasks []TaskState) string {
	counts := map[string]int{}
	var states []string
	for _, t := range tasks {
		s := stateOf(t)
		if counts[s] == 0 {
			states = append(states, s)
		}
		counts[s]++
	}
	sort.Strings(states)
	parts := make([]string, len(states))
	for i, s := range states {
		parts[i] = fmt.Sprintf("%d %s", counts[s], s)
	}
	return strings.Join(parts, ", ")
}

// Describe counts tasks by state and names them, e.g. "2 completed (tasks
// 0,2), 1 cancelled (task 1)"; a run of tasks is a range, e.g. "tasks 0-5";
// pending tasks say why they wait, e.g. "3 pending (tasks 0-2: Priority)".
func Describe(tasks []TaskState) string {
	ids := map[string][]int{}
	reasons := map[string]string{}
	var states []string
	for _, t := range tasks {
		s := t.State
		if t.State == "PENDING" {
			s += "|" + t.Reason
			reasons[s] = t.Reason
		}
		if ids[s] == nil {
			states = append(states, s)
		}
		ids[s] = append(ids[s], t.Task)
	}
	sort.Strings(states)
	parts := make([]string, len(states))
	for i, s := range states {
		noun := "tasks"
		if len(ids[s]) == 1 {
			noun = "task"
		}
		state, _, _ := strings.Cut(s, "|")
		which := noun + " " + ranges(ids[s])
		if r := reasons[s]; r != "" {
			which += ": " + r
		}
		parts[i] = fmt.Sprintf("%d %s (%s)", len(ids[s]), strings.ToLower(state), which)
	}
	return strings.Join(parts, ", ")
}

// Stuck says, for each reason of the pending tasks that means they can
// never start as submitted (Slurm's job reason codes), what to change;
// none when every pending task can still start.
func Stuck(arrayJob string, tasks []TaskState) []string {
	seen := map[string]bool{}
	var says []string
	for _, t := range tasks {
		if t.State != "PENDING" || seen[t.Reason] {
			continue
		}
		seen[t.Reason] = true
		if what := neverRuns(t.Reason); what != "" {
			says = append(says, fmt.Sprintf("Slurm array %s: its tasks pending (%s) can never start: %s; stop it "+
				"(scancel %s) and run again with --resume", arrayJob, t.Reason, what, arrayJob))
		}
	}
	return says
}

// neverRuns says what to change for a pending reason that means the job
// cannot run as submitted however long it waits, else "". Reasons such as
// Priority, Resources or QOSGrp*Limit only make it wait.
func neverRuns(reason string) string {
	const ask = "ask for less (--cpus-per-task, --mem, --gres, --time, or a --sbatch-line's constraint)"
	switch {
	case reason == "PartitionConfig", reason == "BadConstraints":
		return "the tasks ask for more than the partition's nodes have or allow: " + ask +
			", or use another --partition (sinfo -o '%P %c %m %G %l' lists what its nodes have)"
	case strings.HasPrefix(reason, "ReqNodeNotAvail"):
		// Nodes named as unavailable (down, drained) may come back; none named: no node could ever do.
		if _, nodes, ok := strings.Cut(reason, "UnavailableNodes:"); !ok || strings.TrimSpace(nodes) != "" {
			return ""
		}
		return "no node of the partition can give what the tasks ask for: " + ask + ", or use another --partition"
	case reason == "PartitionTimeLimit":
		return "--time is longer than the partition allows: give a shorter --time, or another --partition " +
			"(sinfo -o '%P %l' lists their limits)"
	case (strings.HasPrefix(reason, "QOSMax") || strings.HasPrefix(reason, "AssocMax")) && strings.Contains(reason, "PerJob"):
		return "the tasks ask for more than a per-job limit of the account or QOS allows: " + ask +
			", or use another --account or QOS"
	case reason == "InvalidAccount":
		return "the account is not one Slurm lets you use: give another --account"
	case reason == "InvalidQOS":
		return "the QOS is not one Slurm lets you use: give another --sbatch-line --qos=..., or none"
	case reason == "DependencyNeverSatisfied":
		return "a --sbatch-line --dependency can never be met: drop it"
	}
	return ""
}

// ranges writes task indices as ranges: 0,1,2,5 as "0-2,5".
func ranges(ids []int) string {
	ids = append([]int(nil), ids...)
	sort.Ints(ids)
	var parts []string
	for i := 0; i < len(ids); {
		j := i
		for j+1 < len(ids) && ids[j+1] == ids[j]+1 {
			j++
		}
		if j == i {
			parts = append(parts, strconv.Itoa(ids[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", ids[i], ids[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ",")
}
