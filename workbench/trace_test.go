package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vlkv/vlkv/gohost/tensor"
)

// A tiny random LLaVA saved to a temporary directory: capture writes a
// trace, inspect describes it from the header, and an experiment runs on it.
func TestTraceCaptureInspectAndReplay(t *testing.T) {
	py := os.Getenv("VLKV_TEST_PYTHON")
	if py == "" {
		t.Skip("needs VLKV_TEST_PYTHON")
	}
	dir := t.TempDir()
	root, _ := filepath.Abs("..")
	build := exec.Command(py, "-c", `import sys; from pathlib import Path
from kernels_py.tests.tiny_vlm import save_tiny_llava, save_image
save_tiny_llava(Path(sys.argv[1]) / "llava"); save_image(Path(sys.argv[1]) / "cat.png")`, dir)
	build.Dir = root
	build.Env = append(os.Environ(), "PYTHONPATH="+root)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the tiny model: %v\n%s", err, out)
	}
	trace := filepath.Join(dir, "trace.safetensors")
	prompt := "USER : <image> describe the picture ASSISTANT :"
	code, stdout, stderr := runCLI(t, "--python", py, "--kernels", root, "trace", "capture", "--model",
		filepath.Join(dir, "llava"), "--image", filepath.Join(dir, "cat.png"), "--prompt", prompt, "--out", trace,
		"--decode-steps", "4")
	if code != 0 || !strings.Contains(stdout, "2 layers, 71 prompt tokens, 4 decode steps") {
		t.Fatalf("capture: exit %d\n%s\n%s", code, stdout, stderr)
	}
	code, stdout, stderr = runCLI(t, "trace", "inspect", "--json", trace)
	var meta struct {
		traceMeta
		Tensors int
	}
	if code != 0 || json.Unmarshal([]byte(stdout), &meta) != nil {
		t.Fatalf("inspect: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if meta.Model.Layers != 2 || meta.Model.KVHeads != 2 || meta.Model.HeadDim != 32 || meta.Tensors != 18 || meta.Model.Rope != "default" ||
		len(meta.Spans.Images) != 1 || meta.Spans.Images[0] != [2]int{2, 66} || len(meta.Tokens) != 5 {
		t.Errorf("inspect: %+v", meta)
	}
	script := filepath.Join(dir, "t.star")
	os.WriteFile(script, []byte(`experiment(name = "on_a_trace", methods = ["full", "h2o"], grid = {"budget": [0.3]},
    workloads = [workload("trace", path = "`+trace+`")])`), 0o644)
	code, stdout, stderr = runCLI(t, "--python", py, "--kernels", root, "run", script, "--out", filepath.Join(dir, "runs"))
	if code != 0 || !strings.Contains(stdout, "2 jobs, 0 failed") {
		t.Fatalf("run on the trace: exit %d\n%s\n%s", code, stdout, stderr)
	}
	// The live model as a workload: methods run inside it and report agreement with the full cache.
	os.WriteFile(script, []byte(`experiment(name = "own_model", methods = ["full", "h2o"], grid = {"budget": [0.3]},
    workloads = [workload("vlm", model = "`+filepath.Join(dir, "llava")+`", images = "`+filepath.Join(dir, "cat.png")+
		`", prompt = "`+prompt+`", decode_steps = 3)])`), 0o644)
	code, stdout, stderr = runCLI(t, "--python", py, "--kernels", root, "run", script, "--out", filepath.Join(dir, "runs"))
	if code != 0 || !strings.Contains(stdout, "2 jobs, 0 failed") {
		t.Fatalf("run on the model: exit %d\n%s\n%s", code, stdout, stderr)
	}
	// Errors a user meets: no placeholder in the prompt, a file that is not a trace.
	code, _, stderr = runCLI(t, "--python", py, "--kernels", root, "trace", "capture", "--model",
		filepath.Join(dir, "llava"), "--image", filepath.Join(dir, "cat.png"), "--prompt", "USER : hi", "--out", trace)
	if code == 0 || !strings.Contains(stderr, "0 image placeholder(s)") {
		t.Errorf("capture without a placeholder: exit %d, %s", code, stderr)
	}
	// Weights cut short: one line naming the model and the cause, not a traceback.
	truncated := filepath.Join(dir, "truncated")
	os.Mkdir(truncated, 0o755)
	for _, name := range []string{"config.json", "generation_config.json", "processor_config.json", "tokenizer.json",
		"tokenizer_config.json", "model.safetensors"} {
		data, err := os.ReadFile(filepath.Join(dir, "llava", name))
		if err != nil {
			t.Fatal(err)
		}
		if name == "model.safetensors" {
			data = data[:len(data)/2]
		}
		os.WriteFile(filepath.Join(truncated, name), data, 0o644)
	}
	code, _, stderr = runCLI(t, "--python", py, "--kernels", root, "trace", "capture", "--model", truncated,
		"--image", filepath.Join(dir, "cat.png"), "--prompt", prompt, "--out", trace)
	// Three lines: the log lines that the capture started and that the model loads, and the error.
	if line := lastLine([]byte(stderr)); code != 1 || strings.Count(stderr, "\n") != 3 ||
		!strings.Contains(string(line), truncated+": the model does not load (SafetensorError: ") {
		t.Errorf("capture from truncated weights: exit %d, %s", code, stderr)
	}
	code, _, stderr = runCLI(t, "trace", "inspect", filepath.Join(dir, "llava", "model.safetensors"))
	if code == 0 || !strings.Contains(stderr, "not a trace") {
		t.Errorf("inspect a model file: exit %d, %s", code, stderr)
	}
	code, _, stderr = runCLI(t, "trace", "capture", "--model", dir)
	if code != 2 || !strings.Contains(stderr, "needs --model, at least one --image or --video, --prompt and --out") {
		t.Errorf("capture without its flags: exit %d, %s", code, stderr)
	}
}

// writeTrace writes file as capture would for the model shape, prompt
// tokens and decode steps of meta (zeros for data), after edit changes the
// tensors (nil: none).
func writeTrace(t *testing.T, file, meta string, edit func(ar *tensor.Arena, ts map[string]*tensor.Tensor)) {
	t.Helper()
	var m struct {
		Model struct {
			Layers  int64  `json:"layers"`
			Heads   int64  `json:"heads"`
			KVHeads int64  `json:"kv_heads"`
			HeadDim int64  `json:"head_dim"`
			Rope    string `json:"rope"`
		} `json:"model"`
		PromptTokens int64 `json:"prompt_tokens"`
		DecodeSteps  int64 `json:"decode_steps"`
	}
	if err := json.Unmarshal([]byte(meta), &m); err != nil {
		t.Fatal(err)
	}
	m.PromptTokens, m.DecodeSteps = max(m.PromptTokens, 1), max(m.DecodeSteps, 1) // at least one of each, as capture writes
	ar, err := tensor.NewArena(1, "trace", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer ar.Close()
	ts := map[string]*tensor.Tensor{}
	add := func(name string, dt tensor.DType, shape ...int64) {
		x, err := ar.NewTensor(dt, shape...)
		if err != nil {
			t.Fatal(err)
		}
		ts[name] = x
	}
	p, s, mdl := m.PromptTokens, m.DecodeSteps, m.Model
	if mdl.Rope == "mrope" {
		add("positions", tensor.Int64, 3, p)
		add("decode_positions", tensor.Int64, 3, s)
	} else {
		add("positions", tensor.Int64, p)
		add("decode_positions", tensor.Int64, s)
	}
	for l := range mdl.Layers {
		add(fmt.Sprintf("layer.%d.q", l), tensor.Float32, mdl.Heads, p, mdl.HeadDim)
		add(fmt.Sprintf("layer.%d.decode_q", l), tensor.Float32, s, mdl.Heads, 1, mdl.HeadDim)
		for _, name := range []string{"k", "v", "k_pre"} {
			add(fmt.Sprintf("layer.%d.%s", l, name), tensor.Float32, mdl.KVHeads, p, mdl.HeadDim)
			add(fmt.Sprintf("layer.%d.decode_%s", l, name), tensor.Float32, s, mdl.KVHeads, 1, mdl.HeadDim)
		}
	}
	if edit != nil {
		edit(ar, ts)
	}
	if err := tensor.WriteSafetensors(file, ts, map[string]string{"vlkv": meta}); err != nil {
		t.Fatal(err)
	}
}

// A safetensors file whose trace metadata lacks what capture writes, or
// whose tensors or spans are not the ones its metadata describes, is refused
// in one line rather than summarised (as zeros, or as a trace every replay
// refuses).
func TestTraceInspectRefusesIncompleteMetadata(t *testing.T) {
	model := `"model": {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8}`
	tokens := `"spans": {"system": [0, 1], "images": [[1, 2]], "text": [2, 3]}, "prompt_tokens": 3, "decode_steps": 1`
	whole := `{"format": "vlkv-trace/1", ` + model + `, ` + tokens + `}`
	replace := func(name string, dt tensor.DType, shape ...int64) func(*tensor.Arena, map[string]*tensor.Tensor) {
		return func(ar *tensor.Arena, ts map[string]*tensor.Tensor) {
			x, err := ar.NewTensor(dt, shape...)
			if err != nil {
				t.Fatal(err)
			}
			ts[name] = x
		}
	}
	tests := []struct {
		name string
		meta string
		edit func(*tensor.Arena, map[string]*tensor.Tensor)
		want string // "" for a trace inspect accepts
	}{
		{"empty", `{}`, nil, "its trace metadata has no format"},
		{"other format", `{"format": "vlkv-trace/9", ` + model + `}`, nil, `trace format "vlkv-trace/9"; this version reads "vlkv-trace/1"`},
		{"no shape", `{"format": "vlkv-trace/1"}`, nil, "its trace metadata gives no model shape (layers 0, heads 0, kv_heads 0, head_dim 0"},
		{"complete", whole, nil, ""},
		{"sliding layers", `{"format": "vlkv-trace/1", "model": {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "model_layers": 6, "sliding_layers": [0, 1, 3, 4]}, ` + tokens + `}`, nil, ""},
		{"scaled rope", `{"format": "vlkv-trace/1", "model": {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "rope": "default", "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 8}}, ` + tokens + `}`, nil, ""},
		{"m-rope positions", `{"format": "vlkv-trace/1", "model": {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "rope": "mrope"}, ` + tokens + `}`, nil, ""},
		{"no pre-rope keys (an older trace)", whole, func(_ *tensor.Arena, ts map[string]*tensor.Tensor) {
			for _, l := range []string{"0", "1"} {
				delete(ts, "layer."+l+".k_pre")
				delete(ts, "layer."+l+".decode_k_pre")
			}
		}, ""},
		{"a tensor missing", whole, func(_ *tensor.Arena, ts map[string]*tensor.Tensor) { delete(ts, "layer.1.v") },
			`tensor "layer.1.v" is missing (its metadata gives 2 layers, 4 heads, 2 kv heads, head_dim 8, 3 prompt tokens, 1 decode steps): the file is not a whole trace`},
		{"fewer prompt tokens", whole, replace("layer.0.k", tensor.Float32, 2, 2, 8),
			`tensor "layer.0.k" has shape [2 2 8], not the [2 3 8] its metadata gives`},
		{"flat positions on m-rope", `{"format": "vlkv-trace/1", "model": {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "rope": "mrope"}, ` + tokens + `}`,
			replace("positions", tensor.Int64, 3), `tensor "positions" has shape [3], not the [3 3] its metadata gives`},
		{"spans out of order", `{"format": "vlkv-trace/1", ` + model + `, "spans": {"system": [0, 1], "images": [[1, 50]], "text": [2, 3]}, "prompt_tokens": 3, "decode_steps": 1}`, nil,
			"its spans do not follow each other (system [0 1], images [[1 50]], text [2 3]"},
		{"no spans", `{"format": "vlkv-trace/1", ` + model + `, "prompt_tokens": 3, "decode_steps": 1}`, nil,
			"its spans end at token 0, not at the 3 prompt tokens its metadata gives"},
		{"integer queries", whole, replace("layer.1.decode_q", tensor.Int8, 1, 4, 1, 8),
			`tensor "layer.1.decode_q" is int8, not floating point as Q/K/V are`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "t.safetensors")
			writeTrace(t, file, tt.meta, tt.edit)
			code, stdout, stderr := runCLI(t, "trace", "inspect", file)
			if tt.want == "" {
				want := " 2 layers, 4 query heads, 2 kv heads, head_dim 8"
				if strings.Contains(tt.meta, "sliding_layers") {
					// Gemma 3's sliding-window layers are not in the trace: the count says of how many.
					want = " 2 of the model's 6 layers (sliding-window layers 0 1 3 4 not recorded), 4 query heads"
				}
				if strings.Contains(tt.meta, "rope_scaling") {
					want = "default, theta 1e+06, linear scaling by 8"
				}
				if code != 0 || !strings.Contains(stdout, want) {
					t.Errorf("exit %d, want %q in\n%s%s", code, want, stdout, stderr)
				}
				return
			}
			if code != 1 || !strings.Contains(stderr, file+": "+tt.want) || strings.Count(strings.TrimSpace(stderr), "\n") != 0 || stdout != "" {
				t.Errorf("exit %d, stdout %q, stderr %q; want one line with %q", code, stdout, stderr, tt.want)
			}
		})
	}
}

