"""One rank of a launch/train.py-style job with the backbone's reduction compressed (or not).

Started once per rank with the launcher variables in the environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; optionally GLOO_SOCKET_IFNAME), by compression_accuracy.py on
127.0.0.1 and by netns.sh inside network namespaces. It builds exactly what
launch/train.py builds from a DeepSpeed JSON (data, backbone, ``ds_xc.initialize``: the
engine plus the class-parallel head), then, unless ``--method dense`` or ``dense_rows``
(the same dense mean with the embedding table sent as its nonzero rows:
``extreme_classification.topology.sparse_rows``), attaches the compressed optimizer to the
engine (``ds_xc.compression.attach_to_engine``). Same data order and steps as train.py.
``--eval_every N`` records held-out top-1 every N steps against the training time so far
(barrier to barrier, evaluations left out); ``--target T`` stops at the first evaluation
that reaches top-1 T (time to accuracy, benchmarks/time_to_accuracy.py). Rank 0 writes a
JSON summary to ``--out`` (loss per step, the evaluations, and the L2 norm of every backbone
parameter every NORM_EVERY steps, ``param_norms``: how far each tensor moved, for diagnosis):

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29600 \\
        python benchmarks/compression_train.py --config configs/text_exact_20k.json --method topk --steps 20 --out -
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_worker  # noqa: E402

METHODS = ("dense", "dense_rows", "none", "topk", "randomk", "bayes_prior", "powersgd")
NORM_EVERY = 50  # steps between records of the parameter norms in the result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "text_exact_20k.json"))
    p.add_argument("--method", choices=METHODS, default="bayes_prior",
                   help="dense: DeepSpeed's own all-reduce; dense_rows: ds_xc's bucketed dense mean with embedding "
                   "tables as rows; none: the wrapper's dense path")
    p.add_argument("--compression", default="{}", help="JSON of extra gradient_compression keys")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval", action="store_true", help="held-out top-1/top-5 at the end")
    p.add_argument("--verify", action="store_true",
                   help="also TAR at FAR 1e-3 / 1e-4 on the data set's held-out designs at the end (glyphs)")
    p.add_argument("--eval_samples", type=int, help="override xc_train.eval_samples")
    p.add_argument("--eval_every", type=int, default=0, help="held-out top-1 every N steps (0: only --eval)")
    p.add_argument("--target", type=float, default=0.0, help="stop at the first evaluation with top-1 >= this")
    p.add_argument("--zero_stage", type=int, default=0, help="override zero_optimization.stage")
    p.add_argument("--seed", type=int, help="override xc_train.seed and extreme_classification.seed")
    p.add_argument("--skip_steps", type=int, default=5, help="steps left out of the step-time median")
    p.add_argument("--out", default="-", help="JSON result of rank 0 ('-': stdout)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import ds_xc
    from ds_xc.compression import attach_to_engine
    from ds_xc.data import build_task_data
    from ds_xc.engine import init_distributed, load_raw_config
    from ds_xc.evaluate import evaluate_topk, verification
    from ds_xc.models import build_backbone
    from ds_xc.parallel.agree import all_or_none

    init_distributed(timeout_s=600)
    rank, world = dist.get_rank(), dist.get_world_size()
    raw = load_raw_config(args.config)
    raw.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    raw.pop("gradient_compression", None)  # attached explicitly below
    if args.method == "dense_rows":
        raw.setdefault("extreme_classification", {}).setdefault("topology", {})["sparse_rows"] = True
    if args.eval_samples:
        raw.setdefault("xc_train", {})["eval_samples"] = args.eval_samples
    if args.seed is not None:
        raw.setdefault("xc_train", {})["seed"] = args.seed
        raw.setdefault("extreme_classification", {})["seed"] = args.seed
    xcfg = ds_xc.parse_config(raw)
    tcfg, hcfg = xcfg.xc_train, xcfg.extreme_classification
    data = build_task_data(tcfg, hcfg.num_classes, rank=rank, group=dist.group.WORLD)
    torch.manual_seed(tcfg.seed)
    backbone = build_backbone(data, hcfg.embedding_dim, hidden_dim=tcfg.hidden_dim)
    xc = ds_xc.initialize(model=backbone, config=raw)
    comp = None
    if args.method not in ("dense", "dense_rows"):
        section = dict({"method": args.method, "density": args.density}, **json.loads(args.compression))
        if args.seed is not None:
            section.setdefault("seed", args.seed)
        comp = attach_to_engine(xc.engine, section)
        xc.compression = comp  # XCEngine's non-finite check and skip must know it (ZeRO-1: .grad stays local)
    micro, gas = xc.engine.train_micro_batch_size_per_gpu(), xc.engine.gradient_accumulation_steps()
    cast = torch.bfloat16 if xc.engine.bfloat16_enabled() and data.input_kind in ("dense", "image") else None

    def evaluate() -> dict:
        xc.eval()
        embed = (lambda x: xc.engine(x.to(cast))) if cast else xc.engine
        ev = evaluate_topk(embed, xc.head, data.eval_batches(micro, rank, world, tcfg.eval_samples),
                           device=xc.engine.device)
        xc.train()
        return ev

    times, losses, curve, reduced_bytes = [], [], [], 0.0
    norms = {"step": []}  # the backbone's parameter norms every NORM_EVERY steps (diagnostics)

    def record_norms(done: int) -> None:
        norms["step"].append(done)
        for name, p in backbone.named_parameters():
            norms.setdefault(name, []).append(float(p.detach().float().norm()))

    record_norms(0)
    for step in range(args.steps):
        dist.barrier()  # step time = the slowest rank's
        t0 = time.perf_counter()
        for m in range(gas):
            x, y = data.train_batch(step * gas + m, micro, rank, world)
            loss = xc(x.to(cast) if cast else x, y)
            xc.backward(loss)
            xc.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if (step + 1) % NORM_EVERY == 0 or step + 1 == args.steps:
            record_norms(step + 1)
        if args.method == "dense_rows" and xc.grad_reducer is not None:
            reduced_bytes += xc.grad_reducer.bytes_sent
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            ev = evaluate()  # the same numbers on every rank: they all stop at the same step
            curve.append({"step": step + 1, "train_s": sum(times), "top1": ev["top1"], "top5": ev["top5"],
                          "samples": ev["samples"]})
            if rank == 0:
                print(f"step {step + 1}: top-1 {ev['top1']:.4f} at {sum(times):.1f} s", flush=True)
            if args.target and ev["top1"] >= args.target:
                break
    result = {"method": args.method, "density": args.density, "world": world, "steps": len(times),
              "torch": torch.__version__,
              "config": os.path.relpath(args.config, ROOT), "data": tcfg.data, "num_classes": hcfg.num_classes,
              "backbone_numel": sum(p.numel() for p in backbone.parameters()),
              "backbone_dtype": str(next(backbone.parameters()).dtype).replace("torch.", ""),
              "step_s": statistics.median(times[args.skip_steps:] or times), "final_loss": losses[-1],
              "loss_last10": statistics.fmean(losses[-10:]), "first_loss": losses[0], "losses": losses, "curve": curve,
              "param_norms": norms,
              "train_s": sum(times), "first_step_s": times[0]}
    if args.method == "dense_rows":
        result["bytes_sent"] = reduced_bytes
    if comp is not None:
        stats = comp.stats()
        stats.pop("last", None)
        result["compression"] = stats
        result["compression_config"] = comp.config.model_dump()
        result["frozen_variance"] = bool(getattr(comp, "frozen_variance", False))
        if comp.step_check.verdict is not None:  # gradient_compression.link_gbit_per_s > 0: the step check
            result["step_check"] = comp.step_check.verdict.summary()
    if args.eval:
        ev = curve[-1] if curve and curve[-1]["step"] == len(times) else evaluate()
        result.update(top1=ev["top1"], top5=ev["top5"], eval_samples=ev["samples"])
    if args.verify and hasattr(data, "verification_set"):  # as launch/train.py: rank 0, the backbone is replicated
        with all_or_none("verification on rank 0", dist.group.WORLD):
            if rank == 0:
                xc.eval()
                images, labels, designs = data.verification_set()
                result["verification"] = verification(lambda x: xc.engine(x.to(cast) if cast else x),
                                                      images, labels, designs)
    # drop the engine (its reducers hold process-group work) while the interpreter is whole: left to
    # teardown after the group is destroyed, a finished 10 Gbit/s dense_rows run once aborted (exit -6)
    del xc, comp, data, backbone, evaluate
    gc.collect()
    return finish_worker(result, args.out, indent=1)


if __name__ == "__main__":
    main()
