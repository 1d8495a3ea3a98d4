"""Execute a notebook of notebooks/ against run directories and write it
with its outputs, as .ipynb and as one self-contained HTML page (plots
inline): what `workbench notebook NAME RUN_DIR...` runs, and what CI runs on
every notebook (scripts/execute_notebook.py).

The HTML is written here rather than by nbconvert, which the runtime does
not carry: a notebook's outputs are text, PNG/SVG plots and pandas' HTML
tables, which need no more than this.
"""

import base64
import html
import os
import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def names() -> list[str]:
    """The notebooks of notebooks/, by name (compare for compare.ipynb)."""
    return sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))


def find(name: str) -> Path:
    """notebooks/NAME.ipynb, or a path to a notebook."""
    path = Path(name)
    if path.suffix == ".ipynb" and path.exists():
        return path
    path = NOTEBOOKS / f"{name.removesuffix('.ipynb')}.ipynb"
    if not path.exists():
        raise FileNotFoundError(f"no notebook {name!r}: notebooks/ has {', '.join(names())}")
    return path


def run_env(runs: list[str]) -> dict[str, str]:
    """The environment a notebook reads its runs from: VLKV_RUN_DIR (one
    run) and VLKV_RUN_DIRS (all, A first, separated by os.pathsep)."""
    runs = [str(Path(r).resolve()) for r in runs]
    return {"VLKV_RUN_DIR": runs[-1], "VLKV_RUN_DIRS": os.pathsep.join(runs)} if runs else {}


def execute(notebook: str | os.PathLike, env: dict[str, str] | None = None, timeout: int = 600):
    """Run every cell, as "Run all" would, in a kernel whose working
    directory is the notebook's and whose environment adds `env`; returns
    the notebook with its outputs. A cell that raises raises here
    (nbclient's CellExecutionError names the cell)."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(notebook)
    nb = nbformat.read(path, as_version=4)
    kernel_env = {**os.environ, **(env or {})}
    # The kernel imports kernels_py from the kernels root, wherever it runs.
    root = str(Path(__file__).resolve().parents[1])
    kernel_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, kernel_env.get("PYTHONPATH")) if p)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    try:
        client.execute(env=kernel_env)
    except Exception as err:  # the cells run so far, with the failing one's error, are worth writing
        err.notebook = nb
        raise
    return nb


def write(nb, ipynb: str | os.PathLike, title: str) -> Path:
    """Write the executed notebook and its HTML copy (same name, .html) beside it; returns the HTML's path."""
    import nbformat

    ipynb = Path(ipynb)
    nbformat.write(nb, ipynb)
    page = ipynb.with_suffix(".html")
    page.write_text(to_html(nb, title))
    return page


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _markdown(source: str) -> str:
    try:
        from markdown_it import MarkdownIt
    except ImportError:  # the page still reads
        return f"<pre class=md>{html.escape(source)}</pre>"
    return MarkdownIt("commonmark").enable("table").render(source)


def _output(out: dict) -> str:
    kind = out.get("output_type")
    if kind == "stream":
        cls = "stderr" if out.get("name") == "stderr" else "stdout"
        return f"<pre class={cls}>{html.escape(_text(out.get('text', '')))}</pre>"
    if kind == "error":
        trace = _ANSI.sub("", "\n".join(out.get("traceback") or [f"{out.get('ename')}: {out.get('evalue')}"]))
        return f"<pre class=error>{html.escape(trace)}</pre>"
    data = out.get("data", {})
    if "image/png" in data:
        png = _text(data["image/png"]).replace("\n", "")
        base64.b64decode(png, validate=True)  # a broken image is an error, not a blank
        return f'<img src="data:image/png;base64,{png}">'
    if "image/svg+xml" in data:
        return _text(data["image/svg+xml"])
    if "text/html" in data:
        return f"<div class=html>{_text(data['text/html'])}</div>"
    if "text/plain" in data:
        return f"<pre>{html.escape(_text(data['text/plain']))}</pre>"
    return ""


_STYLE = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.4}
pre{background:#f6f8fa;padding:.6em;overflow-x:auto;font-size:90%}
pre.code{border-left:3px solid #9ab}pre.stderr{background:#fff6e0}pre.error{background:#fde8e8}
img{max-width:100%}table{border-collapse:collapse;font-size:85%}td,th{border:1px solid #ccc;padding:.2em .5em}
.html{overflow-x:auto}"""


def to_html(nb, title: str) -> str:
    """One self-contained page: markdown rendered, code, then its outputs (plots as inline PNG)."""
    parts = [f"<!DOCTYPE html><html><head><meta charset=utf-8><title>{html.escape(title)}</title>"
             f"<style>{_STYLE}</style></head><body>"]
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            parts.append(_markdown(_text(cell.source)))
        elif cell.cell_type == "code":
            parts.append(f"<pre class=code>{html.escape(_text(cell.source))}</pre>")
            parts.extend(_output(out) for out in cell.get("outputs", []))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    """python -m kernels_py.notebooks NOTEBOOK OUT.ipynb RUN_DIR...: what
    `workbench notebook` runs. Writes OUT.ipynb and OUT.html, also when a
    cell fails (then up to that cell, and exits 1)."""
    import sys

    from nbclient.exceptions import CellExecutionError

    notebook, out, runs = Path(argv[0]), Path(argv[1]), argv[2:]
    failed = None
    try:  # the notebook's figures go beside what it writes, not into the runs it reads
        nb = execute(notebook, env={**run_env(runs), "VLKV_FIGURES_DIR": str(out.parent.resolve())})
    except CellExecutionError as err:
        nb, failed = err.notebook, err
    page = write(nb, out, f"{notebook.stem}: {', '.join(Path(r).name for r in runs)}")
    if failed is not None:
        print(f"{notebook.stem}: a cell failed: {failed.ename}: {failed.evalue}\n"
              f"the notebook up to that cell, with the error: {page}", file=sys.stderr)
        return 1
    print(f"wrote {out}\nwrote {page}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
