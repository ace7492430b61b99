"""The main job: train a backbone + class-parallel head with DeepSpeed on built-in data.

    deepspeed launch/train.py                                   # configs/default.json, 1 process
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/X.json
    torchrun --nproc_per_node 2 launch/train.py --max_steps 100
    deepspeed launch/train.py --save_dir ckpt --max_steps 2000 --resume   # from ckpt/latest (must exist)
    deepspeed launch/train.py --save_dir ckpt --resume auto                # from ckpt/latest, or from step 0

The DeepSpeed JSON holds the engine's sections, the head (``extreme_classification``)
and this job (``xc_train``); the flags below override the file. Only rank 0 prints.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import ds_xc  # noqa: E402
from ds_xc.config import ConfigError, parse_json  # noqa: E402
from ds_xc.cost import process_memory  # noqa: E402
from ds_xc.data import build_task_data  # noqa: E402
from ds_xc.engine import describe_comm_failure, init_distributed, is_comm_failure, load_raw_config  # noqa: E402
from ds_xc.evaluate import evaluate_topk  # noqa: E402
from ds_xc.parallel.agree import all_or_none  # noqa: E402
from ds_xc.parallel.groups import comm_device  # noqa: E402
from ds_xc.tune.measure import release_free_memory  # noqa: E402
from ds_xc.models import build_backbone  # noqa: E402

EXIT_PEER_LOST = 3  # exit status of a rank whose peer died or stopped answering
_PEERS: dict = {}  # once the engine is up: "peers" (hostname, pid) of every rank, names a lost peer; "xc" the engine
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", default=DEFAULT_CONFIG, help="DeepSpeed JSON with ds_xc sections")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--max_steps", type=int, help="override xc_train.max_steps")
    p.add_argument("--data", choices=["text", "synthetic", "corpus"], help="override xc_train.data")
    p.add_argument("--num_classes", type=int, help="override extreme_classification.num_classes")
    p.add_argument("--eval_every", type=int, help="override xc_train.eval_every (0: only at the end)")
    p.add_argument("--save_dir", help="checkpoint folder (saved at the end and every xc_train.save_every)")
    p.add_argument("--resume", nargs="?", const="required", choices=["required", "auto"],
                   help="continue from the latest checkpoint in --save_dir; a folder without one (empty, "
                   "mistyped) is an error, unless `--resume auto`, which then starts from step 0 (and says so)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override any config key, e.g. --set extreme_classification.sampler.type=ann "
                   "(VALUE is read as JSON when it parses, else as a string; repeatable)")
    p.add_argument("--summary_json", help="write the final summary and the evaluation history to this file")
    p.add_argument("--verbose", action="store_true", help="show DeepSpeed's and ds_xc's INFO logs")
    return p.parse_args(argv)


def apply_override(raw: dict, item: str) -> None:
    """Set ``a.b.c=VALUE`` in the nested config dict (intermediate objects are created)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set expects KEY.PATH=VALUE, got {item!r}")
    try:
        parsed = parse_json(value, f"--set {key}")  # a key given twice in the value is refused
    except json.JSONDecodeError:
        parsed = value
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SystemExit(f"--set {item!r}: {part!r} is not an object in the config")
    node[parts[-1]] = parsed


def build_config(args) -> dict:
    raw = load_raw_config(args.deepspeed_config)
    head, train = raw.setdefault("extreme_classification", {}), raw.setdefault("xc_train", {})
    for key, section, value in [("num_classes", head, args.num_classes), ("max_steps", train, args.max_steps),
                                ("data", train, args.data), ("eval_every", train, args.eval_every)]:
        if value is not None:
            section[key] = value
    for item in args.set:
        apply_override(raw, item)
    return raw


