"""Triton compiles its GPU kernel launcher as a CPython extension with
triton.runtime.build._build before the first launch. Compile and import a
small extension through that same function, so a runtime without usable
Python headers is caught on a machine with no GPU."""

import importlib.util
import inspect
import os
import shutil

import pytest

from kernels_py.runtime.worker import python_headers

SOURCE = r"""
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "vlkv_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_vlkv_probe(void) { return PyModule_Create(&module); }
"""


def test_triton_can_build_a_launcher_extension(tmp_path):
    if not python_headers()["present"]:
        if os.environ.get("VLKV_REQUIRE_PYTHON_HEADERS") == "1":
            pytest.fail(f"Python.h is missing from {python_headers()['include']}")
        pytest.skip("this interpreter has no Python headers")
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler on PATH")
    from triton.runtime.build import _build

    src = tmp_path / "probe.c"
    src.write_text(SOURCE)
    args = ["vlkv_probe", str(src), str(tmp_path), [], [], []]
    if "ccflags" in inspect.signature(_build).parameters:  # added in Triton 3.5
        args.append([])
    so = _build(*args)
    spec = importlib.util.spec_from_file_location("vlkv_probe", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.answer() == 42