// The files capture reads and --out's directory are checked before Python
// starts: a missing directory for --out once failed only after the model
// ran, with a traceback, and one that cannot be written still did after the
// model ran, minutes on a large one.
func TestTraceCaptureChecksFiles(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "t.safetensors")
	readOnly := unwritableDir(t)
	tests := []struct {
		name         string
		model, image string
		out          string
		want         string
	}{
		{"out directory not writable", dir, file, filepath.Join(readOnly, "t.safetensors"), "--out " +
			filepath.Join(readOnly, "t.safetensors") + ": directory " + readOnly + " is not writable: "},
		{"missing out directory", dir, file, filepath.Join(dir, "none", "t.safetensors"), "directory " + filepath.Join(dir, "none") + " does not exist: create it first"},
		{"out a directory", dir, file, dir, "--out " + dir + " is a directory: name the file to write"},
		{"out under a file", dir, file, filepath.Join(file, "t.safetensors"), file + " is not a directory"},
		{"missing model", filepath.Join(dir, "none"), file, out, "--model " + filepath.Join(dir, "none") + " is not a directory: give a local directory holding config.json"},
		{"model a file", file, file, out, "--model " + file + " is not a directory"},
		{"missing image", dir, filepath.Join(dir, "cat.png"), out, "--image " + filepath.Join(dir, "cat.png") + " is not a file"},
		// The model's weights, or an input, named as --out by mistake: kept.
		{"out an existing file", dir, file, file, "--out " + file + " exists and is not a trace, so capturing would overwrite it"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// --python names nothing: the check comes before any Python is looked for.
			code, stdout, stderr := runCLI(t, "--python", filepath.Join(dir, "no-python"), "trace", "capture",
				"--model", tt.model, "--image", tt.image, "--prompt", "<image>", "--out", tt.out)
			if code != 1 || stdout != "" || !strings.Contains(stderr, tt.want) || strings.Count(stderr, "\n") != 1 {
				t.Errorf("exit %d, stderr %q; want one line with %q", code, stderr, tt.want)
			}
		})
	}
}

