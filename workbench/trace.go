package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/tensor"
	"github.com/vlkv/vlkv/gohost/worker"
)

func newTraceCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "trace",
		Short: "Capture a real model's attention (per-layer Q/K/V, spans) as a workload, and inspect traces",
	}
	cmd.AddCommand(newTraceCaptureCmd(a), newTraceInspectCmd(a))
	return cmd
}

func newTraceCaptureCmd(a *app) *cobra.Command {
	var model, prompt, out string
	var images, videos []string
	var steps, frames int
	var fps float64
	cmd := &cobra.Command{
		Use:   "capture --model DIR (--image FILE | --video FILE)... --prompt TEXT --out FILE.safetensors",
		Short: "Run a local VLM with the full cache and record every layer's Q/K/V",
		Long: `capture loads a Hugging Face VLM from a local directory (see README "Use your own
model" for the families and which take images, several images or video;
nothing is downloaded) on the --device (a GPU where there is one) in its
checkpoint's dtype, runs the prompt with its images and videos and a
greedy generation of --decode-steps + 1 tokens with the full cache, and
writes every language-model layer's Q/K/V (keys both before and after
RoPE) for the prompt and each decode step, with the RoPE positions (3-D on
M-RoPE models), modality spans (one per image and per video frame) and the
model's shape, to one safetensors file. A --video is a video file (decoded
with PyAV) or a directory of frame images; --frames of it are sampled,
spread evenly over the video, or with --fps one every 1/fps seconds up to
--frames. Sliding-window layers (Gemma 3) are not recorded: the methods
hold only the global layers. Experiments replay the trace as a workload:
workload("trace", path = "FILE.safetensors").`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if model == "" || prompt == "" || out == "" || len(images)+len(videos) == 0 {
				return &usageError{errors.New("trace capture needs --model, at least one --image or --video, --prompt and --out")}
			}
			if steps < 1 {
				return &usageError{fmt.Errorf("--decode-steps must be at least 1, got %d", steps)}
			}
			if frames < 1 {
				return &usageError{fmt.Errorf("--frames must be at least 1, got %d", frames)}
			}
			if fps < 0 || math.IsNaN(fps) || math.IsInf(fps, 0) {
				return &usageError{fmt.Errorf("--fps must be a positive rate (frames a second), got %g", fps)}
			}
			if len(videos) == 0 && (cmd.Flags().Changed("frames") || cmd.Flags().Changed("fps")) {
				a.log.Warn().Msg("--frames and --fps sample videos: without --video they do nothing")
			}
			// Checked before Python starts, which takes seconds, and the
			// model more before the file is written.
			if err := checkCaptureFiles(model, images, videos, out); err != nil {
				return err
			}
			ctx := cmd.Context()
			kernels, rt, err := a.resolveRuntime(ctx)
			if err != nil {
				return err
			}
			args := []string{safePath, "-m", "kernels_py.models.trace", "--model", model, "--prompt", prompt, "--out", out,
				"--decode-steps", fmt.Sprint(steps), "--progress"}
			for _, img := range images {
				args = append(args, "--image", img)
			}
			for _, v := range videos {
				args = append(args, "--video", v)
			}
			if len(videos) > 0 {
				args = append(args, "--frames", fmt.Sprint(frames))
				if fps > 0 {
					args = append(args, "--fps", fmt.Sprint(fps))
				}
			}
			c := exec.CommandContext(ctx, rt.Python, args...)
			c.Env = worker.Environment(os.Environ(), kernels.Dir, a.flags.device.value)
			var stdout bytes.Buffer
			// Loading a large model takes minutes: each stage is logged as it starts.
			stderr := &progressLines{log: func(msg string) { a.log.Info().Msg(msg) }}
			c.Stdout, c.Stderr = &stdout, stderr
			a.log.Info().Str("model", model).Int("decode_steps", steps).Msg("capturing an attention trace")
			if err := c.Run(); err != nil {
				if ctx.Err() != nil { // Ctrl-C: the capture was stopped, not broken
					return errors.New("trace capture: interrupted")
				}
				msg := strings.TrimSpace(stderr.String())
				if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 2 {
					return errors.New(msg) // the capture's own message says what is wrong
				}
				// Not an input the capture knows to refuse: its last line
				// (a traceback's exception) says what failed, and --verbose
				// shows the rest.
				a.log.Debug().Msg(msg)
				if msg == "" {
					return fmt.Errorf("trace capture: %w", err)
				}
				return fmt.Errorf("trace capture: %s (%w; --verbose shows the traceback)", lastLine([]byte(msg)), err)
			}
			var res struct {
				Out          string `json:"out"`
				Layers       int    `json:"layers"`
				PromptTokens int    `json:"prompt_tokens"`
				DecodeSteps  int    `json:"decode_steps"`
				Bytes        int64  `json:"bytes"`
				Videos       []struct {
					Source     string    `json:"source"`
					Timestamps []float64 `json:"timestamps"`
					Sampling   struct {
						Frames       int      `json:"frames"`
						FPS          *float64 `json:"fps"`
						Sampled      int      `json:"sampled"`
						SourceFrames int      `json:"source_frames"`
					} `json:"sampling"`
				} `json:"videos"`
			}
			if err := json.Unmarshal(lastLine(stdout.Bytes()), &res); err != nil {
				return fmt.Errorf("trace capture returned an unexpected result: %w", err)
			}
			fmt.Fprintf(a.stdout, "wrote %s: %s, %s, %s, %s\n", res.Out, plural(res.Layers, "layer"),
				plural(res.PromptTokens, "prompt token"), plural(res.DecodeSteps, "decode step"), humanBytes(res.Bytes))
			for _, v := range res.Videos {
				s := v.Sampling
				line := fmt.Sprintf("video %s: %d of its %d frames sampled", v.Source, s.Sampled, s.SourceFrames)
				if ts := v.Timestamps; len(ts) > 0 {
					line += fmt.Sprintf(", %.2fs to %.2fs", ts[0], ts[len(ts)-1])
				}
				if s.FPS == nil && s.Sampled < s.Frames {
					line += fmt.Sprintf(" (--frames %d: it has no more)", s.Frames)
				}
				fmt.Fprintln(a.stdout, line)
			}
			// Absolute, so the line works in any script (a relative path would be taken from the kernels root).
			suggested := res.Out
			if abs, err := filepath.Abs(res.Out); err == nil {
				suggested = abs
			}
			fmt.Fprintf(a.stdout, "replay it in an experiment: workload(\"trace\", path = %q)\n", suggested)
			return nil
		},
	}
	cmd.Flags().StringVar(&model, "model", "", "local model directory (config.json, weights, processor files)")
	cmd.Flags().StringArrayVar(&images, "image", nil, "image file, one per image placeholder in the prompt (repeatable)")
	cmd.Flags().StringArrayVar(&videos, "video", nil, "video file or directory of frame images, one per video placeholder in the prompt (repeatable)")
	cmd.Flags().IntVar(&frames, "frames", 8, "frames sampled from each video (with --fps: at most this many)")
	cmd.Flags().Float64Var(&fps, "fps", 0, "sample each video at this rate, frames a second (default: --frames spread over the whole video; a directory of frames is read as --fps frames a second, 1 without it)")
	cmd.Flags().StringVar(&prompt, "prompt", "", "prompt text with one placeholder per image and per video, in order (LLaVA: <image>, Qwen2-VL: <|vision_start|><|image_pad|><|vision_end|>; README lists each family's)")
	cmd.Flags().StringVar(&out, "out", "", "trace file to write (.safetensors)")
	cmd.Flags().IntVar(&steps, "decode-steps", 16, "decode steps to record")
	return cmd
}

