"""Video inputs: a video file (decoded with PyAV, whose wheels bundle FFmpeg)
or a directory of frame images, sampled to a few frames as the families'
processors and lmms-eval's video models sample them. Only the sampled frames
are converted and kept; a wanted frame far ahead is reached by seeking."""

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
# A wanted frame further ahead than this is reached by seeking to the keyframe before it rather than by
# decoding every frame between (a seek costs up to a keyframe interval of decoding).
SEEK_SECONDS = 2.0


class VideoError(ValueError):
    """A video that cannot be read or sampled; the message says what to do."""


@dataclass(frozen=True, eq=False)  # eq=False: arrays do not compare to one bool
class Video:
    frames: np.ndarray  # [F, H, W, 3] uint8 RGB, the sampled frames in time order
    timestamps: tuple[float, ...]  # seconds of each sampled frame from the start of the source
    source_fps: float  # the source's frame rate; for a frame directory, the fps given (1 without)
    source: str  # the path it came from
    sampling: dict  # asked and done: frames, fps, sampled, duration, source_frames, indices


def sample_indices(total: int, rate: float, frames: int, fps: float | None) -> list[int]:
    """Which of `total` frames shown at `rate` per second to keep, in order:
    `frames` spread uniformly over all of them, first and last included, as
    numpy.linspace truncated to integers (fps None); or the frame shown every
    1/fps seconds, of which `frames` spread uniformly where there are more."""
    if fps is None:
        picked = np.linspace(0, total - 1, frames, dtype=int)
    else:
        times = np.arange(math.ceil(total * fps / rate - 1e-9)) / fps  # every 1/fps seconds before the end
        picked = np.minimum(np.floor(times * rate + 1e-9).astype(int), total - 1)
        if len(picked) > frames:
            picked = picked[np.linspace(0, len(picked) - 1, frames, dtype=int)]
    return np.unique(picked).tolist()  # more frames asked than there are (or fps above the source's): no repeats


