"""Head shard checkpoints and exported heads: written atomically, read without code execution.

Layout inside a checkpoint tag directory::

    <tag>/ds_xc_head/meta.json                     num_classes, world_size, shard sizes (rank 0)
    <tag>/ds_xc_head/shard_00000_of_00002.pt       rank 0's weight rows, optimizer and sampler state
    <tag>/ds_xc_head/shard_00001_of_00002.pt

Each shard records its class range, so a checkpoint can be merged (launch/export.py) or
resharded to another world size (launch/reshard.py) without the processes that wrote it.

An exported head (launch/export.py) is the whole weight matrix in class order, either one
file or a folder of row blocks with an index; :func:`load_exported_head` reads either, and
:func:`load_exported_into_head` fills a ClassParallelHead of any world size from it::

    head.safetensors | head.pt                     {"weight": (C, d)} and the format tag
    DIR/head.index.json                            format, num_classes, embedding_dim, files
    DIR/head-00000-of-00003.safetensors | .pt      rows [class_start, class_start + num_rows)

Every file is read with ``torch.load(weights_only=True)`` (or safetensors): a damaged,
truncated or tampered file raises :class:`CheckpointError` naming the file, and never runs
code. Shapes and class ranges are checked against ``meta.json`` / the index.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Optional

import torch

from ds_xc.head.partition import shard_range, shard_sizes
from ds_xc.parallel.agree import all_or_none

log = logging.getLogger(__name__)

__all__ = ["save_head_state", "load_head_state", "check_head_checkpoint", "shard_file", "atomic_save",
           "read_meta", "write_meta", "load_file", "load_shard", "ShardRows", "CheckpointError",
           "load_exported_head", "load_exported_into_head", "read_export_index", "file_sha256",
           "resolve_tag", "refuse_under_launcher", "read_head_state", "apply_head_state", "exported_head_shape", "EXPORT_FORMAT", "EXPORT_INDEX", "fsync_tree", "publish_tag", "write_latest"]

HEAD_DIR = "ds_xc_head"
META_FILE = "meta.json"
EXPORT_FORMAT = "ds_xc.head/1"
EXPORT_INDEX = "head.index.json"


class CheckpointError(RuntimeError):
    """A checkpoint or exported-head file that is unreadable or inconsistent; the message names it."""


def shard_file(tag_dir: str, rank: int, world_size: int) -> str:
    return os.path.join(tag_dir, HEAD_DIR, f"shard_{rank:05d}_of_{world_size:05d}.pt")


def atomic_save(obj, path: str) -> None:
    """torch.save to a temporary file in the same folder, then rename over ``path``."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _atomic_json(obj, path: str) -> None:
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(folder: str) -> None:
    """Make a rename inside ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """fsync every file and folder under ``folder`` (DeepSpeed writes its files without it)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(root)


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag`` atomically (write a temporary file, fsync, rename)."""
    tmp = os.path.join(save_dir, ".latest.tmp")
    with open(tmp, "w") as fh:
        fh.write(tag)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(save_dir, "latest"))
    _fsync_dir(save_dir)


def publish_tag(save_dir: str, tag: str, staging: str) -> str:
    """Rename the complete folder ``staging`` to ``save_dir/tag``, then move ``latest`` to it.

    A folder already named ``tag`` is moved aside to ``.old_<tag>`` for the moment between the
    two renames and removed afterwards (:func:`resolve_tag` puts it back if a crash hits that
    moment). Call on one process, after every rank has finished writing into ``staging``.
    """
    final, old = os.path.join(save_dir, tag), os.path.join(save_dir, f".old_{tag}")
    if os.path.isdir(old):
        shutil.rmtree(old)
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(save_dir)
    write_latest(save_dir, tag)
    shutil.rmtree(old, ignore_errors=True)
    return final


def write_meta(tag_dir: str, num_classes: int, world_size: int, embedding_dim: int) -> str:
    """Write ``<tag>/ds_xc_head/meta.json`` (what every shard of the checkpoint must agree with)."""
    path = os.path.join(tag_dir, HEAD_DIR, META_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _atomic_json({"num_classes": num_classes, "world_size": world_size, "embedding_dim": embedding_dim,
                  "shard_sizes": shard_sizes(num_classes, world_size), "format": 1}, path)
    return path


def save_head_state(tag_dir: str, head, optimizer=None) -> str:
    """Write this rank's shard (weights, extra state, optimizer state) under ``tag_dir``."""
    path = shard_file(tag_dir, head.rank, head.world_size)
    atomic_save({"head": head.state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "class_start": head.class_start, "num_local": head.num_local,
                 "num_classes": head.num_classes, "world_size": head.world_size}, path)
    if head.rank == 0:
        write_meta(tag_dir, head.num_classes, head.world_size, head.embedding_dim)
    log.info("saved head shard %s", path)
    return path


