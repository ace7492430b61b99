"""Exported heads: the whole weight matrix in class order, one file or a folder of row blocks.

:func:`load_exported_head` reads either, and :func:`load_exported_into_head` fills a
ClassParallelHead of any world size from it (launch/export.py writes them)::

    head.safetensors | head.pt                     {"weight": (C, d)} and the format tag
    DIR/head.index.json                            format, num_classes, embedding_dim, files
    DIR/head-00000-of-00003.safetensors | .pt      rows [class_start, class_start + num_rows)
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

import torch

from ds_xc.checkpoint.files import CheckpointError, file_sha256, load_file
from ds_xc.parallel.agree import all_or_none

log = logging.getLogger(__name__)

__all__ = ["EXPORT_FORMAT", "EXPORT_INDEX", "read_export_index", "load_exported_head", "exported_head_shape",
           "load_exported_into_head"]

EXPORT_FORMAT = "ds_xc.head/1"
EXPORT_INDEX = "head.index.json"


def read_export_index(path: str) -> dict:
    """The index of a sharded export (``DIR`` or ``DIR/head.index.json``), checked: files cover
    [0, num_classes) in order."""
    path = os.path.join(path, EXPORT_INDEX) if os.path.isdir(path) else path
    try:
        with open(path) as fh:
            index = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read export index {path!r}: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{path!r}: format={index.get('format') if isinstance(index, dict) else None!r}; "
                              f"expected {EXPORT_FORMAT!r}")
    expect = 0
    for entry in index.get("files", []):
        if entry.get("class_start") != expect or not isinstance(entry.get("num_rows"), int) or entry["num_rows"] < 1:
            raise CheckpointError(f"{path!r}: file entry {entry} does not continue the rows at class {expect}")
        expect += entry["num_rows"]
    if expect != index.get("num_classes"):
        raise CheckpointError(f"{path!r}: files cover {expect} rows; num_classes={index.get('num_classes')!r}")
    index["path"] = path
    return index


def _read_export_file(path: str, start: int, count: Optional[int], expect_start: int,
                      expect_rows: Optional[int]) -> torch.Tensor:
    """Rows [start, start + count) (relative to the file; count None: to the end) of one exported
    file, after checking its format, shape and first class."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"exported head file {path!r} does not exist")
    if path.endswith(".safetensors"):
        return _read_safetensors(path, start, count, expect_start, expect_rows)
    state = load_file(path, "exported head file", mmap=True)
    weight = state.get("weight") if isinstance(state, dict) else None
    if not isinstance(state, dict) or state.get("format") != EXPORT_FORMAT or not isinstance(weight, torch.Tensor):
        raise CheckpointError(f"exported head file {path!r} is not a {EXPORT_FORMAT} file "
                              "(expected a dict with format and a 'weight' tensor)")
    count = _check_export_rows(path, tuple(weight.shape), state.get("class_start"), expect_start, expect_rows,
                               start, count)
    return weight[start: start + count].clone()


def _read_safetensors(path, start, count, expect_start, expect_rows):
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError(f"{path!r} is a safetensors file; pip install safetensors to read it") from None
    try:
        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("format") != EXPORT_FORMAT or "weight" not in fh.keys():
                raise CheckpointError(f"exported head file {path!r} is not a {EXPORT_FORMAT} file")
            sl = fh.get_slice("weight")
            count = _check_export_rows(path, tuple(sl.get_shape()), int(meta.get("class_start", -1)),
                                       expect_start, expect_rows, start, count)
            return sl[start: start + count]
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read exported head file {path!r}: {type(exc).__name__}: {exc}") from None


def _check_export_rows(path, shape, class_start, expect_start, expect_rows, start, count) -> int:
    """Check one file's (rows, d) shape and first class; returns the row count to read."""
    if len(shape) != 2 or (expect_rows is not None and shape[0] != expect_rows) or class_start != expect_start:
        raise CheckpointError(f"exported head file {path!r} holds a {tuple(shape)} weight from class {class_start}; "
                              f"expected {expect_rows if expect_rows is not None else 'N'} rows of dim d from "
                              f"class {expect_start}")
    count = shape[0] - start if count is None else count
    if start < 0 or count < 0 or start + count > shape[0]:
        raise ValueError(f"rows [{start}, {start + count}) outside the {shape[0]} rows of {path!r}")
    return count