// checkCaptureFiles says, in one line, what of capture's files is missing
// (the model directory, an image, a video) or why out cannot be written: its
// directory is missing, not a directory or not writable, or out is a
// directory. What is in the files is for the capture to check.
func checkCaptureFiles(model string, images, videos []string, out string) error {
	if st, err := os.Stat(model); err != nil || !st.IsDir() {
		return fmt.Errorf("--model %s is not a directory: give a local directory holding config.json, the weights "+
			"and the processor files (save_pretrained writes them)", model)
	}
	for _, img := range images {
		if st, err := os.Stat(img); err != nil || st.IsDir() {
			return fmt.Errorf("--image %s is not a file", img)
		}
	}
	for _, v := range videos {
		if _, err := os.Stat(v); err != nil {
			return fmt.Errorf("--video %s does not exist: give a video file or a directory of frame images", v)
		}
	}
	if st, err := os.Stat(out); err == nil && st.IsDir() {
		return fmt.Errorf("--out %s is a directory: name the file to write, e.g. %s", out,
			filepath.Join(out, "trace.safetensors"))
	} else if err == nil && !isTrace(out) {
		// An earlier trace may be replaced; anything else (the model's own
		// weights, an input image) would be lost.
		return fmt.Errorf("--out %s exists and is not a trace, so capturing would overwrite it: name a new file "+
			"(or remove that one first)", out)
	}
	dir := filepath.Dir(out)
	st, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("--out %s: directory %s does not exist: create it first", out, dir)
	case err != nil:
		return fmt.Errorf("--out %s: %w", out, err)
	case !st.IsDir():
		return fmt.Errorf("--out %s: %s is not a directory", out, dir)
	}
	// The trace is written after the model has run, minutes on a large one.
	f, err := os.CreateTemp(dir, ".write-check-*")
	if err != nil {
		return fmt.Errorf("--out %s: directory %s is not writable: %w", out, dir, err)
	}
	f.Close()
	return os.Remove(f.Name())
}

