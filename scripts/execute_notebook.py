"""Execute a notebook headless, in place of a person pressing "Run all", so
CI proves the result files it reads are readable. Usage:

    workbench python -- scripts/execute_notebook.py NOTEBOOK [OUTPUT]

The notebook runs with its own directory as the working directory; the
executed copy (with outputs) is written to OUTPUT if given.
"""

import pathlib
import sys

import nbformat
from nbclient import NotebookClient


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    path = pathlib.Path(argv[1])
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent.resolve())}}).execute()
    if len(argv) == 3:
        nbformat.write(nb, argv[2])
    print(f"executed {path}: {len(nb.cells)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
