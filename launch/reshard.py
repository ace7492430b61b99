"""Reshard a ds_xc checkpoint to another world size: pure file work, no process group.

    python launch/reshard.py --load_dir ckpt --world_size 3 --out_dir ckpt_p3      # the tag in ckpt/latest
    python launch/reshard.py --load_dir ckpt --tag step100 --world_size 1 --out_dir ckpt_p1
    deepspeed --num_gpus 3 launch/train.py --save_dir ckpt_p3 --resume              # then resume on 3 ranks

What moves where (the input is never modified; the output is a new folder, ``latest`` last):

* head weight rows and their head-optimizer state rows (SGD ``momentum_buffer``, AdamW
  ``exp_avg``/``exp_avg_sq``; dense and lazy modes store the same full-shard tensors) go to
  the rank that owns each class at the new world size (ds_xc.head.partition, uneven splits
  included); scalars (AdamW's ``step``) and the param groups must agree across the old
  shards and are copied;
* sampler state: the RNG gets a fresh stream per new rank, the step count is kept, an ANN
  index / kNN graph (which describe the old shard's rows) is dropped and the saved weight
  checksum cleared, so the head rebuilds its index at the first forward;
* compression (error-feedback) residuals are per rank and meaningless for other ranks: they
  are reset (one file per new rank keeps the step counter and counters, without residuals);
* DeepSpeed files: ZeRO stage 0 writes the replicated backbone, its optimizer and scheduler
  in ``mp_rank_00_model_states.pt``, which loads at any world size; it is copied with its
  recorded world size updated. ZeRO 1/2 optimizer partitions (``*zero_pp_rank_*``) are split
  by world size and are refused unless the world size is unchanged.

A 2-D head layout (classes x replicas) stores one file per class shard: ``--world_size`` is the
number of class shards; the replica dimension needs nothing (every replica loads its class
rank's shard), and the per-replica sampler streams are dropped like the other sampler state.

Every input file is read with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ds_xc.checkpoint import (HEAD_DIR, CheckpointError, ShardRows, atomic_save, load_file,  # noqa: E402
                              read_meta, refuse_under_launcher, resolve_tag, shard_file, write_latest,
                              write_meta)
from ds_xc.compression.checkpoint import COMPRESSION_DIR, compression_file  # noqa: E402
from ds_xc.head.partition import shard_range  # noqa: E402
from ds_xc.sampling.fill import mix_seed  # noqa: E402
from ds_xc.manifest import hash_files, list_files, verify_manifest, write_manifest  # noqa: E402

MODEL_STATES = re.compile(r"^(layer_\d+-)?mp_rank_\d+_model_states\.pt$")
ZERO_STATES = re.compile(r"zero_pp_rank_\d+.*optim_states\.pt$")
_SAMPLER_KEPT = ("steps",)  # everything else describes the old shard's rows (the fill stream is made anew)


class ReshardError(RuntimeError):
    """The checkpoint cannot be resharded as asked; the message says why and what to do."""


# ---------------------------------------------------------------------- the head
def shared_optimizer_state(rows: ShardRows) -> tuple[dict, list, set]:
    """(scalar entries, param_groups, names of row entries) of the head optimizer, checked to
    agree across the old shards (they are the same on every rank of a healthy run)."""
    first = rows.optimizer_state(0)
    scalars = {k: v for k, v in first.items() if not (torch.is_tensor(v) and v.dim() >= 1)}
    row_keys = set(first) - set(scalars)
    opt0 = rows.states[0].get("optimizer")
    groups = copy.deepcopy(opt0["param_groups"]) if opt0 is not None else None
    for r in range(1, rows.world_size):
        entry, opt = rows.optimizer_state(r), rows.states[r].get("optimizer")
        mismatch = set(entry) != set(first) or (opt is None) != (opt0 is None)
        mismatch = mismatch or any(not _same(entry[k], v) for k, v in scalars.items())
        mismatch = mismatch or (opt is not None and opt["param_groups"] != opt0["param_groups"])
        if mismatch:
            raise ReshardError(f"head optimizer state differs between {rows.paths[0]!r} and {rows.paths[r]!r} "
                               f"(keys {sorted(first)} vs {sorted(entry)}, or scalars/param groups): the new "
                               "shards mix rows of both, so they must agree")
    return scalars, groups, row_keys


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def fresh_sampler_state(template: dict, rank: int, world_size: int) -> dict:
    """Sampler state for a new shard: the step count, a fresh per-rank fill stream, no index."""
    state = {k: (None if k not in _SAMPLER_KEPT else v) for k, v in template.items() if k != "generator"}
    steps = int(template.get("steps", 0) or 0)
    seed = int((template.get("fill") or {}).get("seed", 0))  # an older checkpoint (a generator state): seed 0
    state["fill"] = {"seed": seed, "stream": mix_seed(world_size, rank, steps), "draws": 0}
    if "built_at" in state:
        state["built_at"] = None  # the index / graph is rebuilt at the first forward
    return state


def new_shard(rows: ShardRows, rank: int, world_size: int, shared) -> dict:
    scalars, groups, row_keys = shared
    start, count = shard_range(rows.num_classes, world_size, rank)
    template = rows.states[0]["head"].get("_extra_state") or {}
    extra = {"num_classes": rows.num_classes, "class_start": start, "num_local": count,
             "world_size": world_size, "rank": rank, "embedding_dim": rows.embedding_dim,
             "sampler": fresh_sampler_state(template.get("sampler", {}), rank, world_size),
             "weight_checksum": None}  # never matches: an index is never trusted after a reshard
    optimizer = None
    if groups is not None:
        entry = {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in scalars.items()}
        entry.update({k: rows.rows(start, count, k) for k in sorted(row_keys)})
        optimizer = {"state": {0: entry} if entry else {}, "param_groups": copy.deepcopy(groups)}
    shard = {"head": {"weight": rows.rows(start, count), "_extra_state": extra}, "optimizer": optimizer,
             "class_start": start, "num_local": count, "num_classes": rows.num_classes, "world_size": world_size}
    if rows.states[0].get("options") is not None:  # the head's options, as saved (ds_xc/checkpoint/options.py)
        shard["options"] = copy.deepcopy(rows.states[0]["options"])
    return shard


def reshard_head(src_tag: str, dst_tag: str, world_size: int) -> list:
    """Write ``dst_tag/ds_xc_head`` for ``world_size`` ranks from the shards in ``src_tag``; returns notes."""
    rows = ShardRows(src_tag)
    if world_size > rows.num_classes:
        raise ReshardError(f"--world_size {world_size}: more ranks than the {rows.num_classes} classes")
    shared = shared_optimizer_state(rows)
    for rank in range(world_size):
        atomic_save(new_shard(rows, rank, world_size, shared), shard_file(dst_tag, rank, world_size))
    write_meta(dst_tag, rows.num_classes, world_size, rows.embedding_dim)
    sampler_keys = sorted(k for k in (rows.states[0]["head"].get("_extra_state") or {}).get("sampler", {})
                          if k not in _SAMPLER_KEPT)
    notes = [f"head: {rows.num_classes} classes x {rows.embedding_dim}, {rows.world_size} -> {world_size} shards; "
             f"optimizer rows moved: {sorted(shared[2]) or 'none'}"]
    if sampler_keys:
        notes.append(f"sampler state {sampler_keys} dropped: the index/graph is rebuilt at the first forward")
    return notes


# ---------------------------------------------------------------------- compression and DeepSpeed
def reset_compression(src_tag: str, dst_tag: str, old_world: int, world_size: int) -> list:
    """Per-rank error-feedback residuals do not survive a reshard: write, for every new rank,
    the step and counters of old rank 0 without residuals (their load then starts them at zero)."""
    src = os.path.join(src_tag, COMPRESSION_DIR)
    if not os.path.isdir(src):
        return []
    if old_world == world_size:  # same ranks, same residuals
        shutil.copytree(src, os.path.join(dst_tag, COMPRESSION_DIR))
        return ["compression: state copied unchanged (same world size)"]
    state = load_file(compression_file(src_tag, 0, old_world), "compression state")
    state = {k: v for k, v in state.items() if k != "state"}
    for rank in range(world_size):
        atomic_save(dict(state, rank=rank), compression_file(dst_tag, rank, world_size))
    return [f"compression: error-feedback residuals reset (they were per rank on {old_world} ranks); "
            f"step {state.get('step')} kept"]


def copy_engine_files(src_tag: str, dst_tag: str, old_world: int, world_size: int, num_classes=None) -> list:
    """Copy DeepSpeed's files of the tag; model states get the new world size (and, when the class
    set grows, launch/grow.py, the new ``num_classes``) recorded."""
    notes = []
    zero = sorted(f for f in os.listdir(src_tag) if ZERO_STATES.search(f))
    if zero and world_size != old_world:
        raise ReshardError(
            f"{src_tag!r} holds ZeRO stage 1/2 optimizer partitions ({', '.join(zero[:3])}...), split over "
            f"{old_world} ranks; DeepSpeed cannot load them on {world_size} ranks and this tool does not "
            "re-partition them. Reshard a checkpoint saved with zero_optimization.stage 0, or convert it "
            "with DeepSpeed's universal checkpoint tools")
    for name in sorted(os.listdir(src_tag)):
        src, dst = os.path.join(src_tag, name), os.path.join(dst_tag, name)
        if name in (HEAD_DIR, COMPRESSION_DIR):
            continue
        if os.path.isdir(src):
            shutil.copytree(src, dst)
            notes.append(f"{name}/: copied unchanged")
        elif MODEL_STATES.match(name):
            notes.append(_copy_model_states(src, dst, world_size, num_classes))
        else:
            shutil.copy2(src, dst)
            notes.append(f"{name}: copied unchanged")
    return notes


def _copy_model_states(src: str, dst: str, world_size: int, num_classes=None) -> str:
    """ZeRO 0's replicated backbone: loads at any world size; record the new one."""
    try:
        state = load_file(src, "DeepSpeed model states")
    except CheckpointError as exc:  # e.g. args objects that are not plain data: copy the bytes
        shutil.copy2(src, dst)
        return f"{os.path.basename(src)}: copied unchanged (not plain data, world size left as saved: {exc})"
    if isinstance(state.get("ds_xc"), dict):
        state["ds_xc"] = dict(state["ds_xc"], world_size=world_size)
        if num_classes is not None:
            state["ds_xc"]["num_classes"] = int(num_classes)
    if "dp_world_size" in state:
        state["dp_world_size"] = world_size
    atomic_save(state, dst)
    return f"{os.path.basename(src)}: copied, dp_world_size set to {world_size}"