// An earlier trace named as --out may be replaced: the check lets it pass
// (to the missing interpreter, here), as it stops any other existing file.
func TestTraceCaptureMayReplaceAnEarlierTrace(t *testing.T) {
	dir := t.TempDir()
	image := filepath.Join(dir, "cat.png")
	if err := os.WriteFile(image, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	trace := filepath.Join(dir, "t.safetensors")
	writeTrace(t, trace, `{"format": "vlkv-trace/1", "model": {"layers": 1, "heads": 2, "kv_heads": 1, "head_dim": 8}}`, nil)
	python := filepath.Join(dir, "no-python")
	code, _, stderr := runCLI(t, "--python", python, "trace", "capture", "--model", dir, "--image", image,
		"--prompt", "<image>", "--out", trace)
	if code != 1 || strings.Contains(stderr, "is not a trace") || !strings.Contains(stderr, python) {
		t.Errorf("capture over an earlier trace: exit %d, stderr %q; want it past the file checks, to the interpreter", code, stderr)
	}
}

// unwritableDir is a directory no file can be created in: a read-only
// temporary one, or, where its mode does not stop this user (root), /proc.
func unwritableDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "read-only")
	if err := os.Mkdir(dir, 0o555); err != nil {
		t.Fatal(err)
	}
	f, err := os.CreateTemp(dir, "probe")
	if err != nil {
		return dir
	}
	f.Close()
	os.Remove(f.Name())
	if f, err := os.CreateTemp("/proc", "probe"); err == nil {
		f.Close()
		os.Remove(f.Name())
		t.Skip("no directory here refuses new files")
	}
	return "/proc"
}

