"""The datasets of the tiny lmms-eval tasks (fixtures/lmms_tasks/): for
tiny_shapes, pictures of a red or blue square at a few places, with a
question (three of different lengths) and its answer; for tiny_videos,
videos of such a square going round the corners. Written as parquet where a
downloaded hub dataset would be (DATA/<hub id>/data/test-*.parquet)."""

import io
from pathlib import Path

TASKS = Path(__file__).parent / "fixtures" / "lmms_tasks"
HUB_ID = "vlkv-tests/tiny-shapes"
COLORS = {"red": (220, 30, 30), "blue": (30, 30, 220)}
# Of different lengths, so that a batch of prompts is padded.
QUESTIONS = ("what is in the picture ?", "describe the picture ?", "what is in the picture : a red or a blue ?")


def picture(color: str, corner: int, size: int = 40) -> bytes:
    """A PNG of a square of `color` in one of four corners."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    x, y = (corner % 2) * size // 2, (corner // 2) * size // 2
    ImageDraw.Draw(image).rectangle([x + 2, y + 2, x + size // 2 - 3, y + size // 2 - 3], fill=COLORS[color])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def save_tiny_shapes(data: Path, documents: int = 12) -> Path:
    """Write the task's test split under data/<hub id>/ and return `data`."""
    from datasets import Dataset, Image

    rows = {"question_id": [], "image": [], "question": [], "answer": []}
    for i in range(documents):
        color = sorted(COLORS)[i % 2]
        rows["question_id"].append(i)
        rows["image"].append({"bytes": picture(color, i % 4), "path": None})
        rows["question"].append(QUESTIONS[i % len(QUESTIONS)])
        rows["answer"].append(color)
    table = Dataset.from_dict(rows).cast_column("image", Image())
    out = data / HUB_ID / "data"
    out.mkdir(parents=True, exist_ok=True)
    table.to_parquet(str(out / "test-00000-of-00001.parquet"))
    return data


VIDEO_HUB_ID = "vlkv-tests/tiny-videos"
VIDEO_FRAMES, VIDEO_RATE = 12, 6  # two seconds


def save_tiny_videos(data: Path, documents: int = 4) -> Path:
    """Write the tiny video task's test split under data/<hub id>/ and return
    `data`: each document's video, a square of its color going round the
    corners, is an MP4 (even documents) or a directory of PNG frames (odd),
    and the dataset holds its path, as Video-MME's documents lead to theirs."""
    import av
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    root = data / VIDEO_HUB_ID
    rows = {"question_id": [], "video": [], "question": [], "answer": []}
    for i in range(documents):
        color = sorted(COLORS)[i % 2]
        frames = [np.asarray(Image.open(io.BytesIO(picture(color, (i + f) % 4))).convert("RGB"))
                  for f in range(VIDEO_FRAMES)]
        if i % 2 == 0:
            path = root / "videos" / f"{i}.mp4"
            path.parent.mkdir(parents=True, exist_ok=True)
            with av.open(str(path), "w") as out:
                stream = out.add_stream("mpeg4", rate=VIDEO_RATE)
                stream.width, stream.height = frames[0].shape[1], frames[0].shape[0]
                for frame in frames:
                    out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
                out.mux(stream.encode())
        else:
            path = root / "frames" / str(i)
            path.mkdir(parents=True, exist_ok=True)
            for f, frame in enumerate(frames):
                Image.fromarray(frame).save(path / f"{f:03d}.png")
        rows["question_id"].append(i)
        rows["video"].append(str(path.resolve()))
        rows["question"].append("what color is the square in the video ?")
        rows["answer"].append(color)
    out = root / "data"
    out.mkdir(parents=True, exist_ok=True)
    Dataset.from_dict(rows).to_parquet(str(out / "test-00000-of-00001.parquet"))
    return data
