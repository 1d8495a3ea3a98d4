"""Execute a notebook headless, in place of a person pressing "Run all", so
CI proves the result files it reads are readable. Usage:

    workbench python -- scripts/execute_notebook.py NOTEBOOK [OUTPUT]

The notebook runs with its own directory as the working directory; the
executed copy (with outputs) is written to OUTPUT if given, with an HTML
copy beside it. `workbench notebook NAME RUN_DIR...` does the same for a
researcher, writing both beside the run.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from kernels_py import notebooks  # noqa: E402


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    path = pathlib.Path(argv[1])
    nb = notebooks.execute(path)
    if len(argv) == 3:
        notebooks.write(nb, argv[2], path.stem)
    print(f"executed {path}: {len(nb.cells)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