// The capture's stages are logged as they start (a large model loads for
// minutes); its error is the last line alone, without them.
func TestTraceCaptureLogsItsStages(t *testing.T) {
	dir := t.TempDir()
	image := filepath.Join(dir, "cat.png")
	os.WriteFile(image, nil, 0o644)
	out := filepath.Join(dir, "t.safetensors")
	fake := filepath.Join(dir, "python")
	// Stands in for kernels_py.models.trace: it says its stages only when given --progress.
	os.WriteFile(fake, []byte(`#!/bin/sh
case " $* " in *" --progress "*) ;; *) echo "no --progress" >&2; exit 1;; esac
echo "progress: loading the model from m on cpu" >&2
if [ -n "$FAIL" ]; then echo "trace capture: the model does not load" >&2; exit 2; fi
echo "progress: writing t" >&2
case " $* " in
*" --video "*) echo '{"out": "t", "layers": 2, "prompt_tokens": 7, "decode_steps": 1, "bytes": 10, "videos": [{"source": "/v/clip.mp4", "timestamps": [0, 1.75], "sampling": {"frames": 16, "fps": null, "sampled": 8, "source_frames": 8}}]}' ;;
*) echo '{"out": "t", "layers": 2, "prompt_tokens": 7, "decode_steps": 1, "bytes": 10, "videos": []}' ;;
esac
`), 0o755)
	args := []string{"--python", fake, "--kernels", "..", "trace", "capture", "--model", dir, "--image", image,
		"--prompt", "<image>", "--out", out}
	code, stdout, stderr := runCLI(t, args...)
	if code != 0 || !strings.Contains(stdout, "wrote t: 2 layers") || !strings.Contains(stderr, "loading the model from m on cpu") ||
		!strings.Contains(stderr, "writing t") || strings.Contains(stderr, "progress:") {
		t.Fatalf("exit %d\nstdout %s\nstderr %s", code, stdout, stderr)
	}
	if strings.Contains(stderr, "without --video") {
		t.Errorf("a warning about --frames that was not given:\n%s", stderr)
	}
	// Each video's sampling is said, and that --frames asked for more frames than the video has.
	code, stdout, _ = runCLI(t, append(args, "--video", dir, "--frames", "16")...)
	if code != 0 || !strings.Contains(stdout, "video /v/clip.mp4: 8 of its 8 frames sampled, 0.00s to 1.75s (--frames 16: it has no more)\n") {
		t.Errorf("a video's sampling: exit %d\n%s", code, stdout)
	}
	// --frames and --fps sample videos: given with images alone, they are said to do nothing.
	code, _, stderr = runCLI(t, append(args, "--fps", "2")...)
	if code != 0 || !strings.Contains(stderr, "--frames and --fps sample videos: without --video they do nothing") {
		t.Errorf("--fps without --video: exit %d\n%s", code, stderr)
	}
	t.Setenv("FAIL", "1")
	code, _, stderr = runCLI(t, args...)
	if line := string(lastLine([]byte(stderr))); code != 1 || line != "workbench: trace capture: the model does not load" ||
		!strings.Contains(stderr, "loading the model from m on cpu") {
		t.Errorf("exit %d, stderr %q", code, stderr)
	}
}

