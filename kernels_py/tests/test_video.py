"""Video loading: sampled frame indices and timestamps in both modes, the
decoded frames against the ones written, seeking against decoding through,
frame directories, and each bad input's one-line error."""

import wave

import numpy as np
import pytest
from PIL import Image

av = pytest.importorskip("av")  # a base dependency; a foreign --python may lack it

from kernels_py.models import video
from kernels_py.models.video import Video, VideoError, load_video

COUNT, RATE, SIZE = 40, 10, 48  # a 4-second video


def picture(i: int) -> np.ndarray:
    """Frame i: a background a little brighter each frame and a square moving right."""
    frame = np.full((SIZE, SIZE, 3), 6 * i, np.uint8)
    x = i % (SIZE - 12)
    frame[16:28, x:x + 12] = (230, 20, 20)
    return frame


def write_video(path, count=COUNT, rate=RATE):
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=rate)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "10"}
        stream.codec_context.gop_size = 8  # keyframes to seek to
        for i in range(count):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(picture(i), format="rgb24")))
        out.mux(stream.encode())
    return path


@pytest.fixture(scope="module", params=["mp4", "mkv"])  # an MKV's header gives no frame count: estimated
def clip(request, tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("video") / f"clip.{request.param}")


def nearest(frame: np.ndarray) -> int:
    """The written frame closest to a decoded one."""
    return int(np.argmin([np.abs(frame.astype(int) - picture(i)).mean() for i in range(COUNT)]))


def check(got: Video, indices: list[int], rate: float):
    assert got.frames.dtype == np.uint8 and got.frames.shape == (len(indices), SIZE, SIZE, 3)
    assert [nearest(f) for f in got.frames] == indices
    assert all(np.abs(f.astype(int) - picture(i)).mean() < 4 for f, i in zip(got.frames, indices))  # lossy
    assert got.timestamps == pytest.approx([i / rate for i in indices])
    assert got.sampling["sampled"] == len(indices) and got.sampling["indices"] == indices


