"""Agreement across the ranks of a group before a collective API runs.

A collective that starts with different arguments on different ranks (another checkpoint
tag, another ``k``, one more held-out batch, a file missing on one rank) either crashes in
a confusing place or hangs until the process-group timeout. The two helpers here turn that
into an error raised on every rank that names the ranks and their values:

``agree(value, what, group)``
    Every rank passes the value it is about to act on (small plain data: numbers, strings,
    tuples, lists, dicts). One all-gather of a 64-bit fingerprint per call; only when the
    fingerprints differ are the values themselves gathered, for the message. Raises
    :class:`DisagreementError` on every rank, e.g.
    ``ranks disagree on the checkpoint tag: rank 0: 'step3', rank 1: 'step4'``.

``all_or_none(what, group)``
    A ``with`` block that every rank runs (reading its own checkpoint files, say). Its
    outcome is agreed afterwards with one scalar all-reduce: when any rank raised, every
    rank raises. The rank at fault re-raises its own exception (with a note naming the
    failed ranks); the others raise the same exception class (when it is a builtin or a
    ds_xc one, else RuntimeError) naming the ranks at fault and their messages, so no rank
    continues alone and nobody waits in a later collective.

Both take the group explicitly (``None`` is the default group, as everywhere in ds_xc) and
return at once without communicating when the group has one rank. Ranks are named by their
global rank.
"""
from __future__ import annotations

import builtins
import contextlib
import hashlib
import importlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ds_xc.parallel.collectives import gather_flat
from ds_xc.parallel.groups import comm_device, group_rank, group_ranks, group_size, is_distributed, resolve_group

__all__ = ["agree", "all_or_none", "agree_outcome", "DisagreementError", "fingerprint"]

_MAX_SHOWN = 200  # characters of one rank's value in a message


class DisagreementError(ValueError):
    """Ranks of a group hold different values where they must agree.

    ``values`` maps each global rank to its value; the message lists them."""

    def __init__(self, message: str, values: Optional[dict] = None):
        super().__init__(message)
        self.values = dict(values or {})


def _canonical(value: Any) -> Any:
    """A form of ``value`` whose repr does not depend on dict insertion order (for fingerprints)."""
    if isinstance(value, dict):
        return ("dict", sorted((repr(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_canonical(v) for v in value])
    if isinstance(value, (set, frozenset)):
        return ("set", sorted(repr(_canonical(v)) for v in value))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if " at 0x" in repr(value):  # a default object repr holds an address, different in every process
        return ("object", type(value).__module__, type(value).__qualname__)
    return value


def fingerprint(value: Any) -> int:
    """A signed 64-bit hash of ``value`` (stable across processes; dict order does not matter)."""
    digest = hashlib.sha256(repr(_canonical(value)).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _global_ranks(group) -> list[int]:
    return group_ranks(group)


def _gather_objects(obj: Any, group) -> list:
    out: list = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "...'"


def _flat(value: Any, prefix: str = "") -> dict:
    """{"a.b": leaf} for nested dicts (to name the keys that differ)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out = {}
    for k, v in value.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _describe(values: dict) -> str:
    """rank -> value, or for dicts the keys that differ with each rank's value."""
    if all(isinstance(v, dict) for v in values.values()):
        flats = {r: _flat(v) for r, v in values.items()}
        keys = sorted(set().union(*flats.values()))
        missing = object()
        parts = []
        for key in keys:
            per_rank = {r: f.get(key, missing) for r, f in flats.items()}
            if len({fingerprint(v) if v is not missing else None for v in per_rank.values()}) > 1:
                shown = ", ".join(f"rank {r}: {'(absent)' if v is missing else _show(v)}" for r, v in per_rank.items())
                parts.append(f"{key} ({shown})")
        if parts:
            return "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more keys" if len(parts) > 8 else "")
    return ", ".join(f"rank {r}: {_show(v)}" for r, v in values.items())


def agree(value: Any, what: str, group) -> Any:
    """Return ``value`` when every rank of ``group`` passed an equal one; else raise on every rank.

    ``what`` names the argument or key in the message (e.g. ``"the checkpoint tag
    (save_checkpoint tag=)"``). One all-gather of an int64 per call, plus an object gather
    only when the values differ.
    """
    group = resolve_group(group)  # None: the world, named explicitly from here on
    if not is_distributed(group):
        return value
    mine = torch.tensor([fingerprint(value)], dtype=torch.int64, device=comm_device(group))
    prints = torch.empty(group_size(group), dtype=torch.int64, device=mine.device)
    gather_flat(prints, mine, group=group)
    if bool((prints == prints[0]).all()):
        return value
    values = dict(zip(_global_ranks(group), _gather_objects(value, group)))
    me = _global_ranks(group)[group_rank(group)]
    raise DisagreementError(f"ranks disagree on {what}: {_describe(values)}; every rank of the group must pass "
                            f"the same value (this is rank {me}; nothing was run)", values)


def _exception_class(module: str, name: str) -> type:
    """The class a peer raised, when it is a builtin or a ds_xc exception; else RuntimeError."""
    try:
        if module == "builtins":
            cls = getattr(builtins, name)
        elif module == "ds_xc" or module.startswith("ds_xc."):
            cls = importlib.import_module(module)
            for part in name.split("."):
                cls = getattr(cls, part)
        else:
            return RuntimeError
    except (AttributeError, ImportError):
        return RuntimeError
    return cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError


def agree_outcome(error: Optional[BaseException], what: str, group) -> None:
    """Raise on every rank of ``group`` when any rank's ``error`` is not None (see module doc).

    One scalar all-reduce when every rank succeeded; the messages are gathered only on failure.
    """
    group = resolve_group(group)  # None: the world, named explicitly from here on
    if not is_distributed(group):
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return
    report = None if error is None else (type(error).__module__, type(error).__qualname__,
                                         str(error).strip().splitlines()[0][:500] if str(error).strip() else "")
    reports = dict(zip(_global_ranks(group), _gather_objects(report, group)))
    failed = {r: rep for r, rep in reports.items() if rep is not None}
    listing = "; ".join(f"rank {r}: {rep[1]}: {rep[2]}" for r, rep in failed.items())
    if error is not None:
        if hasattr(error, "add_note"):
            error.add_note(f"{what} failed on rank(s) {sorted(failed)} of the group; every rank raised")
        raise error
    me = _global_ranks(group)[group_rank(group)]
    first = next(iter(failed.values()))
    cls = _exception_class(first[0], first[1]) if all(rep[:2] == first[:2] for rep in failed.values()) \
        else RuntimeError
    text = (f"{what} failed on rank(s) {sorted(failed)}: {listing} (this is rank {me}, which raises too so "
            "that no rank continues alone)")
    try:
        exc = cls(text)
    except Exception:
        exc = RuntimeError(text)
    exc.failed_ranks = failed
    raise exc


@contextlib.contextmanager
def all_or_none(what: str, group) -> Iterator[None]:
    """Run the block on every rank of ``group``; if it raises on any rank, raise on every rank.

    Exceptions (``Exception`` subclasses) are caught, the outcome is agreed with
    :func:`agree_outcome`, and then raised. KeyboardInterrupt and SystemExit pass through.
    """
    error = None
    try:
        yield
    except Exception as exc:  # agreed below, then raised on every rank
        error = exc
    agree_outcome(error, what, group)
