"""The main job: train a backbone + class-parallel head with DeepSpeed on built-in data.

    deepspeed launch/train.py                                   # configs/default.json, 1 process
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/X.json
    torchrun --nproc_per_node 2 launch/train.py --max_steps 100

The DeepSpeed JSON holds the engine's sections, the head (``extreme_classification``)
and this job (``xc_train``); the flags below override the file. Only rank 0 prints.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import ds_xc  # noqa: E402
from ds_xc.data import build_dataset  # noqa: E402
from ds_xc.engine import describe_comm_failure, init_distributed, is_comm_failure, load_raw_config  # noqa: E402
from ds_xc.evaluate import evaluate_topk  # noqa: E402
from ds_xc.parallel.agree import all_or_none  # noqa: E402
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
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save_dir")
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
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
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
    init_distributed(timeout_s=tcfg.comm_timeout_s)  # a lost peer fails collectives after this long at most
    rank, world = dist.get_rank(), dist.get_world_size()
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


def _train(args, raw: dict, xcfg, rank: int, world: int) -> dict:
    tcfg, hcfg = xcfg.xc_train, xcfg.extreme_classification
    if tcfg.data in ("text", "corpus"):
        say(f"preparing the {tcfg.data} data set (tokenising, cached afterwards; corpus fetches "
            "Debian packages the first time)...")
    elif tcfg.data == "glyphs":
        say("preparing the glyphs data set (fonts fetched from Debian and rendered once, about 3 minutes; "
            "cached afterwards)...")
    if rank != 0:
        dist.barrier()  # rank 0 builds any cache first
    data_kwargs = {"context": tcfg.context} if tcfg.data in ("text", "corpus") else {}
    if tcfg.data == "corpus":
        data_kwargs.update(mode=tcfg.corpus_mode, vocab_size=tcfg.corpus_vocab_size or None)
    data = build_dataset(tcfg.data, hcfg.num_classes, seed=tcfg.seed, **data_kwargs)
    if rank == 0:
        dist.barrier()
    torch.manual_seed(tcfg.seed)
    backbone = build_backbone(data, hcfg.embedding_dim, hidden_dim=tcfg.hidden_dim)
    xc = ds_xc.initialize(model=backbone, config=raw)
    _PEERS.update(peers=xc.peers, xc=xc)
    micro, gas = xc.engine.train_micro_batch_size_per_gpu(), xc.engine.gradient_accumulation_steps()
    cast = torch.bfloat16 if xc.engine.bfloat16_enabled() and data.input_kind in ("dense", "image") else None

    start = 0
    if args.resume:
        if not args.save_dir:
            raise SystemExit("--resume needs --save_dir")
        state = xc.load_checkpoint(args.save_dir)
        start = state["step"] if state else 0
        say(f"resumed from {args.save_dir} at step {start}" if state else "no checkpoint found; starting fresh")
    say(f"ds_xc: {data.describe()['name']} data, {hcfg.num_classes} classes on {world} rank(s), "
        f"loss={hcfg.loss.type}, sampler={hcfg.sampler.type}, global batch {micro * gas * world}, "
        f"steps {start}->{tcfg.max_steps}")

    def evaluate() -> dict:
        xc.eval()
        embed = (lambda x: xc.engine(x.to(cast))) if cast else xc.engine
        with xc.in_phase("evaluation"):
            res = evaluate_topk(embed, xc.head, data.eval_batches(micro, rank, world, tcfg.eval_samples),
                                device=xc.engine.device)
        xc.train()
        return res

    def verify() -> dict:
        """TAR at FAR 1e-3 / 1e-4 on the data set's held-out designs (rank 0; the backbone is replicated)."""
        res = {}
        with all_or_none("verification on rank 0", dist.group.WORLD):  # rank 0 failing must not leave the others waiting
            if rank == 0:
                from ds_xc.evaluate import verification
                xc.eval()
                images, labels, designs = data.verification_set()
                res = verification(lambda x: xc.engine(x.to(xc.engine.device).to(cast) if cast else
                                                       x.to(xc.engine.device)), images, labels, designs)
                xc.train()
        return res

    def save(step: int) -> None:
        if args.save_dir:
            xc.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"step": step})

    def compression_stats() -> dict:
        if xc.compression is None:
            return {}
        return {k: v for k, v in xc.compression.stats().items() if isinstance(v, (int, float))}

    bar = None
    if rank == 0:
        from tqdm import tqdm
        tty = sys.stdout.isatty()  # in a log file, a line every 30 s instead of every update
        bar = tqdm(total=tcfg.max_steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stdout,
                   mininterval=0.5 if tty else 30.0, maxinterval=60.0 if tty else 120.0)
    monitor = xc.engine.monitor if getattr(xc.engine.monitor, "enabled", False) else None
    t0, samples, ev, history = time.perf_counter(), 0, {}, []
    for step in range(start, tcfg.max_steps):
        for m in range(gas):
            x, y = data.train_batch(step * gas + m, micro, rank, world)
            x, y = x.to(xc.engine.device), y.to(xc.engine.device)
            loss = xc.forward_backward(x.to(cast) if cast else x, y)  # overlapped when configured
            xc.step()
        samples += micro * gas * world
        done = step + 1
        if done % tcfg.log_every == 0 or done == tcfg.max_steps:
            rate = samples / (time.perf_counter() - t0)
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", samples_s=f"{rate:.0f}", **{
                    k: f"{v:.3f}" for k, v in ev.items() if k.startswith("top")})
            if monitor is not None:
                stats = [(f"Sampler/{k}", float(v), done) for k, v in xc.head.sampler_stats().items()]
                stats += [(f"Compression/{k}", float(v), done) for k, v in compression_stats().items()]
                stats += [(f"Overlap/{k}", float(v), done) for k, v in xc.overlap_stats().get("last", {}).items()]
                monitor.write_events([("Train/loss", loss.item(), done), ("Train/samples_per_s", rate, done)]
                                     + stats)
        if bar is not None:
            bar.update(1)
        if tcfg.eval_every and done % tcfg.eval_every == 0 and done != tcfg.max_steps:
            ev = evaluate()
            history.append(dict(ev, step=done, loss=loss.item(), seconds=time.perf_counter() - t0))
            if bar is not None:
                bar.write(f"step {done}: loss {loss.item():.4f}, held-out top-1 {ev['top1']:.4f} "
                          f"top-5 {ev['top5']:.4f}")
            if monitor is not None:
                monitor.write_events([(f"Eval/{k}", v, done) for k, v in ev.items() if k.startswith("top")])
        if tcfg.save_every and done % tcfg.save_every == 0 and done != tcfg.max_steps:
            save(done)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    ev = evaluate()
    verified = verify() if hasattr(data, "verification_set") else {}
    final_loss = loss.item() if tcfg.max_steps > start else float("nan")
    history.append(dict(ev, step=tcfg.max_steps, loss=final_loss, seconds=elapsed))
    save(tcfg.max_steps)
    summary = {"steps": tcfg.max_steps - start, "samples_per_s": samples / max(elapsed, 1e-9),
               "top1": ev["top1"], "top5": ev["top5"], "eval_samples": ev["samples"],
               "final_loss": final_loss, "seconds": elapsed, "world_size": world,
               "evals": history, "sampler_stats": xc.head.sampler_stats(),
               "compression_stats": compression_stats(), "overlap_stats": xc.overlap_stats().get("mean", {}),
               "verification": verified,
               "reliability": xc.stats()}
    if args.summary_json and rank == 0:
        with open(args.summary_json, "w") as fh:
            json.dump(summary, fh, indent=1)
    say(f"done: {summary['steps']} steps in {elapsed:.1f} s, {summary['samples_per_s']:.0f} samples/s, "
        f"final loss {summary['final_loss']:.4f}, held-out top-1 {ev['top1']:.4f} top-5 {ev['top5']:.4f} "
        f"({ev['samples']} samples)")
    if verified:
        say(f"verification on held-out designs: TAR {verified['tar@far=0.001']:.4f} at FAR 1e-3, "
            f"{verified['tar@far=0.0001']:.4f} at FAR 1e-4 ({verified['genuine_pairs']} genuine, "
            f"{verified['impostor_pairs']} impostor pairs)")
    comp = summary["compression_stats"]
    if comp:
        say(f"gradient compression ({xcfg.gradient_compression.method}): density {comp.get('density', 0):.4f}, "
            f"{comp.get('bytes_sent', 0) / 2**20:.1f} MiB sent by rank 0 "
            f"({comp.get('bytes_sent', 0) / max(comp.get('dense_bytes', 0), 1):.4f} of a dense all-reduce)")
    if xc.stats()["skipped_steps"]:
        say(f"skipped {xc.stats()['skipped_steps']} optimizer step(s) with NaN/Inf loss or gradients "
            f"(extreme_classification.nonfinite='skip'); see the warnings in the log")
    ov = summary["overlap_stats"]
    if ov:
        say(f"overlap pipeline ({hcfg.overlap.num_chunks} chunks): per micro-step {ov['step_s'] * 1e3:.1f} ms, of "
            f"which communication exposed {ov['exposed_s'] * 1e3:.1f} ms ({ov['issued']:.0f} collectives, "
            f"{ov['issued_mb']:.2f} MiB issued)")
    dist.barrier()
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
