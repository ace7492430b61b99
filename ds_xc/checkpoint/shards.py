"""Head shard checkpoints: one file per rank with its class range, checked against meta.json.

Layout inside a checkpoint tag directory::

    <tag>/ds_xc_head/meta.json                     num_classes, world_size, shard sizes (rank 0)
    <tag>/ds_xc_head/shard_00000_of_00002.pt       rank 0's weight rows, optimizer and sampler state
    <tag>/ds_xc_head/shard_00001_of_00002.pt

Each shard records its class range, so a checkpoint can be merged (launch/export.py) or
resharded to another world size (launch/reshard.py) without the processes that wrote it.

2-D layout (a head with a replica group): the replicas of a shard hold the same weights and
optimizer state, so only replica 0 of each class group writes it, named by its class rank;
``world_size`` counts the class shards and meta.json records the layout
(``{"class_shards": Pc, "replicas": Pr}``). Every replica's sampler stream is kept in the
shard file (``replica_samplers``). Any layout loads it: each rank reads the shard of its
class rank (reshard first when the class count of shards differs).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

import torch

from ds_xc.checkpoint.files import CheckpointError, atomic_json, atomic_save, load_file
from ds_xc.head.partition import shard_range, shard_sizes

log = logging.getLogger(__name__)

__all__ = ["HEAD_DIR", "META_FILE", "shard_file", "write_meta", "save_head_state", "read_meta", "check_shard",
           "load_shard", "check_head_checkpoint", "read_head_state", "apply_head_state", "load_head_state",
           "ShardRows"]

HEAD_DIR = "ds_xc_head"
META_FILE = "meta.json"


def shard_file(tag_dir: str, rank: int, world_size: int) -> str:
    return os.path.join(tag_dir, HEAD_DIR, f"shard_{rank:05d}_of_{world_size:05d}.pt")



def write_meta(tag_dir: str, num_classes: int, world_size: int, embedding_dim: int, replicas: int = 1) -> str:
    """Write ``<tag>/ds_xc_head/meta.json`` (what every shard of the checkpoint must agree with);
    ``world_size`` is the number of class shards, ``replicas`` the copies of each (2-D layout)."""
    path = os.path.join(tag_dir, HEAD_DIR, META_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_json({"num_classes": num_classes, "world_size": world_size, "embedding_dim": embedding_dim,
                  "shard_sizes": shard_sizes(num_classes, world_size), "format": 1,
                  "layout": {"class_shards": world_size, "replicas": int(replicas)}}, path)
    return path


def save_head_state(tag_dir: str, head, optimizer=None, options: Optional[dict] = None) -> Optional[str]:
    """Write this rank's shard (weights, extra state, optimizer state) under ``tag_dir``; returns its
    path, or None on a replica > 0 of a 2-D layout (replica 0 writes the shard it shares; collective
    over the replica group, which gathers every replica's sampler state into that file). ``options``:
    the head's configuration as plain data (ds_xc/checkpoint/options.py), recorded so that a resume
    with other options can say what differs before anything is loaded."""
    path = shard_file(tag_dir, head.rank, head.world_size)
    replicas = getattr(head, "replicas", None)
    samplers = replicas.gather_states(head.sampler.state_dict()) if replicas is not None else None
    if replicas is not None and replicas.rank != 0:
        return None
    state = {"head": head.state_dict(), "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "class_start": head.class_start, "num_local": head.num_local,
             "num_classes": head.num_classes, "world_size": head.world_size}
    if options is not None:
        state["options"] = options
    if samplers is not None:
        state["replica_samplers"] = samplers  # (Pr,) sampler state dicts, in replica order
    atomic_save(state, path)
    if head.rank == 0:
        write_meta(tag_dir, head.num_classes, head.world_size, head.embedding_dim,
                   replicas.size if replicas is not None else 1)
    log.info("saved head shard %s", path)
    return path


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
                if meta["num_classes"] == head.num_classes else
                f"; or grow it to {head.num_classes} classes: python launch/grow.py --load_dir {load_dir} --tag {tag} "
                f"--world_size {head.world_size} --out_dir NEW_DIR --deepspeed_config YOUR.json (docs/growing.md)")
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
    if getattr(head, "replicas", None) is not None:  # 2-D: each replica's own sampler stream, if saved
        head.replicas.restore_sampler(head.sampler, state.get("replica_samplers"))
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
