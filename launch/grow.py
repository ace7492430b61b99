"""Grow the class set of a ds_xc checkpoint: C classes -> C' > C, at any world size, then keep training.

    python launch/grow.py --load_dir ckpt --out_dir ckpt_grown --deepspeed_config configs/glyphs_grow_stage2.json
    deepspeed --num_gpus 2 launch/grow.py --load_dir ckpt --out_dir ckpt_grown --deepspeed_config NEW.json \\
        --world_size 2 --init imprint
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config NEW.json --save_dir ckpt_grown --resume

C' is ``extreme_classification.num_classes`` of the new DeepSpeed JSON (the one training goes on
with; ``--num_classes`` overrides it). The class order is stable: class c keeps id c and the new
classes get ids C..C'-1 (the built-in data sets keep that order: num_classes C' holds the first
C classes of the C'-class set). What the new checkpoint holds (a new folder, written as
launch/reshard.py writes one: the input is never modified, ``latest`` last, atomic files):

* old rows and all their head-optimizer state (SGD ``momentum_buffer``, AdamW ``exp_avg`` /
  ``exp_avg_sq``, dense, lazy and lazy_exact modes alike) bit for bit, moved to the rank owning
  each class at ``--world_size`` ranks; scalars (AdamW ``step``) and param groups copied;
* new rows' optimizer state zero: the state of a row never updated. lazy_exact saves caught-up
  rows without its per-row counters (XCEngine.save_checkpoint), so on load the counters restart
  with every row current and a new row's catch-up is a no-op;
* new rows: ``--init imprint`` (default) is weight imprinting (ds_xc/head/imprint.py): one pass of
  the checkpoint's backbone, built from the new JSON through the registries launch/train.py uses,
  over ``--imprint_samples`` training samples; each rank embeds its part, per-class sums are reduced
  to the rank owning the class, and each row is the normalised mean of its samples' normalised
  embeddings times the median L2 norm of the old rows (cosine losses ignore row norms in the logits,
  so the scale only sets the new rows' effective step size, which should match an old row's; for
  plain softmax it puts a new class on the footing of a typical old class; the median, not the mean,
  so that a few large or decayed rows do not set it). ``--imprint_calibration match_cosine`` (the
  default) then turns each row so that its own-class mean cosine equals the old rows' (measured on
  ``--imprint_old_samples`` old-class samples of the pass): plain class means are more confident
  than trained rows and take old classes' samples (docs/growing.md). A new class without a sample
  in the pass gets the random row. ``--init random``: row j is ``init_shard(seed, j)`` of the new JSON, i.e. exactly
  the row a fresh C'-class head would start with;
* sampler index / graph dropped (rebuilt at the first forward), RNG streams fresh, compression
  residuals reset (as reshard does); DeepSpeed's files copied with the new world size and class count.

``--retire`` allows C' < C: classes C'..C-1 and their state are dropped (the rest as above).
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys

import torch

LAUNCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(LAUNCH))  # run from a checkout
sys.path.insert(0, LAUNCH)  # the sibling tools: reshard (file work), train (config and data)

import reshard as reshard_tool

from ds_xc.checkpoint import (
    CheckpointError,
    ShardRows,
    atomic_save,
    load_file,
    read_meta,
    resolve_tag,
    shard_file,
    write_meta,
)
from ds_xc.head import init_shard

MODEL_FILE = "mp_rank_00_model_states.pt"


class GrowError(ValueError):
    """The checkpoint cannot be grown as asked; the message names the value and what is allowed."""


class GrownRows:
    """The rows of the grown head in class order, with ShardRows' interface (``rows``, ``states``,
    sizes) so that reshard's shard writer moves them: rows below min(C, C') come from the old
    shards, rows C..C'-1 from ``new_weight`` (K, d), their optimizer rows are zeros."""

    def __init__(self, old: ShardRows, num_classes: int, new_weight: torch.Tensor):
        self.old, self.num_classes, self.embedding_dim = old, int(num_classes), old.embedding_dim
        self.states, self.dtype = old.states, old.dtype
        self.kept = min(old.num_classes, self.num_classes)
        self.new_weight = new_weight
        if new_weight.shape != (self.num_classes - self.kept, self.embedding_dim):
            raise GrowError(f"new rows {tuple(new_weight.shape)}; expected ({self.num_classes - self.kept}, "
                            f"{self.embedding_dim})")

    def rows(self, start: int, count: int, key=None) -> torch.Tensor:
        """Rows [start, start + count) of the weight (key None) or of optimizer state ``key``: (count, d)."""
        parts, end = [], start + count
        if start < self.kept:
            parts.append(self.old.rows(start, min(end, self.kept) - start, key))
        lo, hi = max(start, self.kept), end
        if hi > lo:
            if key is None:
                parts.append(self.new_weight[lo - self.kept: hi - self.kept].clone())
            else:  # never updated: zero state of the old state's dtype
                parts.append(torch.zeros(hi - lo, self.embedding_dim, dtype=self.old.rows(0, 1, key).dtype))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def median_row_norm(old: ShardRows, block: int = 1 << 16) -> float:
    """The median L2 norm of the checkpoint's rows (float64 norms, read block by block)."""
    norms = torch.cat([old.rows(a, min(block, old.num_classes - a)).double().norm(dim=1)
                       for a in range(0, old.num_classes, block)])
    return float(norms.median())


