"""Packaging: the ops/ folder installs under our own name (ds_xc_ops), every package folder is
in pyproject.toml's list, nothing imports the folder name `ops`, and the wheel holds what the
JIT builders need (.ci/run also installs that wheel into a fresh venv and imports it)."""
import ast
import hashlib
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)


def test_every_package_folder_is_listed():
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ds_xc").rglob("__init__.py")}
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    assert listed == found | {"ds_xc_ops"}, (sorted(found - listed), sorted(listed - found - {"ds_xc_ops"}))
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"ds_xc_ops": "ops"}


def test_nothing_imports_the_folder_name_ops():
    bad = []
    for folder in ("ds_xc", "ops", "launch", "benchmarks", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else []:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "ops"]
    assert not bad, bad


def test_builders_name_their_ops_under_ds_xc_ops():
    from ds_xc_ops.builders import BUILDERS
    assert {b().absolute_name() for b in BUILDERS.values()} == {
        "ds_xc_ops.ds_xc_hamming_cpu_op", "ds_xc_ops.ds_xc_hamming_cuda_op", "ds_xc_ops.ds_xc_rows_cpu_op",
        "ds_xc_ops.ds_xc_softmax_cpu_op", "ds_xc_ops.ds_xc_select_cpu_op"}


def test_cpu_builders_hash_every_header_they_include():
    """torch's JIT cache hashes sources and flags, not included headers: each CPU builder's flags carry the
    content hash of every ops/csrc header its sources include, so editing one rebuilds the op."""
    from ds_xc_ops.builders import BUILDERS, CSRC
    for kind in ("cpu", "rows", "softmax", "select"):
        builder = BUILDERS[kind]()
        text = "".join(open(src).read() for src in builder.sources())
        included = set(re.findall(r'#include "([^"]+)"', text))
        assert "cpu_simd.h" in included, kind
        for name in included:
            sha = hashlib.sha1(open(os.path.join(CSRC, name), "rb").read()).hexdigest()[:16]
            assert any(f.endswith("_SHA=" + sha) for f in builder.cxx_args()), (kind, name)


def test_prebuild_covers_every_cpu_op(monkeypatch):
    """``python -m ds_xc_ops.build`` with no arguments builds every CPU op (the first training step would
    otherwise compile the ones it left out) and the CUDA op only where CUDA is available."""
    from ds_xc_ops import build, builders
    assert set(build.CPU_KINDS) == set(builders.BUILDERS) - {"cuda"}
    asked = []
    monkeypatch.setattr(builders, "load_op", lambda kind, verbose=False: asked.append(kind) or None)
    monkeypatch.setattr(build.torch.cuda, "is_available", lambda: False)
    assert build.main([]) == 1  # every op "failed" (load_op returned None)
    assert asked == build.CPU_KINDS


@pytest.mark.slow
def test_wheel_holds_ds_xc_ops_and_the_kernel_sources(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel, = tmp_path.glob("ds_xc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"ds_xc", "ds_xc_ops"}, tops
    for need in ("ds_xc_ops/hamming.py", "ds_xc_ops/triton_softmax_kernels.py", "ds_xc/head/triton_softmax.py", "ds_xc_ops/csrc/hamming_cpu.cpp",
                 "ds_xc_ops/csrc/hamming_cuda.cu", "ds_xc_ops/csrc/rows_cpu.cpp", "ds_xc_ops/rows.py",
                 "ds_xc_ops/csrc/softmax_cpu.cpp", "ds_xc_ops/softmax_rows.py", "ds_xc_ops/csrc/select_cpu.cpp", "ds_xc/engine/core.py", "ds_xc/sampling/ann/index.py"):
        assert need in names, need


def test_library_never_prints():
    """ds_xc/ and ops/ log through logging; only launch/ (and benchmarks) print."""
    calls = []
    for folder in ("ds_xc", "ops"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                    calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not calls, calls