// isTrace says whether path is a safetensors file with trace metadata.
func isTrace(path string) bool {
	h, err := readSafetensorsHeader(path)
	if err != nil {
		return false
	}
	_, ok := h.Metadata["vlkv"]
	return ok
}

// progressLines is the capture's stderr: its "progress: " lines go to log
// as they come, the rest (an error, a traceback) is kept for String.
type progressLines struct {
	log     func(string)
	rest    bytes.Buffer
	partial []byte
}

func (w *progressLines) Write(p []byte) (int, error) {
	w.partial = append(w.partial, p...)
	for {
		i := bytes.IndexByte(w.partial, '\n')
		if i < 0 {
			return len(p), nil
		}
		line := w.partial[:i+1]
		if msg, ok := bytes.CutPrefix(line, []byte("progress: ")); ok {
			w.log(string(bytes.TrimSpace(msg)))
		} else {
			w.rest.Write(line)
		}
		w.partial = w.partial[i+1:]
	}
}

func (w *progressLines) String() string { return w.rest.String() + string(w.partial) }

func lastLine(b []byte) []byte {
	lines := bytes.Split(bytes.TrimSpace(b), []byte("\n"))
	return lines[len(lines)-1]
}

// traceFormat is the format kernels_py.models.trace writes and reads
// (its FORMAT).
const traceFormat = "vlkv-trace/1"

// traceMeta is the part of a trace's "vlkv" metadata inspect prints.
type traceMeta struct {
	Format string `json:"format"`
	Model  struct {
		Directory string  `json:"directory"`
		ModelType string  `json:"model_type"`
		Layers    int     `json:"layers"`
		Heads     int     `json:"heads"`
		KVHeads   int     `json:"kv_heads"`
		HeadDim   int     `json:"head_dim"`
		RopeTheta float64 `json:"rope_theta"`
		Rope      string  `json:"rope"`
		// The config's RoPE scaling (absent from traces written before it
		// was recorded: none).
		RopeScaling *struct {
			Type   string  `json:"type"`
			Factor float64 `json:"factor"`
		} `json:"rope_scaling,omitempty"`
		DType string `json:"dtype"`
		// A model with sliding-window layers (Gemma 3): its layer count and
		// those layers, which the trace leaves out.
		ModelLayers   int   `json:"model_layers,omitempty"`
		SlidingLayers []int `json:"sliding_layers,omitempty"`
	} `json:"model"`
	Spans struct {
		System [2]int   `json:"system"`
		Images [][2]int `json:"images"`
		Text   [2]int   `json:"text"`
		Videos [][2]int `json:"videos,omitempty"` // per video, its frames' indices in Images
	} `json:"spans"`
	Videos []struct {
		Source     string    `json:"source"`
		Timestamps []float64 `json:"timestamps"`
	} `json:"videos,omitempty"`
	PromptTokens int    `json:"prompt_tokens"`
	DecodeSteps  int    `json:"decode_steps"`
	Prompt       string `json:"prompt"`
	Tokens       []int  `json:"tokens"`
}