func TestTraceCaptureVideoFlags(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "t.safetensors")
	tests := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"neither image nor video", nil, 2, "at least one --image or --video"},
		{"no frames", []string{"--video", dir, "--frames", "0"}, 2, "--frames must be at least 1, got 0"},
		{"negative fps", []string{"--video", dir, "--fps", "-2"}, 2, "--fps must be a positive rate"},
		{"missing video", []string{"--video", filepath.Join(dir, "clip.mp4")}, 1,
			"--video " + filepath.Join(dir, "clip.mp4") + " does not exist: give a video file or a directory of frame images"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := append([]string{"--python", filepath.Join(dir, "no-python"), "trace", "capture", "--model", dir,
				"--prompt", "<video>", "--out", out}, tt.args...)
			code, _, stderr := runCLI(t, args...)
			if code != tt.code || !strings.Contains(stderr, tt.want) {
				t.Errorf("exit %d, stderr %q; want exit %d with %q", code, stderr, tt.code, tt.want)
			}
		})
	}
}

// A video end to end on tiny models of three video families: capture
// samples its frames and records a span per frame, inspect shows them, and
// a vlm workload with videos runs methods inside the model.
func TestTraceCaptureAVideo(t *testing.T) {
	py := os.Getenv("VLKV_TEST_PYTHON")
	if py == "" {
		t.Skip("needs VLKV_TEST_PYTHON")
	}
	root, _ := filepath.Abs("..")
	tests := []struct {
		family, placeholder string
		spans               string // what inspect says of 4 sampled frames
	}{
		// Qwen2-VL's tower merges two frames into one temporal step: two spans.
		{"qwen2_vl", "<|vision_start|><|video_pad|><|vision_end|>", "frames are images 0-1, 4 sampled"},
		{"llava_onevision", "<video>", "frames are images 0-3, 4 sampled"},
		{"llava_next_video", "<video>", "frames are images 0-3, 4 sampled"},
	}
	for _, tt := range tests {
		t.Run(tt.family, func(t *testing.T) {
			dir := t.TempDir()
			model := filepath.Join(dir, tt.family)
			build := exec.Command(py, "-m", "kernels_py.tests.tiny_vlm", "--family", tt.family, model)
			build.Dir = root
			build.Env = append(os.Environ(), "PYTHONPATH="+root)
			if out, err := build.CombinedOutput(); err != nil {
				t.Fatalf("build the tiny model: %v\n%s", err, out)
			}
			clip := filepath.Join(model, "clip.mp4")
			trace := filepath.Join(dir, "trace.safetensors")
			prompt := "USER : " + tt.placeholder + " describe the picture ASSISTANT :"
			code, stdout, stderr := runCLI(t, "--python", py, "--kernels", root, "trace", "capture", "--model", model,
				"--video", clip, "--frames", "4", "--prompt", prompt, "--out", trace, "--decode-steps", "2")
			if code != 0 || !strings.Contains(stdout, "2 decode steps") ||
				!strings.Contains(stdout, "video "+clip+": 4 of its 8 frames sampled, 0.00s to 1.75s\n") {
				t.Fatalf("capture: exit %d\n%s\n%s", code, stdout, stderr)
			}
			code, stdout, stderr = runCLI(t, "trace", "inspect", trace)
			if code != 0 || !strings.Contains(stdout, "video 0") || !strings.Contains(stdout, tt.spans) {
				t.Errorf("inspect: exit %d, want %q\n%s\n%s", code, tt.spans, stdout, stderr)
			}
			script := filepath.Join(dir, "v.star")
			os.WriteFile(script, []byte(`experiment(name = "video", methods = ["full", "h2o"], grid = {"budget": [0.3]},
    workloads = [workload("vlm", model = "`+model+`", videos = "`+clip+`", frames = 4,
                          prompt = "`+prompt+`", decode_steps = 2)])`), 0o644)
			code, stdout, stderr = runCLI(t, "--python", py, "--kernels", root, "run", script, "--out",
				filepath.Join(dir, "runs"))
			if code != 0 || !strings.Contains(stdout, "2 jobs, 0 failed") {
				t.Fatalf("run on the model with a video: exit %d\n%s\n%s", code, stdout, stderr)
			}
		})
	}
}
