"""Counting, on the CPU, what makes a GPU step wait for the host and how many kernels it launches.

A training step on a GPU is host-bound when the GPU waits for Python: every read of a device value
(``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``), every op whose output size
depends on the data (``nonzero``, ``unique``, boolean-mask indexing, ...) and every blocking copy of
host data to the device drains the GPU's queue, and every op costs a launch of host time whatever
its size (docs/head.md, "The GPU step"). None of this needs a GPU to be seen: a
:class:`torch.utils._python_dispatch.TorchDispatchMode` sees every aten op of a step on CPU tensors
too, so :class:`StepCounter` counts them there. The counts predict the GPU step (the H200 profile
of benchmarks/results/gpu_check_run3.md found 16 syncs where this counter found 14) and are
budgeted in CI (tests/test_step_counts.py) and reported beside a Partial-FC-equivalent step
(benchmarks/step_counts.py).

What counts as a host sync (``kind``):

- ``item``: ``aten._local_scalar_dense`` (``.item()``, ``int()``, ``float()``, ``bool()``, ``if t:``);
- ``dynamic``: ops whose output shape depends on values: ``nonzero``, the ``unique`` family,
  ``masked_select``, indexing or index assignment with a boolean mask, ``repeat_interleave``
  without ``output_size``, ``bincount``, a sparse tensor's ``coalesce``;
- ``host_read``: ``Tensor.tolist``, ``Tensor.cpu``, ``Tensor.numpy`` (they do not dispatch on CPU
  tensors, so they are wrapped while counting);
- ``host_data``: a tensor made from Python data (``torch.tensor([...])``, ``aten.lift_fresh``): on a
  GPU a blocking host-to-device copy, which waits for the stream.

Every other op that is neither a view, an allocation nor a metadata op counts as one launch. One blind
spot: under a dispatch mode torch's gradient accumulation keeps a sparse gradient's coalesced mark, which
an ordinary step drops (a coalesce would then follow); tests/test_step_counts.py checks that case in
ordinary steps. A
CPU-only native kernel called through pybind is invisible except for the aten ops it calls; the
benchmark and the test count with the CPU kernels that replace PyTorch code off (``native_off``),
so that the counted code is the code a GPU runs.
"""
from __future__ import annotations

import collections
import contextlib
import os
from unittest import mock
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["StepCounter", "StepCounts", "count_steps", "native_off", "host_side", "is_host_side"]

_HOST_SIDE = WeakIdKeyDictionary()  # tensors marked by host_side (by identity, not by value)


