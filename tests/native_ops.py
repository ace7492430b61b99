"""Helpers of the native-op tests: the built op (or a skip), and a call of it in a fresh process with
some environment variables set (the ops read their SIMD switches once per process)."""
import os
import subprocess
import sys

import pytest
import torch

from ds_xc_ops import builders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def built_op(kind: str):
    """``builders.load_op(kind)``, or skip the test where the op does not build."""
    op = builders.load_op(kind)
    if op is None:
        pytest.skip(f"the {kind} op does not build here")
    return op


def call_in_process(kind: str, env: dict, expr: str, args, tmp_path):
    """``expr`` evaluated in a new Python process with ``env`` added to the environment, where ``op`` is
    the built ``kind`` op and ``a`` the (saved and reloaded) ``args``; returns its (saved) value."""
    torch.save(args, tmp_path / "in.pt")
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from ds_xc_ops import builders; "
            f"op = builders.load_op({kind!r}); a = torch.load(sys.argv[2]); torch.save({expr}, sys.argv[3])")
    subprocess.run([sys.executable, "-c", code, ROOT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env=dict(os.environ, **env), check=True, timeout=600)
    return torch.load(tmp_path / "out.pt")