def load_exported_head(path: str, start: int = 0, count: Optional[int] = None, verify: bool = True) -> torch.Tensor:
    """Weight rows [start, start + count) (default: all) of an exported head, in class order: (count, d).

    ``path`` is a single exported file or a sharded export (its folder or index json).
    ``verify`` checks each shard file read against the sha256 the index records.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"exported head {path!r} does not exist")
    if os.path.isfile(path) and not path.endswith(".json"):
        return _read_export_file(path, start, count, 0, None)
    index = read_export_index(path)
    folder = os.path.dirname(index["path"])
    count = index["num_classes"] - start if count is None else count
    if start < 0 or start + count > index["num_classes"]:
        raise ValueError(f"rows [{start}, {start + count}) outside the {index['num_classes']} classes of {path!r}")
    parts = []
    for entry in index["files"]:
        lo, hi = max(start, entry["class_start"]), min(start + count, entry["class_start"] + entry["num_rows"])
        if lo >= hi:
            continue
        file = os.path.join(folder, os.path.basename(entry["file"]))
        if verify and entry.get("sha256") and os.path.isfile(file) and file_sha256(file) != entry["sha256"]:
            raise CheckpointError(f"exported head file {file!r} does not match the sha256 in {index['path']!r} "
                                  "(changed or damaged after export)")
        parts.append(_read_export_file(file, lo - entry["class_start"], hi - lo, entry["class_start"],
                                       entry["num_rows"]))
    return torch.cat(parts)


def exported_head_shape(path: str) -> tuple[int, int]:
    """(num_classes, embedding_dim) of an exported head (its index, or the one file's header)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"exported head {path!r} does not exist")
    if os.path.isfile(path) and not path.endswith(".json"):
        if path.endswith(".safetensors"):
            try:
                from safetensors import safe_open
                with safe_open(path, framework="pt") as fh:
                    shape = tuple(fh.get_slice("weight").get_shape())
            except Exception as exc:
                raise CheckpointError(f"cannot read exported head file {path!r}: {type(exc).__name__}: {exc}") \
                    from None
        else:
            state = load_file(path, "exported head file", mmap=True)
            weight = state.get("weight") if isinstance(state, dict) else None
            if not isinstance(weight, torch.Tensor):
                raise CheckpointError(f"exported head file {path!r} is not a {EXPORT_FORMAT} file (no 'weight')")
            shape = tuple(weight.shape)
        if len(shape) != 2:
            raise CheckpointError(f"exported head file {path!r} holds a weight of shape {shape}; expected (C, d)")
        return int(shape[0]), int(shape[1])
    index = read_export_index(path)
    return int(index["num_classes"]), int(index.get("embedding_dim", -1))


@torch.no_grad()
def load_exported_into_head(head, path: str, verify: bool = True) -> None:
    """Fill ``head`` (a ClassParallelHead of any world size) with its rows of an exported head.

    Only this rank's class range is read. Collective over ``head.group``: every rank reads and
    checks its rows first (the export's class count and width must be the head's), the ranks
    agree that all succeeded, and only then does any rank copy its rows in; a file missing or
    damaged on one rank leaves every rank's head unchanged and raises on every rank. The
    sampler's index (if any) no longer describes the weights, so it is invalidated and
    rebuilt at the next forward.
    """
    with all_or_none(f"reading the exported head {path!r}", head.group):
        shape = exported_head_shape(path)
        if shape != (head.num_classes, head.embedding_dim):
            raise CheckpointError(f"exported head {path!r} holds {shape[0]} classes x {shape[1]}; this head has "
                                  f"num_classes={head.num_classes}, embedding_dim={head.embedding_dim} (they must "
                                  "be equal; nothing was loaded)")
        rows = load_exported_head(path, head.class_start, head.num_local, verify=verify)
    head.weight.copy_(rows.to(device=head.weight.device, dtype=head.weight.dtype))
    if hasattr(head.sampler, "invalidate"):
        head.sampler.invalidate()
    log.info("rank %d: loaded classes [%d, %d) from exported head %s", head.rank, head.class_start,
             head.class_start + head.num_local, path)