def host_side(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a tensor that lives on the host in every run (a CPU step counter beside CUDA
    weights, as torch's optimizers keep it): reading it is no host sync, and its ops are host work."""
    _HOST_SIDE[t] = True
    return t


def is_host_side(t: torch.Tensor) -> bool:
    return t in _HOST_SIDE

_ITEM = {"_local_scalar_dense"}
_DYNAMIC = {"nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
            "masked_select", "bincount", "argwhere", "coalesce", "_coalesce"}  # a sparse coalesce: sort + unique
_FREE = {"detach", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "size",
         "stride", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "alias", "is_same_size",
         "_has_compatible_shallow_copy_type", "is_coalesced", "_indices", "_values", "indices", "values",
         "sparse_dim", "dense_dim", "_nnz", "_coalesced_", "record_stream", "resize_",
         "scalar_tensor",  # a Python number wrapped as a CPU scalar: kernel arguments, not a launch
         "_record_function_enter_new", "_record_function_exit"}  # profiler markers
_HOST_DATA = {"lift_fresh"}
# CPU-only paths that stand in for the code a GPU runs: C++ kernels replacing PyTorch code, and the ANN
# index's safe-radius tracking (data-dependent sizes that pay on a CPU only)
_NATIVE_ENVS = ("DS_XC_NATIVE_ROWS", "DS_XC_NATIVE_SOFTMAX", "DS_XC_NATIVE_SCORE", "DS_XC_NATIVE_SELECT",
                "DS_XC_ANN_TRACKING")


def _is_bool_index(args) -> bool:
    """Whether an aten.index / index_put call indexes with a boolean (or uint8) mask."""
    indices = args[1] if len(args) > 1 else ()
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def _where(skip: tuple) -> str:
    """The innermost frame of ds_xc / ds_xc_ops code that led here ("file:line (function)")."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace(os.sep, "/")
        if any(s in path for s in skip):
            continue
        if "/ds_xc/" in path or "/ops/" in path or "/ds_xc_ops/" in path:
            short = path[path.rfind("/ds_xc"):] if "/ds_xc" in path else path[path.rfind("/ops/"):]
            return f"{short.lstrip('/')}:{frame.lineno} ({frame.name})"
    return "outside ds_xc"


@dataclass
class StepCounts:
    """What :func:`count_steps` measured, per step (averaged over the counted steps)."""
    steps: int
    syncs: float  # host syncs per step, every kind
    ops: float  # launches per step
    by_kind: dict = field(default_factory=dict)  # kind -> syncs per step
    where: dict = field(default_factory=dict)  # "kind op at file:line" -> count over all counted steps
    top_ops: list = field(default_factory=list)  # [(op, launches per step)], most first

    def describe(self, limit: int = 12) -> str:
        lines = [f"{self.syncs:g} host syncs and {self.ops:g} ops per step (over {self.steps} steps)"]
        lines += [f"  sync {k}: {n}" for k, n in sorted(self.where.items(), key=lambda kv: -kv[1])[:limit]]
        return "\n".join(lines)


class StepCounter(TorchDispatchMode):
    """Counts host syncs (by kind, and where in ds_xc they come from) and launches of the ops run
    inside it. ``where=True`` records the ds_xc frame of every sync (slower: a stack walk each)."""

    def __init__(self, where: bool = True, op_where: bool = False):
        super().__init__()
        self.record_where, self.record_op_where = where, op_where
        self.op_where: collections.Counter = collections.Counter()  # "op at frame" -> launches (op_where)
        self.syncs: collections.Counter = collections.Counter()  # kind -> count
        self.where: collections.Counter = collections.Counter()  # "kind op at frame" -> count
        self.ops: collections.Counter = collections.Counter()  # op name -> launches
        self._patched: list = []

    def _sync(self, kind: str, name: str) -> None:
        self.syncs[kind] += 1
        if self.record_where:
            self.where[f"{kind} {name} at {_where(('host_syncs.py',))}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if args and isinstance(args[0], torch.Tensor) and is_host_side(args[0]):
            return func(*args, **kwargs)  # host work by design (host_side): neither a sync nor a launch
        if name in _ITEM:
            self._sync("item", name)
        elif name in _DYNAMIC:
            self._sync("dynamic", name)
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _is_bool_index(args):
            self._sync("dynamic", f"{name}[bool mask]")
        elif name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
            self._sync("dynamic", "repeat_interleave without output_size")
        elif name in _HOST_DATA:
            self._sync("host_data", "torch.tensor(host data)")
        elif not func.is_view and name not in _FREE:
            self.ops[name] += 1
            if self.record_op_where:
                self.op_where[f"{name} at {_where(('host_syncs.py',))}"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for attr in ("tolist", "cpu", "numpy"):
            original = getattr(torch.Tensor, attr)
            counter = self

            def wrapped(t, *a, _original=original, _attr=attr, **k):
                counter._sync("host_read", f".{_attr}()")
                return _original(t, *a, **k)
            setattr(torch.Tensor, attr, wrapped)
            self._patched.append((attr, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for attr, original in self._patched:
            setattr(torch.Tensor, attr, original)
        self._patched = []
        return super().__exit__(*exc)

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())


@contextlib.contextmanager
def native_off():
    """Turn off the CPU-only paths while counting (the C++ kernels that replace PyTorch code: rows,
    softmax exponentials, scores, selection; the ANN refresh's tracking): a GPU runs the code they
    replace, so that is the code to count."""
    with mock.patch.dict(os.environ, {k: "0" for k in _NATIVE_ENVS}):  # the environment restored after
        yield


def count_steps(step: Callable[[int], None], warmup: int = 3, steps: int = 5, where: bool = True,
                cpu_kernels: bool = False, before: Optional[Callable[[int], None]] = None) -> StepCounts:
    """Run ``step(i)`` ``warmup`` times, then count ``steps`` more; the per-step averages.

    ``before(i)`` runs before each counted step, outside the counter (fresh inputs, say).
    ``cpu_kernels`` False counts with the CPU-only kernels off (:func:`native_off`)."""
    ctx = contextlib.nullcontext() if cpu_kernels else native_off()
    with ctx:
        for i in range(warmup):
            if before is not None:
                before(i)
            step(i)
        counter = StepCounter(where=where)
        for i in range(warmup, warmup + steps):
            if before is not None:
                before(i)
            with counter:
                step(i)
    n = max(steps, 1)
    return StepCounts(steps=steps, syncs=counter.total_syncs / n, ops=counter.total_ops / n,
                      by_kind={k: v / n for k, v in counter.syncs.items()}, where=dict(counter.where),
                      top_ops=[(k, v / n) for k, v in counter.ops.most_common(20)])
