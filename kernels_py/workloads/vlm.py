"""A real VLM as a workload: the model (a local directory) runs the prompt
with its images, and every job both replays the captured attention (the
ablation's metrics, on real Q/K/V) and runs its method inside the model
(kernels_py.models): token agreement and KL of the next-token distributions
against the full cache, the method's bytes, prefill and decode times, peak
memory on the model's device (all of it, and while decoding), and per step
the tokens and KL."""

import functools
from dataclasses import dataclass

from kernels_py.params import Rule, knob
from kernels_py.workloads.base import Workload, WorkloadConfig, loaded_model


@dataclass(frozen=True)
class VLMConfig(WorkloadConfig):
    """A local VLM (any family of README "Use your own model") run on a prompt with images and videos; methods run
    inside it."""

    name = "vlm"
    runs_model = True
    # A model left out is the required knob's to report (and the defaults, which have none, must pass).
    RULES = (Rule('model == "" or images.strip(" ,") != "" or videos.strip(" ,") != ""',
                  "needs images= or videos=: the image files, or video files or frame directories, one per "
                  "placeholder in its prompt"),
             Rule('videos.strip(" ,") != "" or (frames == 8 and fps == 0.0)',
                  "frames= and fps= sample videos, and no videos= is given: they would change nothing but the "
                  "job's id"),)

    model: str = knob("str", "", "local model directory (config.json, weights, processor files; nothing is "
                      "downloaded)", paths=True, required=True)
    images: str = knob("str", "", "image files, comma-separated, one per image placeholder in the prompt",
                       paths=True)
    # The video knobs are left out of job ids at their defaults, so runs planned before them keep their ids.
    videos: str = knob("str", "", "video files or directories of frame images, comma-separated, one per video "
                       "placeholder in the prompt", id_omits_default=True, paths=True)
    frames: int = knob("int", 8, "frames sampled from each video (with fps: at most this many)", min=1, max=4096,
                       id_omits_default=True)
    fps: float = knob("float", 0.0, "sample each video at this rate, frames a second (0: frames spread evenly over "
                      "the whole video; a frame directory is read as fps frames a second)", min=0.0, max=1000.0,
                      id_omits_default=True)
    prompt: str = knob("str", "", "the prompt, with one placeholder per image and per video, in order (LLaVA: "
                       "<image>; README lists each family's)", required=True)
    decode_steps: int = knob("int", 16, "tokens decoded from each method's cache and scored, after the prefill's "
                             "own token, which is scored too (only a method that changes the prefill, a sparse "
                             "prefill, can change it); the full cache's greedy tokens are fed to every method, so "
                             "all are compared on the same history", min=1, max=4096)

    def load(self):
        if not self.model or not (self.images or self.videos) or not self.prompt:
            raise ValueError("workload 'vlm' needs model=, prompt= and images= or videos=")
        return loaded_model(self.model)

    def image_list(self) -> list[str]:
        return [p.strip() for p in self.images.split(",") if p.strip()]

    def video_list(self) -> list:
        """The videos, their frames sampled as the knobs say."""
        return [_video(p.strip(), self.frames, self.fps or None) for p in self.videos.split(",") if p.strip()]

    def build(self) -> Workload:
        from kernels_py.models.trace import capture, spans_of
        from kernels_py.workloads.trace import from_tensors

        vlm = self.load()
        tensors, meta = capture(vlm, self.image_list(), self.prompt, self.decode_steps, self.video_list())
        return from_tensors(self, tensors, meta, spans_of(meta))


@functools.lru_cache(maxsize=8)
def _video(path: str, frames: int, fps: float | None):
    """A video is decoded once for the capture and the in-model run of all the jobs on it."""
    from kernels_py.models.video import load_video

    return load_video(path, frames, fps)