def refuse_under_launcher(tool: str) -> None:
    """Stop a single-process file tool (launch/export.py, launch/reshard.py) started on several ranks.

    They run no process group and no collectives; under ``deepspeed``/``torchrun`` every rank
    would write the same output files at once."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        raise SystemExit(f"{tool}: WORLD_SIZE={world}: this is a single-process tool (it reads and writes files, "
                         f"no process group); run it once with `python launch/{tool}.py ...`, not under a launcher")


# ---------------------------------------------------------------------- reading, validated
def resolve_tag(load_dir: str, tag: Optional[str] = None) -> str:
    """``tag``, or the one named in ``load_dir/latest``; the tag folder must exist."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            tags = sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d))) \
                if os.path.isdir(load_dir) else []
            raise FileNotFoundError(f"{latest!r} does not exist: name a tag (one of {tags})")
        with open(latest) as fh:
            tag = fh.read().strip()
    old = os.path.join(load_dir, f".old_{tag}")
    if not os.path.isdir(os.path.join(load_dir, tag)) and os.path.isdir(old):
        os.replace(old, os.path.join(load_dir, tag))  # a re-save of this tag was killed between its renames
        log.warning("restored %s from %s (a save of the same tag was interrupted)", tag, old)
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise FileNotFoundError(f"tag {tag!r}: {os.path.join(load_dir, tag)!r} is not a folder")
    return tag


