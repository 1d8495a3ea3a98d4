package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// experiments/video.star plans every method family at 8 to 64 frames of the
// synthetic video, on CPU shapes by default, on 100K-token prompts with
// BENCH = True, and as few jobs as scripts/test asks for with its overrides.
func TestVideoExperimentPlans(t *testing.T) {
	src, err := os.ReadFile("../experiments/video.star")
	if err != nil {
		t.Fatal(err)
	}
	// Per frame count: full, 4 budgeted methods and A-VL and LOOK-M at each budget, ZipVL, KIVI, FP8 and
	// AttentionPack at two ranks.
	perFrames := func(budgets int) int { return 1 + 6*budgets + 5 }
	tests := []struct {
		name       string
		edits      [][2]string // line prefix -> the line that replaces it
		jobs       int
		frames     []string
		shape      []string // in the workload of every job
		rank       string   // AttentionPack's largest rank
		perTimeout string
	}{
		{"cpu", nil, 4 * perFrames(3), []string{"8", "16", "32", "64"},
			[]string{"tokens_per_image=64", "heads=4", "video=true", "frame_correlation=0.9"}, "rank_k=32", "timeout 10m0s"},
		{"bench", [][2]string{{"BENCH = ", "BENCH = True"}}, 4 * perFrames(3), []string{"8", "16", "32", "64"},
			[]string{"tokens_per_image=1600", "heads=32", "head_dim=128", "kv_heads=8", "video=true"}, "rank_k=128", "timeout 1h0m0s"},
		{"scripts/test", [][2]string{{"FRAMES = ", "FRAMES = [8, 16]"}, {"BUDGETS = ", "BUDGETS = [0.1]"}},
			2 * perFrames(1), []string{"8", "16"}, []string{"tokens_per_image=64", "video=true"}, "rank_k=32", "timeout 10m0s"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lines := strings.Split(string(src), "\n")
			for _, e := range tt.edits {
				found := false
				for i, line := range lines {
					if strings.HasPrefix(line, e[0]) {
						lines[i], found = e[1], true
					}
				}
				if !found {
					t.Fatalf("video.star has no line starting %q", e[0])
				}
			}
			script := filepath.Join(t.TempDir(), "video.star")
			os.WriteFile(script, []byte(strings.Join(lines, "\n")), 0o644)
			code, stdout, stderr := runCLI(t, "plan", script)
			if code != 0 {
				t.Fatalf("plan: exit %d: %s", code, stderr)
			}
			header := fmt.Sprintf("experiment video: %d jobs (%s", tt.jobs, tt.perTimeout)
			if !strings.Contains(stdout, header) {
				t.Fatalf("want %q:\n%s", header, firstLines(stdout, 2))
			}
			jobs := regexp.MustCompile(`(?m)^  [0-9a-f]{16} .*$`).FindAllString(stdout, -1)
			if len(jobs) != tt.jobs {
				t.Fatalf("%d job lines, want %d", len(jobs), tt.jobs)
			}
			for _, frames := range tt.frames {
				if n := strings.Count(stdout, " images="+frames+" "); n != tt.jobs/len(tt.frames) {
					t.Errorf("%d jobs at %s frames, want %d", n, frames, tt.jobs/len(tt.frames))
				}
			}
			for _, job := range jobs {
				for _, knob := range tt.shape {
					if !strings.Contains(job, " "+knob) && !strings.Contains(job, "("+knob) {
						t.Fatalf("job without %s: %s", knob, job)
					}
				}
			}
			for _, method := range []string{"full", "h2o", "snapkv", "vlcache", "streamingllm", "avl", "lookm", "zipvl",
				"kivi", "fp8", "attentionpack"} {
				if !regexp.MustCompile(`(?m)^  [0-9a-f]{16}  ` + method + ` `).MatchString(stdout) {
					t.Errorf("no %s job", method)
				}
			}
			if !strings.Contains(stdout, " "+tt.rank+" ") {
				t.Errorf("no attentionpack job at %s", tt.rank)
			}
		})
	}
}