def test_frames_spread_over_the_whole_video(clip):
    got = load_video(clip, frames=5)
    check(got, [39 * k // 4 for k in range(5)], RATE)  # linspace(0, 39, 5) truncated: first and last
    assert got.source_fps == RATE and got.source == str(clip)
    assert got.sampling | {"indices": None} == {"frames": 5, "fps": None, "sampled": 5, "duration": 4.0,
                                                 "source_frames": COUNT, "indices": None}
    check(load_video(clip, frames=100), list(range(COUNT)), RATE)  # fewer frames than asked: each once


def test_one_frame_every_1_over_fps_seconds_capped_at_frames(clip):
    every = [k * RATE // 3 for k in range(12)]  # k/3 s for k/3 < 4 s, the frame shown then
    check(load_video(clip, frames=50, fps=3), every, RATE)
    check(load_video(clip, frames=5, fps=3), [every[11 * j // 4] for j in range(5)], RATE)  # 5 spread over 12
    assert load_video(clip, frames=5, fps=3).sampling["fps"] == 3


def test_seeking_gives_the_frames_decoding_through_gives(clip, monkeypatch):
    seeks = []

    class Counting:  # av.open's container, counting seeks
        def __init__(self, container):
            self.container = container

        def __getattr__(self, name):
            return getattr(self.container, name)

        def seek(self, *args, **kwargs):
            seeks.append(args)
            return self.container.seek(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.container.close()

    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    monkeypatch.setattr(video, "SEEK_SECONDS", 1e9)
    through = load_video(clip, frames=4)
    assert not seeks
    monkeypatch.setattr(video, "SEEK_SECONDS", 0.5)
    sought = load_video(clip, frames=4)
    assert len(seeks) == 3
    assert np.array_equal(sought.frames, through.frames) and sought.timestamps == through.timestamps


def test_a_frame_directory_in_natural_order(tmp_path):
    for i in range(12):  # frame_1 .. frame_12: frame_10 sorts after frame_9
        Image.fromarray(picture(i)).save(tmp_path / f"frame_{i + 1}.png")
    (tmp_path / "notes.txt").write_text("not a frame")
    got = load_video(tmp_path, frames=4)
    indices = [11 * k // 3 for k in range(4)]
    assert np.array_equal(got.frames, np.stack([picture(i) for i in indices]))
    assert got.timestamps == tuple(float(i) for i in indices) and got.source_fps == 1.0  # one frame a second
    every = load_video(tmp_path, frames=50, fps=2)  # 2 frames a second: 6 s, a frame every 0.5 s is every frame
    assert np.array_equal(every.frames, np.stack([picture(i) for i in range(12)]))
    assert every.timestamps == tuple(i / 2 for i in range(12)) and every.sampling["duration"] == 6.0
    capped = load_video(tmp_path, frames=4, fps=2)  # the same 12 frames, 4 of them spread
    assert capped.sampling["indices"] == indices and capped.timestamps == tuple(i / 2 for i in indices)


def test_bad_input_is_one_line_error(tmp_path, clip):
    text = tmp_path / "notes.mp4"
    text.write_text("these are notes, not a video\n")
    data = clip.read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[:len(data) // 2])
    with wave.open(str(tmp_path / "sound.wav"), "wb") as audio:
        audio.setnchannels(1)
        audio.setsampwidth(2)
        audio.setframerate(8000)
        audio.writeframes(b"\0\0" * 800)
    (tmp_path / "empty").mkdir()
    (tmp_path / "sizes").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "sizes" / "1.png")
    Image.new("RGB", (9, 8)).save(tmp_path / "sizes" / "2.png")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "1.png").write_text("not a picture")
    cases = [
        ((tmp_path / "nowhere.mp4",), "does not exist: give a video file"),
        ((text,), "cannot be opened as a video"),
        ((tmp_path / "cut.mp4",), "a truncated or corrupt"),
        ((tmp_path / "sound.wav",), "has no video stream (it holds audio)"),
        ((tmp_path / "empty",), "holds no images"),
        ((tmp_path / "sizes",), "frames of different sizes (1.png is 8x8, 2.png is 9x8)"),
        ((tmp_path / "broken",), "an image cannot be read"),
        ((tmp_path / "sizes" / "1.png",), "1.png: its video stream gives no frame rate or frame count: a .png file "
                                          "is an image, not a video: give it as an image (images, --image)"),
        ((clip, 0), "frames must be a whole number >= 1"),
        ((clip, 4, 0), "fps must be > 0"),
        ((clip, 4, -1.0), "fps must be > 0"),
    ]
    for args, message in cases:
        with pytest.raises(VideoError) as err:
            load_video(*args)
        assert isinstance(err.value, ValueError)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_codec_with_no_decoder_is_an_error(tmp_path):
    """An MKV whose codec id FFmpeg does not know: a video stream with no decoder."""
    with av.open(str(tmp_path / "clip.mkv"), "w") as out:
        stream = out.add_stream("mpeg4", rate=RATE)
        stream.width = stream.height = SIZE
        for i in range(4):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(picture(i), format="rgb24")))
        out.mux(stream.encode())
    data = (tmp_path / "clip.mkv").read_bytes()
    assert data.count(b"V_MPEG4/ISO/ASP") == 1
    (tmp_path / "unknown.mkv").write_bytes(data.replace(b"V_MPEG4/ISO/ASP", b"V_ZZZZZ/ISO/ASP"))
    assert load_video(tmp_path / "clip.mkv", 2).sampling["sampled"] == 2
    with pytest.raises(VideoError, match="its video codec has no decoder in PyAV's FFmpeg: re-encode it"):
        load_video(tmp_path / "unknown.mkv", 2)


def test_a_file_cut_after_its_header_is_an_error(tmp_path):
    """An MP4 with its index first (faststart) opens when cut; its frames end early."""
    with av.open(str(tmp_path / "fast.mp4"), "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream("mpeg4", rate=RATE)
        stream.width = stream.height = SIZE
        for i in range(COUNT):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(picture(i), format="rgb24")))
        out.mux(stream.encode())
    data = (tmp_path / "fast.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[:len(data) * 3 // 4])
    assert load_video(tmp_path / "fast.mp4", 4).sampling["sampled"] == 4
    with pytest.raises(VideoError, match="frames end at .* a truncated or corrupt file"):
        load_video(tmp_path / "cut.mp4", 4)