def load_file(path: str, what: str = "checkpoint file", map_location="cpu", mmap: bool = False):
    """``torch.load(path, weights_only=True)``; any failure becomes an error that names the file.

    ``mmap`` maps the tensors instead of reading them (merging or resharding a large head
    then touches only the rows it copies).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # truncated, tampered (a pickle that is not plain data), not a torch file
        if mmap:  # a legacy (non-zip) torch file cannot be mapped: read it normally
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except Exception:
                pass
        raise CheckpointError(f"cannot read {what} {path!r} (damaged, truncated or not a plain-tensor "
                              f"file; nothing in it was executed): {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def read_meta(tag_dir: str) -> dict:
    """``meta.json`` of a checkpoint tag, checked for the fields and values the shards rely on."""
    path = os.path.join(tag_dir, HEAD_DIR, META_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no ds_xc head in checkpoint {tag_dir!r} (missing {path})")
    try:
        with open(path) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path!r}: {exc}") from None
    for key in ("num_classes", "world_size", "embedding_dim"):
        value = meta.get(key) if isinstance(meta, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{path!r}: {key}={value!r}; expected an integer >= 1")
    if meta["world_size"] > meta["num_classes"]:
        raise CheckpointError(f"{path!r}: world_size={meta['world_size']} exceeds num_classes="
                              f"{meta['num_classes']}; every rank holds at least one class")
    expected = shard_sizes(meta["num_classes"], meta["world_size"])
    if meta.get("shard_sizes", expected) != expected:
        raise CheckpointError(f"{path!r}: shard_sizes={meta['shard_sizes']}; {meta['num_classes']} classes "
                              f"on {meta['world_size']} ranks are split as {expected}")
    meta["path"] = path
    return meta


def _bad(path: str, msg: str) -> CheckpointError:
    return CheckpointError(f"head shard {path!r}: {msg}")


def check_shard(state, path: str, meta: dict, rank: int) -> None:
    """Check a loaded shard against meta.json: its class range, weight shape and optimizer rows."""
    if not isinstance(state, dict) or not isinstance(state.get("head"), dict):
        raise _bad(path, "not a ds_xc head shard (expected a dict with a 'head' state dict)")
    start, count = shard_range(meta["num_classes"], meta["world_size"], rank)
    rows = (start, count, meta["num_classes"], meta["world_size"])
    saved = (state.get("class_start"), state.get("num_local"), state.get("num_classes"), state.get("world_size"))
    if saved != rows:
        end = saved[0] + saved[1] if all(isinstance(v, int) for v in saved[:2]) else "?"
        raise _bad(path, f"holds classes [{saved[0]}, {end}) of {saved[2]} on "
                   f"{saved[3]} ranks; {meta['path']} says rank {rank} holds [{start}, {start + count}) of "
                   f"{meta['num_classes']} on {meta['world_size']} ranks")
    shape = (count, meta["embedding_dim"])
    weight = state["head"].get("weight")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise _bad(path, f"weight is {got}; expected a tensor of shape {shape} (rank {rank}'s classes "
                   f"[{start}, {start + count}), embedding_dim {meta['embedding_dim']} from {meta['path']})")
    extra = state["head"].get("_extra_state")
    if isinstance(extra, dict) and (extra.get("class_start"), extra.get("num_local")) != (start, count):
        raise _bad(path, f"its extra state describes classes [{extra.get('class_start')}, ...) with "
                   f"{extra.get('num_local')} rows; expected [{start}, {start + count})")
    for name, value in _optimizer_state(state, path).items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and tuple(value.shape) != shape:
            raise _bad(path, f"optimizer state {name!r} has shape {tuple(value.shape)}; expected {shape} "
                       "(one row per class of the shard) or a scalar")


def _optimizer_state(state: dict, path: str) -> dict:
    """The per-parameter state of the head optimizer ({} when none): one parameter, the weight."""
    opt = state.get("optimizer")
    if opt is None:
        return {}
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if not isinstance(groups, list) or len(groups) != 1 or list(groups[0].get("params", [])) != [0]:
        raise _bad(path, "optimizer state is not that of one parameter group holding the head weight "
                   "(expected param_groups=[{..., 'params': [0]}])")
    per_param = opt.get("state", {})
    if not isinstance(per_param, dict) or set(per_param) - {0}:
        raise _bad(path, f"optimizer state has entries for parameters {sorted(per_param)}; expected [0] or none")
    entry = per_param.get(0, {})
    if not isinstance(entry, dict):
        raise _bad(path, "optimizer state of parameter 0 is not a dict")
    return entry


def load_shard(tag_dir: str, rank: int, meta: Optional[dict] = None, map_location="cpu",
               mmap: bool = False) -> dict:
    """Read and check shard ``rank`` of the checkpoint in ``tag_dir``."""
    meta = meta or read_meta(tag_dir)
    path = shard_file(tag_dir, rank, meta["world_size"])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"head shard {path!r} is missing from checkpoint {tag_dir!r}")
    state = load_file(path, "head shard", map_location, mmap)
    check_shard(state, path, meta, rank)
    return state


def check_head_checkpoint(tag_dir: str, head) -> dict:
    """meta.json of ``tag_dir`` if it fits ``head`` (class count and world size); else an error
    that says how to reshard. Called before anything is loaded."""
    meta = read_meta(tag_dir)
    if meta["num_classes"] != head.num_classes or meta["world_size"] != head.world_size:
        load_dir, tag = os.path.split(os.path.normpath(tag_dir))
        hint = (f"; or reshard it for {head.world_size} ranks: python launch/reshard.py --load_dir {load_dir} "
                f"--tag {tag} --world_size {head.world_size} --out_dir NEW_DIR, then resume from NEW_DIR"
                if meta["num_classes"] == head.num_classes else "")
        raise RuntimeError(
            f"checkpoint {tag_dir!r} holds a head of {meta['num_classes']} classes on {meta['world_size']} "
            f"ranks; this run has {head.num_classes} classes on {head.world_size} ranks. Resume it with "
            f"{meta['world_size']} ranks and the same num_classes{hint}; nothing was loaded")
    if meta["embedding_dim"] != head.embedding_dim:
        raise RuntimeError(f"checkpoint {tag_dir!r} holds a head with embedding_dim {meta['embedding_dim']}; "
                           f"this run has {head.embedding_dim}; nothing was loaded")
    return meta


def read_head_state(tag_dir: str, head) -> dict:
    """This rank's shard of ``tag_dir``, read and checked against ``head``; nothing is changed.

    The file is read to the CPU, whatever device the head is on: a sampler's generator
    state is a CPU tensor and must stay one (a CPU generator refuses a CUDA tensor).
    :func:`apply_head_state` then moves each restored tensor to where it lives.
    """
    meta = check_head_checkpoint(tag_dir, head)
    return load_shard(tag_dir, head.rank, meta, map_location="cpu")


def apply_head_state(head, optimizer, state: dict) -> None:
    """Load a shard that :func:`read_head_state` returned into ``head`` (and its optimizer).

    The weight is copied into the head's parameter (its device and dtype), the sampler moves
    its index or graph to the head's device, and ``optimizer.load_state_dict`` casts the
    optimizer state to the weight's device (and floating state to its dtype; ``step`` stays
    on the CPU).
    """
    head.load_state_dict(state["head"])
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    log.info("loaded head shard of rank %d", head.rank)


def load_head_state(tag_dir: str, head, optimizer=None) -> None:
    """Load this rank's shard from ``tag_dir``; a world-size or class mismatch is an error."""
    apply_head_state(head, optimizer, read_head_state(tag_dir, head))