// check refuses metadata a trace capture did not write: with no format or
// shape there is nothing to replay, and a summary of zeros would hide it.
func (m *traceMeta) check() error {
	switch {
	case m.Format == "":
		return fmt.Errorf("its trace metadata has no format (not written by `workbench trace capture`; capture the trace again)")
	case m.Format != traceFormat:
		return fmt.Errorf("trace format %q; this version reads %q (capture the trace again)", m.Format, traceFormat)
	case m.Model.Layers < 1 || m.Model.Heads < 1 || m.Model.KVHeads < 1 || m.Model.HeadDim < 1:
		return fmt.Errorf("its trace metadata gives no model shape (layers %d, heads %d, kv_heads %d, head_dim %d; capture the trace again)",
			m.Model.Layers, m.Model.Heads, m.Model.KVHeads, m.Model.HeadDim)
	}
	return nil
}

// checkTensors refuses a trace whose tensors are not the ones its metadata
// describes (one missing, of another shape, or Q/K/V not floating point),
// naming the tensor, as a replay does (kernels_py.models.trace's
// _check_tensors), from the header alone: a summary of a file every replay
// refuses would pass it as a trace.
func (m *traceMeta) checkTensors(entries []tensor.SafetensorsEntry) error {
	md := m.Model
	prompt, steps := int64(m.PromptTokens), int64(m.DecodeSteps)
	heads, kvHeads, dim := int64(md.Heads), int64(md.KVHeads), int64(md.HeadDim)
	var rope []int64
	if md.Rope == "mrope" { // M-RoPE positions are temporal, height, width
		rope = []int64{3}
	}
	want := map[string][]int64{
		"positions":        append(slices.Clone(rope), prompt),
		"decode_positions": append(slices.Clone(rope), steps),
	}
	for l := range md.Layers {
		want[fmt.Sprintf("layer.%d.q", l)] = []int64{heads, prompt, dim}
		want[fmt.Sprintf("layer.%d.decode_q", l)] = []int64{steps, heads, 1, dim}
		for _, name := range []string{"k", "v", "k_pre"} {
			want[fmt.Sprintf("layer.%d.%s", l, name)] = []int64{kvHeads, prompt, dim}
			want[fmt.Sprintf("layer.%d.decode_%s", l, name)] = []int64{steps, kvHeads, 1, dim}
		}
	}
	got := make(map[string]tensor.SafetensorsEntry, len(entries))
	for _, e := range entries {
		got[e.Name] = e
	}
	shape := fmt.Sprintf("%d layers, %d heads, %d kv heads, head_dim %d, %d prompt tokens, %d decode steps",
		md.Layers, md.Heads, md.KVHeads, md.HeadDim, m.PromptTokens, m.DecodeSteps)
	names := slices.Sorted(maps.Keys(want))
	for _, name := range names {
		e, ok := got[name]
		switch {
		case !ok && strings.HasSuffix(name, "k_pre"):
			// Traces written before pre-RoPE keys were recorded replay without them.
		case !ok:
			return fmt.Errorf("tensor %q is missing (its metadata gives %s): the file is not a whole trace; capture it again",
				name, shape)
		case !slices.Equal(e.Shape, want[name]):
			return fmt.Errorf("tensor %q has shape %v, not the %v its metadata gives (%s): capture the trace again",
				name, e.Shape, want[name], shape)
		case strings.HasPrefix(name, "layer.") && e.DType.Code != tensor.CodeFloat && e.DType.Code != tensor.CodeBFloat:
			return fmt.Errorf("tensor %q is %s, not floating point as Q/K/V are: capture the trace again", name, e.DType)
		}
	}
	return nil
}

