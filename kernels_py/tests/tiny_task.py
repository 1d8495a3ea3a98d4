"""The dataset of the tiny lmms-eval task (fixtures/lmms_tasks/tiny_shapes.yaml):
pictures of a red or blue square at a few places, with a question (three
of different lengths) and its answer, written as parquet where a downloaded hub dataset would be
(DATA/<hub id>/data/test-*.parquet)."""

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