class ShardRows:
    """Rows of a checkpoint's head in class order, across shard boundaries, without a process group.

    Every shard is checked and memory-mapped once; :meth:`rows` copies out only the rows asked
    for, so merging or resharding a head needs about one output block of memory.
    """

    def __init__(self, tag_dir: str):
        self.tag_dir = tag_dir
        self.meta = read_meta(tag_dir)
        self.num_classes, self.world_size = self.meta["num_classes"], self.meta["world_size"]
        self.embedding_dim = self.meta["embedding_dim"]
        self.paths = [shard_file(tag_dir, r, self.world_size) for r in range(self.world_size)]
        self.states = [load_shard(tag_dir, r, self.meta, mmap=True) for r in range(self.world_size)]
        self.starts = [shard_range(self.num_classes, self.world_size, r)[0] for r in range(self.world_size)]
        self.dtype = self.states[0]["head"]["weight"].dtype

    def optimizer_state(self, rank: int) -> dict:
        return _optimizer_state(self.states[rank], self.paths[rank])

    def rows(self, start: int, count: int, key: Optional[str] = None) -> torch.Tensor:
        """Rows [start, start + count) of the weight (key None) or of optimizer state ``key``: (count, d)."""
        if start < 0 or count < 0 or start + count > self.num_classes:
            raise ValueError(f"rows [{start}, {start + count}) outside [0, {self.num_classes})")
        parts = []
        for r, (s0, state) in enumerate(zip(self.starts, self.states)):
            n = state["num_local"]
            lo, hi = max(start, s0), min(start + count, s0 + n)
            if lo >= hi:
                continue
            src = state["head"]["weight"] if key is None else self.optimizer_state(r).get(key)
            if src is None:
                raise CheckpointError(f"head shard {self.paths[r]!r} has no optimizer state {key!r}, "
                                      "which other shards of the checkpoint have")
            parts.append(src[lo - s0: hi - s0])
        if not parts:
            return torch.empty((0, self.embedding_dim), dtype=self.dtype)
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()  # a copy, never a view of the map


# ---------------------------------------------------------------------- exported heads
def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


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
