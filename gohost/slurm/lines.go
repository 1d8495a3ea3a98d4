package slurm

import (
	"fmt"
	"strings"
)

// sbatchLongOptions are sbatch's long options (sbatch --help of Slurm
// 22.05, plus a few it does not list). sbatch takes any unambiguous prefix
// of one (getopt_long), so a name is resolved against them all.
var sbatchLongOptions = []string{
	"account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir", "cluster-constraint", "clusters",
	"comment", "constraint", "container", "contiguous", "core-spec", "cores-per-socket", "cpu-freq",
	"cpus-per-gpu", "cpus-per-task", "deadline", "delay-boot", "dependency", "distribution", "error", "exclude",
	"exclusive", "export", "export-file", "extra-node-info", "get-user-env", "gid", "gpu-bind", "gpu-freq",
	"gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres", "gres-flags", "help", "hint", "hold",
	"ignore-pbs", "input", "job-name", "kill-on-invalid-dep", "licenses", "mail-type", "mail-user", "mcs-label",
	"mem", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mincpus", "network", "nice", "no-kill", "no-requeue",
	"nodefile", "nodelist", "nodes", "ntasks", "ntasks-per-core", "ntasks-per-gpu", "ntasks-per-node",
	"ntasks-per-socket", "open-mode", "output", "overcommit", "oversubscribe", "parsable", "partition", "power",
	"prefer", "priority", "profile", "propagate", "qos", "quiet", "reboot", "requeue", "reservation", "signal",
	"sockets-per-node", "spread-job", "switches", "test-only", "thread-spec", "threads-per-core", "time",
	"time-min", "tmp", "tres-per-task", "uid", "usage", "use-min-nodes", "verbose", "version", "wait",
	"wait-all-nodes", "wckey", "wrap",
}

// reservedOptions are the sbatch options the workbench sets itself: an
// extra line giving one would override it (Slurm takes the last), so the
// host's view of the array would be wrong. The value says why, or which
// flag of the workbench to use instead.
var reservedOptions = map[string]string{
	"array":         "give --shards and --max-running instead",
	"output":        "each task's output goes to slurm/<submission>/task-<i>.log, which the host reads",
	"error":         "each task's output goes to slurm/<submission>/task-<i>.log, which the host reads",
	"job-name":      "the array is named after the experiment",
	"parsable":      "the host reads the array's job id this way",
	"wait":          "the host follows the array itself",
	"open-mode":     "a requeued task appends to its log, which keeps its first attempt's output",
	"partition":     "give --partition instead",
	"account":       "give --account instead",
	"time":          "give --time instead",
	"gres":          "give --gres instead",
	"cpus-per-task": "give --cpus-per-task instead",
	"mem":           "give --mem instead",
}

// reservedShort are the short forms of reservedOptions.
var reservedShort = map[byte]string{
	'a': "array", 'o': "output", 'e': "error", 'J': "job-name", 'W': "wait",
	'p': "partition", 'A': "account", 't': "time", 'c': "cpus-per-task",
}

// checkLine checks one --sbatch-line: it must hold sbatch options (as an
// #SBATCH line does), none of which the workbench sets itself.
func checkLine(line string) error {
	if strings.ContainsAny(line, "\n\r") {
		return fmt.Errorf("--sbatch-line %q: one line each", line)
	}
	rest := sbatchLine(line)
	if !strings.HasPrefix(rest, "-") {
		return fmt.Errorf("--sbatch-line %q: want sbatch options, as an #SBATCH line holds them, e.g. --qos=high "+
			"or \"--comment hello\"", line)
	}
	for _, word := range strings.Fields(rest) {
		name, ok := optionName(word)
		if !ok {
			continue
		}
		if why, reserved := reservedOptions[name]; reserved {
			return fmt.Errorf("--sbatch-line %q sets --%s, which the workbench sets itself: %s", line, name, why)
		}
	}
	return nil
}

// sbatchLine is an extra line without its "#SBATCH" prefix, if any.
func sbatchLine(line string) string {
	line = strings.TrimSpace(line)
	if rest, ok := strings.CutPrefix(line, "#SBATCH"); ok {
		line = strings.TrimSpace(rest)
	}
	return line
}

// optionName resolves one word of an #SBATCH line to the long name of the
// option it gives: "--opt=value", "--opt" (its value the next word), an
// unambiguous prefix of one ("--part"), or a short option ("-p", "-pgpu").
// Words that are not options (values) give false.
func optionName(word string) (string, bool) {
	if long, ok := strings.CutPrefix(word, "--"); ok {
		long, _, _ = strings.Cut(long, "=")
		if long == "" {
			return "", false
		}
		var match string
		for _, o := range sbatchLongOptions {
			if o == long {
				return o, true
			}
			if strings.HasPrefix(o, long) {
				if match != "" { // ambiguous: sbatch refuses it itself
					return long, true
				}
				match = o
			}
		}
		if match == "" {
			return long, true
		}
		return match, true
	}
	if len(word) >= 2 && word[0] == '-' {
		if name, ok := reservedShort[word[1]]; ok {
			return name, true
		}
		return word[1:2], true
	}
	return "", false
}