// checkSpans refuses spans a replay refuses (kernels_py.models.trace's
// _check_spans): out of order, overlapping, or not ending at the last
// prompt token.
func (m *traceMeta) checkSpans() error {
	s := m.Spans
	bounds := []int{s.System[0], s.System[1]}
	for _, img := range s.Images {
		bounds = append(bounds, img[0], img[1])
	}
	bounds = append(bounds, s.Text[0], s.Text[1])
	if bounds[0] < 0 || !slices.IsSorted(bounds) {
		return fmt.Errorf("its spans do not follow each other (system %v, images %v, text %v: the system prompt, "+
			"the images in order and without overlap, then the text): capture the trace again", s.System, s.Images, s.Text)
	}
	if s.Text[1] != m.PromptTokens {
		return fmt.Errorf("its spans end at token %d, not at the %d prompt tokens its metadata gives: capture the trace again",
			s.Text[1], m.PromptTokens)
	}
	return nil
}

func newTraceInspectCmd(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "inspect FILE.safetensors",
		Short: "Summarise a trace: model shape, spans, steps, dtype and bytes (reads the header only)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			h, err := readSafetensorsHeader(args[0])
			if err != nil {
				return err
			}
			raw, ok := h.Metadata["vlkv"]
			if !ok {
				return fmt.Errorf("%s is a safetensors file but not a trace (no \"vlkv\" metadata): capture one with "+
					"`workbench trace capture`", args[0])
			}
			var meta traceMeta
			if err := json.Unmarshal([]byte(raw), &meta); err != nil {
				return fmt.Errorf("%s: its trace metadata does not parse: %w", args[0], err)
			}
			if err := meta.check(); err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			if err := meta.checkTensors(h.Entries); err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			if err := meta.checkSpans(); err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			total := int64(0)
			for _, e := range h.Entries {
				total += e.End - e.Begin
			}
			if asJSON {
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(struct {
					traceMeta
					Tensors int   `json:"tensors"`
					Bytes   int64 `json:"bytes"`
				}{meta, len(h.Entries), total})
			}
			m := meta.Model
			tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintf(tw, "format\t%s\n", meta.Format)
			fmt.Fprintf(tw, "model\t%s (%s)\n", m.Directory, m.ModelType)
			layers := plural(m.Layers, "layer")
			if len(m.SlidingLayers) > 0 {
				sliding := make([]string, len(m.SlidingLayers))
				for i, l := range m.SlidingLayers {
					sliding[i] = fmt.Sprint(l)
				}
				layers = fmt.Sprintf("%d of the model's %d layers (sliding-window layers %s not recorded)", m.Layers,
					m.ModelLayers, strings.Join(sliding, " "))
			}
			fmt.Fprintf(tw, "shape\t%s, %d query heads, %d kv heads, head_dim %d\n", layers, m.Heads, m.KVHeads, m.HeadDim)
			rope := fmt.Sprintf("%s, theta %g", m.Rope, m.RopeTheta)
			if sc := m.RopeScaling; sc != nil && sc.Type != "" && sc.Type != "default" {
				rope += fmt.Sprintf(", %s scaling by %g", sc.Type, sc.Factor)
			}
			fmt.Fprintf(tw, "rope\t%s\n", rope)
			fmt.Fprintf(tw, "dtype\t%s\n", m.DType)
			images := make([]string, len(meta.Spans.Images))
			for i, s := range meta.Spans.Images {
				images[i] = fmt.Sprintf("[%d, %d)", s[0], s[1])
			}
			fmt.Fprintf(tw, "spans\tsystem [%d, %d), images %s, text [%d, %d)\n", meta.Spans.System[0],
				meta.Spans.System[1], strings.Join(images, " "), meta.Spans.Text[0], meta.Spans.Text[1])
			for i, v := range meta.Spans.Videos {
				source, seconds := "", ""
				if i < len(meta.Videos) {
					source = meta.Videos[i].Source
					if ts := meta.Videos[i].Timestamps; len(ts) > 0 {
						seconds = fmt.Sprintf(", %d sampled from %.2fs to %.2fs", len(ts), ts[0], ts[len(ts)-1])
					}
				}
				fmt.Fprintf(tw, "video %d\t%s: frames are images %d-%d%s\n", i, source, v[0], v[1]-1, seconds)
			}
			fmt.Fprintf(tw, "tokens\t%d prompt, %s\n", meta.PromptTokens, plural(meta.DecodeSteps, "decode step"))
			fmt.Fprintf(tw, "data\t%d tensors, %s\n", len(h.Entries), humanBytes(total))
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the summary as JSON")
	return cmd
}
