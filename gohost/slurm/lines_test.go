package slurm

import (
	"strings"
	"testing"
)

func TestSbatchLines(t *testing.T) {
	tests := []struct {
		line string
		err  string // "" when the line passes
	}{
		{"--qos=high", ""},
		{"--comment hello", ""},
		{"#SBATCH --exclusive", ""},
		{"  --constraint=a100  ", ""},
		{"--mem-per-cpu=4G", ""},
		{"--gres-flags=enforce-binding", ""},
		{"--time-min=10", ""},
		{"--nice -5", ""},
		{"-N 1", ""},
		{"qos=high", `--sbatch-line "qos=high": want sbatch options`},
		{"#SBATCH qos=high", "want sbatch options"},
		{"", "want sbatch options"},
		{"a\nb", "one line each"},
		{"--array=0-1", "sets --array, which the workbench sets itself: give --shards and --max-running instead"},
		{"--array 0-1", "sets --array"},
		{"-a 0-1", "sets --array"},
		{"--arr=0-1", "sets --array"}, // sbatch takes an unambiguous prefix
		{"--output=x.log", "sets --output"},
		{"-o x.log", "sets --output"},
		{"--error x.err", "sets --error"},
		{"-e x.err", "sets --error"},
		{"--job-name=x", "sets --job-name"},
		{"-J x", "sets --job-name"},
		{"--open-mode=truncate", "sets --open-mode"},
		{"--parsable", "sets --parsable"},
		{"--wait", "sets --wait"},
		{"-W", "sets --wait"},
		{"--partition=gpu", "sets --partition, which the workbench sets itself: give --partition instead"},
		{"--partition gpu", "give --partition instead"},
		{"-p gpu", "give --partition instead"},
		{"-pgpu", "give --partition instead"},
		{"--account lab", "give --account instead"},
		{"-A lab", "give --account instead"},
		{"--time=1:00:00", "give --time instead"},
		{"-t 60", "give --time instead"},
		{"--gres=gpu:1", "give --gres instead"},
		{"--cpus-per-task=3", "give --cpus-per-task instead"},
		{"-c 3", "give --cpus-per-task instead"},
		{"--mem=4G", "give --mem instead"},
		{"--mem 4G", "give --mem instead"},
		{"#SBATCH --exclusive --array=0-1", "sets --array"},
	}
	for _, tc := range tests {
		err := (Options{Extra: []string{tc.line}}).Check()
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("%q refused: %v", tc.line, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%q: error %v, want %q", tc.line, err, tc.err)
		}
	}
}