def grow_head(src_tag: str, dst_tag: str, world_size: int, num_classes: int, new_weight: torch.Tensor) -> list:
    """Write ``dst_tag/ds_xc_head`` with ``num_classes`` classes on ``world_size`` shards; returns notes."""
    old = ShardRows(src_tag)
    if world_size > num_classes:
        raise GrowError(f"--world_size {world_size}: more ranks than the {num_classes} classes")
    grown = GrownRows(old, num_classes, new_weight)
    shared = reshard_tool.shared_optimizer_state(old)
    for rank in range(world_size):
        atomic_save(reshard_tool.new_shard(grown, rank, world_size, shared), shard_file(dst_tag, rank, world_size))
    write_meta(dst_tag, num_classes, world_size, old.embedding_dim)
    change = (f"{num_classes - old.num_classes} new rows" if num_classes > old.num_classes else
              f"classes {num_classes}..{old.num_classes - 1} retired")
    return [(f"head: {old.num_classes} -> {num_classes} classes x {old.embedding_dim} ({change}), "
             f"{old.world_size} -> {world_size} shards; old rows and optimizer rows {sorted(shared[2]) or 'none'} "
             "kept bit for bit, new optimizer rows zero"),
            "sampler index/graph dropped: rebuilt at the first forward"]


# ---------------------------------------------------------------------- the new rows
def random_rows(head_cfg, first: int, num_classes: int, dtype) -> torch.Tensor:
    """Rows first..num_classes-1 of a fresh head of the new config: (K, d)."""
    return init_shard(num_classes, head_cfg.embedding_dim, first, num_classes - first, head_cfg.init_std,
                      head_cfg.seed, dtype=dtype)


def imprint_parts(args, raw: dict, xcfg, first: int, parts_dir: str, device=None) -> None:
    """Every rank: embed its part of the training samples on ``device`` (the rank's, bound by
    init_distributed; None: the CPU), reduce the sums to the owners, and write this rank's unit rows
    and counts to ``parts_dir`` (collective over the world)."""
    import torch.distributed as dist

    from ds_xc.data import build_dataset, dataset_kwargs
    from ds_xc.head.imprint import ImprintSums, imprint_rows
    from ds_xc.models import build_backbone
    group, rank, world = dist.group.WORLD, dist.get_rank(dist.group.WORLD), dist.get_world_size(dist.group.WORLD)
    tcfg, hcfg = xcfg.xc_train, xcfg.extreme_classification
    if rank != 0:
        dist.barrier(group=group)  # rank 0 builds any data cache first
    data = build_dataset(tcfg.data, hcfg.num_classes, seed=tcfg.seed, **dataset_kwargs(tcfg))
    if rank == 0:
        dist.barrier(group=group)
    backbone = build_backbone(data, hcfg.embedding_dim, hidden_dim=tcfg.hidden_dim)
    state = load_file(os.path.join(args.load_dir, args.tag, MODEL_FILE), "DeepSpeed model states")
    backbone.load_state_dict(state["module"])
    backbone.eval().to(device)
    micro = int(raw.get("train_micro_batch_size_per_gpu", 256))
    total = args.imprint_samples or 16 * hcfg.num_classes
    sums = ImprintSums(first, hcfg.num_classes, hcfg.embedding_dim, device=device)
    calibrate = args.imprint_calibration == "match_cosine"
    old_rows, old_left = ShardRows(os.path.join(args.load_dir, args.tag)), math.ceil(args.imprint_old_samples / world)
    with torch.no_grad():
        for step in range(math.ceil(total / (micro * world))):
            x, y = data.train_batch(args.imprint_from_step + step, micro, rank, world)
            keep = y >= first
            if bool(keep.any()):
                sums.add(backbone(x[keep].to(device)), y[keep])  # (n, d): only the new classes' samples
            old = torch.nonzero(~keep).squeeze(1)[: old_left if calibrate else 0]  # calibration: a few old ones
            if old.numel():
                rows = torch.cat([old_rows.rows(int(c), 1) for c in y[old]])  # (n, d) their trained rows
                sums.add_old(backbone(x[old].to(device)), rows)
                old_left -= old.numel()
    start, rows, counts, info = imprint_rows(sums, group, calibrate=calibrate)
    atomic_save({"start": start, "rows": rows.cpu(), "counts": counts.cpu(), **info},
                os.path.join(parts_dir, f"rank_{rank:05d}.pt"))


