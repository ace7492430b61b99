"""Sizes of the house: one concept per file with a hard cap of 800 lines (the developers' guide; it was
450 under issue 15), no function over 80.

Parsed with ast, nothing is imported. A module that grows past the limit is split by
concept (docs/design.md, "floors of the house"), not trimmed of its docstrings.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FILE_LINES, MAX_FUNCTION_LINES = 800, 80


def _modules():
    for folder, dirs, files in os.walk(os.path.join(ROOT, "ds_xc")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def test_no_module_over_limit():
    long = {}
    for path in _modules():
        with open(path, encoding="utf-8") as fh:
            n = sum(1 for _ in fh)
        if n > MAX_FILE_LINES:
            long[os.path.relpath(path, ROOT)] = n
    assert not long, f"modules over {MAX_FILE_LINES} lines (split them by concept): {long}"


def test_no_function_over_limit():
    long = {}
    for path in _modules():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_limits_can_fail(tmp_path):
    """The checks count what they claim: a synthetic long function is seen as long."""
    src = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    node = ast.parse(src).body[0]
    assert node.end_lineno - node.lineno + 1 == MAX_FUNCTION_LINES + 1