# ---------------------------------------------------------------------- the whole checkpoint
def reshard(load_dir: str, out_dir: str, world_size: int, tag=None, head=None, num_classes=None) -> dict:
    """Reshard tag ``tag`` (default: ``load_dir/latest``) of ``load_dir`` into the new folder
    ``out_dir`` for ``world_size`` ranks. Returns {"tag", "old_world_size", "world_size", "notes"}.

    ``head(src_tag, dst_tag, world_size) -> notes`` writes the head instead of :func:`reshard_head`
    (launch/grow.py: the same move with ``num_classes`` classes, recorded in the model states)."""
    if world_size < 1:
        raise ReshardError(f"--world_size {world_size}: must be >= 1")
    tag = resolve_tag(load_dir, tag)
    if os.path.realpath(out_dir) == os.path.realpath(load_dir):
        raise ReshardError(f"--out_dir {out_dir!r} is the input folder; write to a new folder")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ReshardError(f"--out_dir {out_dir!r} exists and is not empty; give a new folder")
    src_tag = os.path.join(load_dir, tag)
    verify_manifest(src_tag, "reshard")  # checksums of the input (a tag written before them: warned)
    old_world = read_meta(src_tag)["world_size"]
    os.makedirs(out_dir, exist_ok=True)
    staging = os.path.join(out_dir, f".reshard_tmp_{tag}")
    try:
        os.makedirs(staging)
        notes = (head or reshard_head)(src_tag, staging, world_size)
        notes += reset_compression(src_tag, staging, old_world, world_size)
        notes += copy_engine_files(src_tag, staging, old_world, world_size, num_classes)
        write_manifest(staging, hash_files(staging, list_files(staging)))  # checksums of the new files
        for name in sorted(os.listdir(load_dir)):  # DeepSpeed's helper scripts (zero_to_fp32.py ...)
            path = os.path.join(load_dir, name)
            if name != "latest" and not name.startswith(".") and os.path.isfile(path):  # not locks, markers
                shutil.copy2(path, os.path.join(out_dir, name))
        os.replace(staging, os.path.join(out_dir, tag))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    write_latest(out_dir, tag)  # last: a half-written output is never picked up by --resume
    return {"tag": tag, "old_world_size": old_world, "world_size": world_size, "notes": notes}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load_dir", required=True, help="the checkpoint folder (XCEngine.save_checkpoint's save_dir)")
    p.add_argument("--tag", help="the tag to reshard (default: the one in LOAD_DIR/latest)")
    p.add_argument("--world_size", type=int, required=True, help="number of class shards to reshard for (the ranks of a 1-D head; a 2-D layout: its class-group size)")
    p.add_argument("--out_dir", required=True, help="new folder to write (must not exist or be empty)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    refuse_under_launcher("reshard")  # no collectives here: one process does all the work
    try:
        report = reshard(args.load_dir, args.out_dir, args.world_size, args.tag)
    except (ReshardError, CheckpointError, FileNotFoundError) as exc:
        raise SystemExit(f"reshard: {exc}") from None
    print(f"resharded {os.path.join(args.load_dir, report['tag'])} from {report['old_world_size']} to "
          f"{report['world_size']} ranks into {args.out_dir}")
    for note in report["notes"]:
        print(f"  {note}")
    ranks = f"--num_gpus {report['world_size']} " if report["world_size"] > 1 else ""
    print(f"resume with: deepspeed {ranks}launch/train.py --save_dir {args.out_dir} --resume (plus your usual flags)")
    return report


if __name__ == "__main__":
    main()