def imprinted_rows(parts_dir: str, head_cfg, first: int, num_classes: int, scale: float, dtype):
    """(K, d) rows from the owners' parts: unit rows times ``scale``; classes without samples random."""
    rows = random_rows(head_cfg, first, num_classes, dtype)
    missing, info = 0, {}
    for name in sorted(os.listdir(parts_dir)):
        part = load_file(os.path.join(parts_dir, name), "imprinting part")
        lo, have = part["start"] - first, part["counts"] > 0
        block = rows[lo: lo + part["rows"].shape[0]]
        block[have] = (part["rows"][have] * scale).to(dtype)
        missing += int((~have).sum())
        info = {k: part[k] for k in ("kappa", "a_old", "a_new")}  # the same on every rank (all-reduced)
    return rows, missing, info


# ---------------------------------------------------------------------- the whole checkpoint
def check_request(args, xcfg) -> tuple[str, dict, int]:
    """(tag, the checkpoint's meta.json, C') after checking the request; GrowError names a bad value."""
    hcfg = xcfg.extreme_classification
    if hcfg is None:
        raise GrowError(f"--deepspeed_config {args.deepspeed_config!r} has no extreme_classification section")
    tag = resolve_tag(args.load_dir, args.tag)
    meta = read_meta(os.path.join(args.load_dir, tag))
    old, new = meta["num_classes"], hcfg.num_classes
    if new == old:
        raise GrowError(f"num_classes {new} equals the checkpoint's {old}: nothing to grow (launch/reshard.py "
                        "changes the world size alone)")
    if new < old and not args.retire:
        raise GrowError(f"num_classes {new} < the checkpoint's {old}: growing needs num_classes > {old}; pass "
                        f"--retire to drop classes {new}..{old - 1}")
    if hcfg.embedding_dim != meta["embedding_dim"]:
        raise GrowError(f"extreme_classification.embedding_dim {hcfg.embedding_dim} of {args.deepspeed_config!r} "
                        f"differs from the checkpoint's {meta['embedding_dim']} ({meta['path']}); the old rows "
                        "cannot change width")
    world = args.world_size or meta["world_size"]
    if not 1 <= world <= new:
        raise GrowError(f"--world_size {world}: must be in [1, {new}] (every rank holds at least one class)")
    if os.path.realpath(args.out_dir) == os.path.realpath(args.load_dir) or (
            os.path.exists(args.out_dir) and os.listdir(args.out_dir)):
        raise GrowError(f"--out_dir {args.out_dir!r} is the input folder or not empty; give a new folder")
    if not os.path.isfile(os.path.join(args.load_dir, tag, MODEL_FILE)):
        raise FileNotFoundError(f"{os.path.join(args.load_dir, tag, MODEL_FILE)!r} (the backbone) is missing")
    args.tag, args.world_size = tag, world
    return tag, meta, new


def write_grown(args, xcfg, meta: dict, num_classes: int, parts_dir) -> dict:
    """Rank 0: the new rows, then the new folder through reshard's machinery; returns its report."""
    src_tag = os.path.join(args.load_dir, args.tag)
    old, hcfg = ShardRows(src_tag), xcfg.extreme_classification
    first = meta["num_classes"]
    notes = []
    if num_classes <= first:
        rows = torch.empty(0, old.embedding_dim, dtype=old.dtype)
    elif parts_dir is None:
        rows = random_rows(hcfg, first, num_classes, old.dtype)
        notes.append(f"new rows {first}..{num_classes - 1}: random, init_std {hcfg.init_std}, seed {hcfg.seed}")
    else:
        scale = median_row_norm(old)
        rows, missing, info = imprinted_rows(parts_dir, hcfg, first, num_classes, scale, old.dtype)
        notes.append(f"new rows {first}..{num_classes - 1}: imprinted, scaled to the old rows' median norm "
                     f"{scale:.6g}; {missing} class(es) without a sample in the pass got random rows; calibration "
                     f"{args.imprint_calibration}: own-class mean cosine of old rows {info['a_old']:.4f}, of the "
                     f"class means {info['a_new']:.4f}, kappa {info['kappa']:.4f}")
    report = reshard_tool.reshard(args.load_dir, args.out_dir, args.world_size, args.tag, num_classes=num_classes,
                                  head=lambda s, d, w: grow_head(s, d, w, num_classes, rows))
    report.update(old_num_classes=first, num_classes=num_classes, notes=notes + report["notes"])
    return report


