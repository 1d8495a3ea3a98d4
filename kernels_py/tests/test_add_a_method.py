"""The README's "Add a method" is true: its example file, dropped into a copy
of kernels_py with its one registry line and no other change, is a method the
registry, the schema and the ablation job all know, built only from parts
that exist."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_py.methods.base import Method
from kernels_py.workloads.base import WorkloadConfig

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> tuple[str, str, str]:
    """(path, file text, registry line) from the README's Add a method section."""
    section = ROOT.joinpath("README.md").read_text().split("### Add a method", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the section should show the method file and its registry line"
    path = blocks[0].splitlines()[0].removeprefix("# ").strip()
    registry_line = [line for line in blocks[1].splitlines() if not line.startswith("#")][0]
    return path, blocks[0], registry_line


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def test_the_readme_method_runs_from_one_file_and_one_line(tmp_path):
    path, text, registry_line = readme_example()
    assert path == "kernels_py/methods/h2o_sparsity.py"
    root = tmp_path / "root"
    shutil.copytree(ROOT / "kernels_py", root / "kernels_py", ignore=shutil.ignore_patterns("__pycache__", "tests"))
    before = digests(root)
    (root / path).write_text(text)
    registry = root / "kernels_py" / "methods" / "__init__.py"
    source = registry.read_text()
    end = "), Method)"  # the tuple of names closes here: the new line goes last
    assert source.count(end) == 1
    registry.write_text(source.replace(end, registry_line + "\n" + end))
    changed = {k for k, v in digests(root).items() if before.get(k) != v}
    assert changed == {path, "kernels_py/methods/__init__.py"}

    script = """
import json
from kernels_py import ablation, schema
from kernels_py.methods import METHODS, make_method
workload = {"layers": 3, "heads": 4, "kv_heads": 2, "tokens_per_image": 64, "text_tokens": 16,
            "decode_steps": 3, "salient_tokens": 8, "system_tokens": 8}
method = make_method("h2o_sparsity", {"budget": 0.25})
result = ablation.run("h2o_sparsity", {"budget": 0.25}, workload)
print(json.dumps({"registered": list(METHODS), "schema": schema.document()["methods"]["h2o_sparsity"],
                  "metrics": result["metrics"], "per_layer": result["per_layer"]}))
"""
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["registered"][-1] == "h2o_sparsity"
    knobs = report["schema"]["params"]
    assert set(knobs) == {"attention", "budget", "evict_while_decoding", "recent_fraction", "backend", "kv_dtype",
                          "fp8_scale"} \
        and knobs["budget"]["ref"] == "VL-Cache Algorithm 1"
    # Sparsity-guided budgets differ per layer (the first two layers are dense) and average to the budget.
    budgets = report["per_layer"]["layer_budget"]
    assert len(set(budgets)) > 1 and abs(sum(budgets) / len(budgets) - 0.25) < 0.02
    assert report["metrics"]["compression_ratio"] > 1 and 0 < report["metrics"]["rel_err_mean"] < 1


def readme_section(title: str) -> str:
    return ROOT.joinpath("README.md").read_text().split(f"### {title}\n", 1)[1].split("\n## ", 1)[0] \
        .split("\n### ", 1)[0]


@pytest.mark.parametrize("title, base", [("Add a method", Method), ("Add a workload", WorkloadConfig)])
def test_the_readme_names_every_class_attribute_a_new_one_sets(title, base):
    """Each class attribute the base declares for its subclasses (a
    ClassVar: what the schema, `workbench methods` and `plan` read besides
    the knobs) is named in the README's section, in code: a new method or
    workload that leaves one out is listed, planned or tested otherwise
    than its author meant."""
    declared = {name for klass in base.__mro__ for name, annotation in vars(klass).get("__annotations__", {}).items()
                if "ClassVar" in str(annotation)}
    assert declared >= {"name", "RULES"}
    text = readme_section(title)
    missing = sorted(name for name in declared if not re.search(rf"`{name}\b|^\s+{name} = ", text, re.M))
    assert not missing, f"README's {title!r} does not name {missing}"