def say(*msg) -> None:
    if dist.get_rank() == 0:
        print(*msg, flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if not args.verbose:
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    raw = build_config(args)
    xcfg = ds_xc.parse_config(raw)
    tcfg = xcfg.xc_train
    # binds cuda:LOCAL_RANK first (before the data barrier and initialize's agreement); a lost peer fails
    # collectives after comm_timeout_s at most
    device = init_distributed(timeout_s=tcfg.comm_timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    say(f"ds_xc: {world} rank(s); rank 0 on {device} (every rank's device bound from its local rank before its "
        "first collective)")
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores between the ranks of this machine
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    try:
        return _train(args, raw, xcfg, rank, world)
    except Exception as exc:
        if world == 1:
            raise
        xc = _PEERS.get("xc")
        where = xc.where() if xc is not None else "during setup"
        if not is_comm_failure(exc):  # this rank's own error (e.g. a full disk): name it, then raise
            print(f"ds_xc: rank {rank} of {world}: {type(exc).__name__} {where}: {exc}", file=sys.stderr, flush=True)
            raise
        # a peer died or hangs: say so on every surviving rank (rank 0 may be the one gone), and
        # leave at once: destroying the process group would wait for the lost peer
        print(f"ds_xc: {describe_comm_failure(exc, _PEERS.get('peers'), tcfg.comm_timeout_s, where)}; the last "
              f"checkpoint in {args.save_dir or '(no --save_dir)'} is intact; exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)


@dataclass
class Job:
    """What one run of the job holds: its config, data, engine, progress and results so far."""
    args: argparse.Namespace
    raw: dict
    xcfg: Any
    rank: int
    world: int
    data: Any = None
    xc: Any = None
    micro: int = 0
    gas: int = 0
    cast: Optional[torch.dtype] = None  # bf16 inputs for dense/image data when bf16 is on
    start: int = 0  # the first step to run (after a resume)
    sample_base: int = 0  # global training samples consumed before ``start`` (the data stream's position)
    bar: Any = None  # rank 0's progress bar
    monitor: Any = None  # DeepSpeed's monitor, when enabled
    t0: float = 0.0
    samples: int = 0
    loss: Any = None  # the last micro-step's loss
    ev: dict = field(default_factory=dict)  # the latest evaluation
    history: list = field(default_factory=list)
    step_s: list = field(default_factory=list)  # wall time of each training step
    memory: dict = field(default_factory=dict)  # this rank's RSS / VmHWM at the job's milestones (bytes)

    @property
    def tcfg(self):
        return self.xcfg.xc_train

    @property
    def hcfg(self):
        return self.xcfg.extreme_classification


def _train(args, raw: dict, xcfg, rank: int, world: int) -> dict:
    """Set up, run the steps (each: train, log, evaluate and save when due), then summarise."""
    job = Job(args=args, raw=raw, xcfg=xcfg, rank=rank, world=world)
    job.memory["baseline"] = process_memory()["rss"]  # torch, deepspeed and the process group, nothing of ours
    job = _setup(job)
    job.memory["after_setup"] = process_memory()["rss"]
    for step in range(job.start, job.tcfg.max_steps):
        began = time.perf_counter()
        _train_step(job, step)
        job.step_s.append(time.perf_counter() - began)
        done = step + 1
        _log_progress(job, done)
        if job.bar is not None:
            job.bar.update(1)
        if job.tcfg.eval_every and done % job.tcfg.eval_every == 0 and done != job.tcfg.max_steps:
            _periodic_evaluation(job, done)
        if job.tcfg.save_every and done % job.tcfg.save_every == 0 and done != job.tcfg.max_steps:
            _save(job, done)
    summary = _finish(job)
    _print_summary(job, summary)
    _release(job)
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _release(job: Job) -> None:
    """Drop the engine, the data and every tensor they hold while the interpreter is whole.

    Left to interpreter teardown, objects holding process-group handles and pending work are
    destroyed in no fixed order after Python's own state is gone, which once aborted a finished
    1-rank run ("terminate called without an active exception", exit -6).
    """
    _PEERS.clear()
    job.xc = job.data = job.bar = job.monitor = job.loss = None
    gc.collect()


# ---------------------------------------------------------------------- setup
def _build_data(tcfg, hcfg, rank: int):
    """The data set, rank 0 first (it builds any cache), the other ranks after it."""
    if tcfg.data in ("text", "corpus"):
        say(f"preparing the {tcfg.data} data set (tokenising, cached afterwards; corpus fetches "
            "Debian packages the first time)...")
    elif tcfg.data == "glyphs":
        say("preparing the glyphs data set (fonts fetched from Debian and rendered once, about 3 minutes; "
            "cached afterwards)...")
    return build_task_data(tcfg, hcfg.num_classes, rank=rank, group=dist.group.WORLD)


def _per_step(job: Job) -> int:
    """Global training samples one optimizer step consumes."""
    return job.micro * job.gas * job.world


def _resume(job: Job) -> int:
    """The step to start from: the checkpoint's (--resume), else 0; sets ``job.sample_base``.

    Every rank gets the same client state (the load is agreed), so every rank refuses alike."""
    args, max_steps = job.args, job.tcfg.max_steps
    if not args.resume:
        return 0
    if not args.save_dir:
        raise SystemExit("--resume needs --save_dir")
    state = job.xc.load_checkpoint(args.save_dir)
    if not state:
        why = "the folder does not exist" if not os.path.isdir(args.save_dir) else "it holds no 'latest'"
        if args.resume != "auto":
            raise SystemExit(f"--resume: no checkpoint in --save_dir {os.path.abspath(args.save_dir)!r} ({why}); "
                             "check the folder name, or pass `--resume auto` to start from step 0 when there is "
                             "no checkpoint")
        say(f"--resume auto: no checkpoint in {args.save_dir} ({why}); starting from step 0")
        return 0
    start = int(state["step"])
    if start > max_steps:
        raise SystemExit(f"--resume: the checkpoint in {args.save_dir} is at step {start}, past max_steps="
                         f"{max_steps} (--max_steps / xc_train.max_steps): there is nothing to train, and saving "
                         f"would put step-{start} weights under the tag step{max_steps}. Nothing was run or saved; "
                         f"set max_steps above {start} to continue")
    # the data stream's position: samples consumed (saved since it existed), else the step at this batch size
    job.sample_base = int(state.get("samples", start * _per_step(job)))
    moved = "" if job.sample_base == start * _per_step(job) else \
        " (another world size or batch than when saved: the data stream continues at that sample)"
    say(f"resumed from {args.save_dir} at step {start}, data stream at sample {job.sample_base}{moved}")
    return start


def _setup(job: Job) -> Job:
    """Data, backbone, engine (ds_xc.initialize), resume, the banner and rank 0's progress bar."""
    tcfg, hcfg = job.tcfg, job.hcfg
    job.data = data = _build_data(tcfg, hcfg, job.rank)
    torch.manual_seed(tcfg.seed)
    backbone = build_backbone(data, hcfg.embedding_dim, hidden_dim=tcfg.hidden_dim)
    job.xc = xc = ds_xc.initialize(model=backbone, config=job.raw)
    _PEERS.update(peers=xc.peers, xc=xc)
    job.micro, job.gas = xc.engine.train_micro_batch_size_per_gpu(), xc.engine.gradient_accumulation_steps()
    job.cast = torch.bfloat16 if xc.engine.bfloat16_enabled() and data.input_kind in ("dense", "image") else None
    job.start = _resume(job)
    say(f"ds_xc: {data.describe()['name']} data, {hcfg.num_classes} classes on {job.world} rank(s), "
        f"loss={hcfg.loss.type}, sampler={hcfg.sampler.type}, global batch {job.micro * job.gas * job.world}, "
        f"steps {job.start}->{tcfg.max_steps}")
    if job.rank == 0:
        from tqdm import tqdm
        tty = sys.stdout.isatty()  # in a log file, a line every 30 s instead of every update
        job.bar = tqdm(total=tcfg.max_steps, initial=job.start, unit="step", dynamic_ncols=True, file=sys.stdout,
                       mininterval=0.5 if tty else 30.0, maxinterval=60.0 if tty else 120.0)
    job.monitor = xc.engine.monitor if getattr(xc.engine.monitor, "enabled", False) else None
    job.t0 = time.perf_counter()
    return job


# ---------------------------------------------------------------------- one step
def _train_step(job: Job, step: int) -> None:
    """One optimizer step: ``gas`` micro-steps of forward, backward and xc.step()."""
    xc = job.xc
    for m in range(job.gas):  # micro-steps counted from the resume, samples from the stream's saved position
        x, y = job.data.train_batch((step - job.start) * job.gas + m, job.micro, job.rank, job.world,
                                    sample_offset=job.sample_base)
        x, y = x.to(xc.engine.device), y.to(xc.engine.device)
        job.loss = xc.forward_backward(x.to(job.cast) if job.cast else x, y)  # overlapped when configured
        xc.step()
    job.samples += job.micro * job.gas * job.world


def _compression_stats(xc) -> dict:
    if xc.compression is None:
        return {}
    return {k: v for k, v in xc.compression.stats().items() if isinstance(v, (int, float))}


def _log_progress(job: Job, done: int) -> None:
    """Every log_every steps (and the last): the bar's loss and rate, DeepSpeed's monitor events."""
    if not (done % job.tcfg.log_every == 0 or done == job.tcfg.max_steps):
        return
    xc, loss = job.xc, job.loss
    rate = job.samples / (time.perf_counter() - job.t0)
    if job.bar is not None:
        job.bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{_lr(job):.3g}", samples_s=f"{rate:.0f}", **{
            k: f"{v:.3f}" for k, v in job.ev.items() if k.startswith("top")})
    if job.monitor is not None:
        stats = [(f"Sampler/{k}", float(v), done) for k, v in xc.head.sampler_stats().items()]
        stats += [(f"Compression/{k}", float(v), done) for k, v in _compression_stats(xc).items()]
        stats += [(f"Overlap/{k}", float(v), done) for k, v in xc.overlap_stats().get("last", {}).items()]
        job.monitor.write_events([("Train/loss", loss.item(), done), ("Train/samples_per_s", rate, done)]
                                 + stats)


# ---------------------------------------------------------------------- evaluation and checkpoints
def _evaluate(job: Job) -> dict:
    """Held-out top-k over all classes (every rank)."""
    xc, cast = job.xc, job.cast
    xc.eval()
    embed = (lambda x: xc.engine(x.to(cast))) if cast else xc.engine
    with xc.in_phase("evaluation"):
        res = evaluate_topk(embed, xc.head, job.data.eval_batches(job.micro, job.rank, job.world,
                                                                  job.tcfg.eval_samples), device=xc.engine.device,
                            split=job.tcfg.eval_class_split or None)  # old / new classes of a grown set
    xc.train()
    return res


def _verify(job: Job) -> dict:
    """TAR at FAR 1e-3 / 1e-4 on the data set's held-out designs (rank 0; the backbone is replicated)."""
    xc, cast, res = job.xc, job.cast, {}
    with all_or_none("verification on rank 0", dist.group.WORLD):  # rank 0 failing must not leave the others waiting
        if job.rank == 0:
            from ds_xc.evaluate import verification
            xc.eval()
            images, labels, designs = job.data.verification_set()
            res = verification(lambda x: xc.engine(x.to(xc.engine.device).to(cast) if cast else
                                                   x.to(xc.engine.device)), images, labels, designs)
            xc.train()
    return res


def _lr(job: Job) -> float:
    """The backbone's lr for the coming step (the head's follows it with lr_schedule follow_engine)."""
    return float(job.xc.engine.get_lr()[0])


def _periodic_evaluation(job: Job, done: int) -> None:
    job.ev = ev = _evaluate(job)
    job.xc.observe_metric(ev["top1"])  # an adaptive_lr schedule decides on it at the next step
    loss = job.loss.item()
    job.history.append(dict(ev, step=done, loss=loss, lr=_lr(job), seconds=time.perf_counter() - job.t0))
    if job.bar is not None:
        job.bar.write(f"step {done}: loss {loss:.4f}, lr {_lr(job):.4g}, held-out top-1 {ev['top1']:.4f} "
                      f"top-5 {ev['top5']:.4f}")
    if job.monitor is not None:
        job.monitor.write_events([(f"Eval/{k}", v, done) for k, v in ev.items() if k.startswith("top")])


def _samples_at(job: Job, step: int) -> int:
    """Global training samples consumed once ``step`` steps are done."""
    return job.sample_base + (step - job.start) * _per_step(job)


def _save(job: Job, step: int) -> None:
    """Checkpoint ``step``: the client state holds the step and the samples consumed (the data position,
    which survives a reshard to another world size)."""
    if job.args.save_dir:
        job.xc.save_checkpoint(job.args.save_dir, tag=f"step{step}",
                               client_state={"step": step, "samples": _samples_at(job, step)})


# ---------------------------------------------------------------------- the end
def _active_share(job: Job) -> Optional[dict]:
    """Active classes per step over every rank's shard, and their share of the classes (per
    sample group of the ann sampler), at the last training step; the exact head: every class.
    None when a sampled head ran no training step here (nothing measured)."""
    head = job.xc.head
    groups = getattr(head.sampler_config, "groups", 1)
    stats = head.sampler_stats()
    if head.sampler_config.type != "full" and "active" not in stats:
        return None
    active = torch.tensor([float(stats.get("active", head.num_local * groups))], dtype=torch.float64,
                          device=comm_device(head.group))  # NCCL reduces CUDA tensors only
    dist.all_reduce(active, group=head.group)  # shards of the head's group -> all its classes
    per_group = active.item() / groups
    return {"active_classes": per_group, "share": per_group / job.hcfg.num_classes}


def _finish(job: Job) -> dict:
    """The final evaluation, verification and checkpoint; returns the summary (written to --summary_json)."""
    elapsed = time.perf_counter() - job.t0
    if job.bar is not None:
        job.bar.close()
    job.memory["training_peak"] = process_memory()["peak"]
    release_free_memory()  # what the process holds, not the heap pages the allocator kept from freed batches
    job.memory["after_training"] = process_memory()["rss"]
    ev = job.ev = _evaluate(job)
    job.memory["peak"] = process_memory()["peak"]
    verified = _verify(job) if hasattr(job.data, "verification_set") else {}
    final_loss = job.loss.item() if job.tcfg.max_steps > job.start else float("nan")
    job.history.append(dict(ev, step=job.tcfg.max_steps, loss=final_loss, lr=_lr(job), seconds=elapsed))
    if job.tcfg.max_steps > job.start:
        _save(job, job.tcfg.max_steps)
    elif job.args.save_dir:  # resumed at max_steps: the checkpoint already holds this state
        say(f"nothing to train (resumed at step {job.start} = max_steps); the checkpoint is not saved again")
    xc = job.xc
    summary = {"steps": job.tcfg.max_steps - job.start, "samples_per_s": job.samples / max(elapsed, 1e-9),
               "sampler": job.hcfg.sampler.type, "num_classes": job.hcfg.num_classes, "active": _active_share(job),
               "top1": ev["top1"], "top5": ev["top5"], "eval_samples": ev["samples"],
               "final_loss": final_loss, "final_lr": _lr(job), "seconds": elapsed, "world_size": job.world,
               "device": str(xc.engine.device), "head_device": str(xc.head.weight.device),
               "evals": job.history, "sampler_stats": xc.head.sampler_stats(),
               "compression_stats": _compression_stats(xc), "overlap_stats": xc.overlap_stats().get("mean", {}),
               "verification": verified,
               "data_samples": {"start": job.sample_base, "end": _samples_at(job, job.tcfg.max_steps)},
               "reliability": xc.stats(), **{k: v for k, v in ev.items() if k.endswith(("_old", "_new"))},
               "ranks": _rank_report(job)}
    if job.args.summary_json and job.rank == 0:
        with open(job.args.summary_json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return summary


def _rank_report(job: Job) -> list:
    """Per rank (gathered over the world): its memory milestones (bytes: ``baseline`` after the imports and
    the process group, ``after_setup`` with the engine and head built, ``after_training`` (freed heap pages handed
    back first: glibc keeps up to ~70 MB of freed batches, which made it vary run to run) before the final
    evaluation, ``training_peak`` and ``peak`` the VmHWM before and after it), the median step time, the
    ANN index build times and the backbone's parameter count (benchmarks/scale_classes.py compares them
    with ds_xc.cost.estimate_memory)."""
    steps = sorted(job.step_s)
    mine = {"rank": job.rank, "memory": dict(job.memory), "step_s_median": steps[len(steps) // 2] if steps else None,
            "index_build_s": list(getattr(job.xc.head.sampler, "build_seconds", [])),
            "num_local": job.xc.head.num_local,
            "backbone_params": sum(p.numel() for p in job.xc.engine.module.parameters())}
    out = [None] * job.world
    dist.all_gather_object(out, mine, group=dist.group.WORLD)
    return out


def _print_summary(job: Job, summary: dict) -> None:
    ev, verified = job.ev, summary["verification"]
    say(f"done: {summary['steps']} steps in {summary['seconds']:.1f} s, {summary['samples_per_s']:.0f} samples/s, "
        f"final loss {summary['final_loss']:.4f}, final lr {summary['final_lr']:.4g}, held-out top-1 {ev['top1']:.4f} "
        f"top-5 {ev['top5']:.4f} ({ev['samples']} samples)")
    if "top1_old" in ev:
        say(f"classes below {job.tcfg.eval_class_split}: top-1 {ev['top1_old']:.4f} ({ev['samples_old']} samples); "
            f"the others: top-1 {ev['top1_new']:.4f} ({ev['samples_new']} samples)")
    say(_head_line(job, summary))
    if verified:
        say(f"verification on held-out designs: TAR {verified['tar@far=0.001']:.4f} at FAR 1e-3, "
            f"{verified['tar@far=0.0001']:.4f} at FAR 1e-4 ({verified['genuine_pairs']} genuine, "
            f"{verified['impostor_pairs']} impostor pairs)")
    comp = summary["compression_stats"]
    if comp:
        say(f"gradient compression ({job.xcfg.gradient_compression.method}): density {comp.get('density', 0):.4f}, "
            f"{comp.get('bytes_sent', 0) / 2**20:.1f} MiB sent by rank 0 "
            f"({comp.get('bytes_sent', 0) / max(comp.get('dense_bytes', 0), 1):.4f} of a dense all-reduce)")
    skipped = job.xc.stats()["skipped_steps"]
    if skipped:
        say(f"skipped {skipped} optimizer step(s) with NaN/Inf loss or gradients "
            f"(extreme_classification.nonfinite='skip'); see the warnings in the log")
    ov = summary["overlap_stats"]
    if ov:
        say(f"overlap pipeline ({job.hcfg.overlap.num_chunks} chunks): per micro-step {ov['step_s'] * 1e3:.1f} ms, "
            f"of which communication exposed {ov['exposed_s'] * 1e3:.1f} ms ({ov['issued']:.0f} collectives, "
            f"{ov['issued_mb']:.2f} MiB issued)")


def _head_line(job: Job, summary: dict) -> str:
    """What the head did: its sampler, the active share of the classes, the held-out accuracy."""
    sampler, active, ev = job.hcfg.sampler, summary["active"], job.ev
    rate = f" (sample_rate {sampler.sample_rate})" if hasattr(sampler, "sample_rate") else " (exact softmax)"
    share = ("active share not measured (no training step)" if active is None else
             f"{active['active_classes']:,.0f} of {summary['num_classes']:,} classes active per step "
             f"(share {active['share']:.4f})")
    return (f"head: {job.hcfg.loss.type} loss, sampler {sampler.type}{rate}, {share}; "
            f"held-out top-1 {ev['top1']:.4f} top-5 {ev['top5']:.4f}")


if __name__ == "__main__":
    main()