def grow(args) -> dict:
    """Grow (every rank under a launcher; imprinting is collective); rank 0 writes and returns the report."""
    from train import build_config

    import ds_xc
    raw = build_config(args)
    xcfg = ds_xc.parse_config(raw)
    _, meta, new = check_request(args, xcfg)
    if args.init == "random" and "WORLD_SIZE" not in os.environ:
        return write_grown(args, xcfg, meta, new, None)  # file work only, one process
    import torch.distributed as dist

    from ds_xc.engine import init_distributed
    from ds_xc.parallel.agree import all_or_none
    started = not dist.is_initialized()  # a caller's process group (a test's, a notebook's) is left running
    device = init_distributed(timeout_s=xcfg.xc_train.comm_timeout_s)  # binds cuda:LOCAL_RANK first
    group = dist.group.WORLD  # the processes of this tool: each embeds its part of the samples
    if dist.get_rank(group) == 0:
        print(f"grow: {dist.get_world_size(group)} rank(s); rank 0 on {device} (every rank's device bound from its "
              "local rank before the first collective)", flush=True)
    rank0 = dist.get_rank(group) == 0
    parts = None
    if args.init == "imprint" and new > meta["num_classes"]:
        parts = f"{os.path.abspath(args.out_dir).rstrip(os.sep)}.imprint_parts"
        with all_or_none("grow: preparing the imprinting parts folder (rank 0)", group):
            if rank0:
                shutil.rmtree(parts, ignore_errors=True)
                os.makedirs(parts)
        with all_or_none("grow: imprinting (one pass of the backbone)", group):
            imprint_parts(args, raw, xcfg, meta["num_classes"], parts, device)
    report = {}
    try:
        with all_or_none("grow: writing the new checkpoint (rank 0)", group):
            if rank0:
                report = write_grown(args, xcfg, meta, new, parts)
    finally:
        if rank0 and parts:
            shutil.rmtree(parts, ignore_errors=True)
    dist.barrier(group=group)
    if started:
        dist.destroy_process_group()
    return report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load_dir", required=True, help="the checkpoint folder (XCEngine.save_checkpoint's save_dir)")
    p.add_argument("--tag", help="the tag to grow (default: the one in LOAD_DIR/latest)")
    p.add_argument("--out_dir", required=True, help="new folder to write (must not exist or be empty)")
    p.add_argument("--deepspeed_config", required=True, help="the DeepSpeed JSON training continues with: its "
                   "num_classes is C', its data set and backbone are used for imprinting")
    p.add_argument("--num_classes", type=int, help="override extreme_classification.num_classes (C')")
    p.add_argument("--world_size", type=int, help="class shards of the new checkpoint (default: the input's)")
    p.add_argument("--init", choices=["imprint", "random"], default="imprint", help="how new rows start")
    p.add_argument("--imprint_samples", type=int, default=0, help="training samples of the pass, over all "
                   "classes (only the new classes' are embedded; default 16 x C')")
    p.add_argument("--imprint_from_step", type=int, default=0, help="first training step of the data set's "
                   "stream that the pass reads")
    p.add_argument("--imprint_calibration", choices=["match_cosine", "none"], default="match_cosine",
                   help="match_cosine: turn imprinted rows so that their own-class mean cosine equals the old "
                   "rows' (ds_xc/head/imprint.py); none: the plain normalised class means")
    p.add_argument("--imprint_old_samples", type=int, default=4096, help="old-class samples of the pass embedded "
                   "for the calibration (over all ranks)")
    p.add_argument("--retire", action="store_true", help="allow num_classes < C: drop the last classes")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config key")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    args = p.parse_args(argv)
    args.max_steps = args.data = args.eval_every = None  # what train.build_config also reads
    if args.imprint_samples < 0 or args.imprint_from_step < 0:
        p.error(f"--imprint_samples {args.imprint_samples} / --imprint_from_step {args.imprint_from_step}: "
                "must be >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        report = grow(args)
    except (GrowError, CheckpointError, reshard_tool.ReshardError, FileNotFoundError) as exc:
        raise SystemExit(f"grow: {exc}") from None
    if report:  # rank 0
        print(f"grew {os.path.join(args.load_dir, report['tag'])} from {report['old_num_classes']} to "
              f"{report['num_classes']} classes on {report['world_size']} rank(s) into {args.out_dir}")
        for note in report["notes"]:
            print(f"  {note}")
        ranks = f"--num_gpus {report['world_size']} " if report["world_size"] > 1 else ""
        print(f"continue with: deepspeed {ranks}launch/train.py --deepspeed_config {args.deepspeed_config} "
              f"--save_dir {args.out_dir} --resume")
    return report


if __name__ == "__main__":
    main()