def load_video(source: str | Path, frames: int = 8, fps: float | None = None) -> Video:
    """`frames` frames of a video file or of a directory of frame images
    (sorted by name, numbers in names compared as numbers, read as `fps`
    frames per second, 1 when None), sampled by sample_indices."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise VideoError(f"frames must be a whole number >= 1 (the most frames sampled), not {frames!r}")
    if fps is not None and not fps > 0:
        raise VideoError(f"fps must be > 0 (frames sampled per second of video), or None for `frames` frames "
                         f"spread over the whole video; not {fps!r}")
    path = Path(source)
    if not path.exists():
        raise VideoError(f"video {path} does not exist: give a video file (MP4, MKV, WebM, AVI, ...) or a directory "
                         f"of frame images")
    read = _read_directory if path.is_dir() else _read_file
    return read(path, frames, fps)


def _read_directory(path: Path, frames: int, fps: float | None) -> Video:
    from PIL import Image, UnidentifiedImageError

    files = sorted((f for f in path.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file()),
                   key=lambda f: [int(p) if p.isdigit() else p.lower() for p in re.split(r"(\d+)", f.name)])
    if not files:
        raise VideoError(f"frame directory {path} holds no images ({', '.join(IMAGE_SUFFIXES)}): put the frames "
                         f"there, named in time order (frame_1.png, frame_2.png, ...)")
    rate = fps or 1.0
    keep = sample_indices(len(files), rate, frames, fps)
    try:
        sizes = {}
        for f in files:  # headers only: the frames of a video share one size
            with Image.open(f) as image:
                sizes.setdefault(image.size, f.name)
        if len(sizes) > 1:
            (first, a), (second, b) = list(sizes.items())[:2]
            raise VideoError(f"frame directory {path} holds frames of different sizes ({a} is {first[0]}x{first[1]}, "
                             f"{b} is {second[0]}x{second[1]}): resize them to one size")
        pictures = []
        for i in keep:
            with Image.open(files[i]) as image:
                pictures.append(np.asarray(image.convert("RGB")))
    except (OSError, UnidentifiedImageError) as err:
        raise VideoError(f"frame directory {path}: an image cannot be read ({_first_line(err)}): remove or replace "
                         f"it") from None
    sampling = {"frames": frames, "fps": fps, "sampled": len(keep), "duration": len(files) / rate,
                "source_frames": len(files), "indices": keep}
    return Video(np.stack(pictures), tuple(i / rate for i in keep), rate, str(path), sampling)


def _read_file(path: Path, frames: int, fps: float | None) -> Video:
    import av

    hint = "give a video file (MP4, MKV, WebM, AVI, ...); a truncated or corrupt one must be fetched or written again"
    if path.suffix.lower() in IMAGE_SUFFIXES:  # a still image reads as a stream of one frame without a rate
        hint = (f"a {path.suffix} file is an image, not a video: give it as an image (images, --image), or give "
                f"the directory holding a video's frame images")
    try:
        container = av.open(str(path))
    except av.FFmpegError as err:
        raise VideoError(f"{path} cannot be opened as a video ({_first_line(err)}): {hint}") from None
    with container:
        if not container.streams.video:
            held = sorted({s.type for s in container.streams}) or ["no streams"]
            raise VideoError(f"{path} has no video stream (it holds {', '.join(held)}): give a video file")
        stream = container.streams.video[0]
        if stream.codec_context is None:  # FFmpeg knows no decoder for it (decoding it would crash)
            raise VideoError(f"{path}: its video codec has no decoder in PyAV's FFmpeg: re-encode it "
                             f"(ffmpeg -i IN -c:v libx264 OUT.mp4)")
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if stream.duration:
            duration = float(stream.duration * stream.time_base)
        else:
            duration = (container.duration or 0) / av.time_base
        total = stream.frames or round(duration * float(rate or 0))  # some containers give only the duration
        if not rate or total < 1:
            raise VideoError(f"{path}: its video stream gives no frame rate or frame count: {hint}")
        keep = sample_indices(total, float(rate), frames, fps)
        try:
            picked = _decode(path, container, stream, [i / float(rate) for i in keep], float(rate))
        except av.FFmpegError as err:
            raise VideoError(f"{path} cannot be decoded ({_first_line(err)}; codec {stream.codec_context.name}): "
                             f"{hint}") from None
    if not picked:
        raise VideoError(f"{path}: no frame of its video stream could be decoded: {hint}")
    times = tuple(t for t, _ in picked)
    sampling = {"frames": frames, "fps": fps, "sampled": len(picked), "duration": duration, "source_frames": total,
                "indices": [round(t * float(rate)) for t in times]}
    return Video(np.stack([f for _, f in picked]), times, float(rate), str(path), sampling)


def _decode(path: Path, container, stream, targets: list[float], rate: float) -> list[tuple[float, np.ndarray]]:
    """(seconds, RGB frame) of the first frame at or after each target time
    (within half a frame), in order, decoding forward and seeking across
    long gaps. Where the stream ends within a frame or so of a target (a
    frame count estimated from the duration), its last frame stands in;
    further short, the file was cut."""
    base, start = stream.time_base, stream.start_time or 0  # base a Fraction: exact seconds
    decoded, position, last, picked = container.decode(stream), 0.0, None, []
    size = {}
    for target in targets:
        if target - position > SEEK_SECONDS:
            container.seek(start + int(target / float(base)), stream=stream, backward=True)  # the keyframe before it
            decoded = container.decode(stream)
        for frame in decoded:
            position = float((frame.pts - start) * base) if frame.pts is not None else position + 1 / rate
            last = frame
            if position >= target - 0.5 / rate:
                break
        else:
            if last is None or position < target - 1.5 / rate:
                raise VideoError(f"{path}: its frames end at {position:.2f} s, before the {target:.2f} s its header "
                                 f"promises: a truncated or corrupt file must be fetched or written again")
            if not picked or picked[-1][0] < position:
                picked.append((position, last.to_ndarray(format="rgb24", **size)))
            break
        size = size or {"width": frame.width, "height": frame.height}  # a stream may change size: keep the first
        picked.append((position, frame.to_ndarray(format="rgb24", **size)))
    return picked


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: " + (str(err).strip().splitlines() or [""])[0][:160]
