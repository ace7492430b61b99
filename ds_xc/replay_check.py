"""Checking on the CPU that a step could be replayed as a CUDA graph.

A CUDA graph replays the kernels it captured, with the arguments they were captured with, on the memory
they were captured with. A step can be captured and replayed only if every later step launches the same
kernels, with the same non-tensor arguments (a learning rate or a step count passed as a Python number is
baked in), reading and writing the same persistent tensors (a buffer replaced between steps is read at its
old address) and doing nothing on the host that the step needs (a replay runs no Python).

:class:`ReplayRecorder` records, per aten op of a step: its name, its non-tensor arguments, and each tensor
argument as either "made in this step" (a new storage some op of the step returned: a graph's private
memory, where does not matter) or "persistent, at this address" (made before the step: the graph reads and
writes it there), with its shape, dtype and device. Two steps whose records are equal launch what one captured graph would replay; the first
difference says why not (tests/test_graphs.py holds the head's captured step to this). Tensors that live on
the host by design (a CPU step counter torch keeps, :func:`ds_xc.host_syncs.host_side`) are left out: their
ops run on the host, not in the graph.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ds_xc.host_syncs import is_host_side

__all__ = ["ReplayRecorder", "first_difference"]


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storage_ptrs(t: torch.Tensor) -> list:
    """The storage addresses behind a tensor (a sparse one: its indices' and values')."""
    if t.is_sparse:
        return [_storage_ptr(t._indices()), _storage_ptr(t._values())]
    return [_storage_ptr(t)]


class ReplayRecorder(TorchDispatchMode):
    """Records the ops of a step as a CUDA graph would capture them (module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self._fresh: set = set()  # storage addresses an op of this step returned new (not one of its inputs')

    def _describe(self, value: Any):
        if isinstance(value, torch.Tensor):
            if value.is_sparse:
                return ("sparse", self._describe(value._indices()), self._describe(value._values()))
            ptr = _storage_ptr(value)
            where = ("made",) if ptr in self._fresh else ("persistent", ptr)
            return where + (tuple(value.shape), value.dtype, value.device.type)
        if isinstance(value, torch.Generator):  # its Python object is made anew per call: the device only
            return ("generator", value.device.type)
        if isinstance(value, torch.ScriptObject):  # a profiler's record-function handle
            return ("object", type(value).__name__)
        if isinstance(value, float) and value != value:
            return "nan"
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if tensors and all(is_host_side(t) for t in tensors):
            return out  # host work by design: not in a graph
        self.ops.append((str(func), tuple(self._describe(v) for v in flat)))
        inputs = {p for t in tensors for p in _storage_ptrs(t)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._fresh.update(p for p in _storage_ptrs(t) if p not in inputs)
        return out


def first_difference(a: list, b: list) -> str | None:
    """None when two records launch the same graph, else the first difference, in words."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {i}: {x[0]} differs between the steps:\n  {x}\n  {y}"
    if len(a) != len(b):
        longer = a if len(a) > len(b) else b
        return f"the steps launch {len(a)} and {len(b)} ops; from op {min(len(a), len(b))}: {longer[min(len(a), len(b))][0]}"
    return None
