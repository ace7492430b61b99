"""Short jobs run under the communication-device audit (ds_xc/parallel/device_audit.py) on pool ranks.

Each job simulates a host of 8 GPUs on the CPU (the pool's LOCAL_RANK is the rank), starts as a fresh
process would (current device cuda:0, nothing bound) and returns the audit's report. The library-level
jobs bind the device themselves, as a plain torch.distributed user does before building ds_xc's
parts (``torch.cuda.set_device(LOCAL_RANK)``); the engine, grow and tune jobs go through ds_xc's entry
points (``ds_xc.initialize``, launch/grow.py's ``grow``, ``ds_xc.engine.init_distributed``), which
must bind it. tests/test_device_audit_dist.py asserts that no job has a finding.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import types

import torch

import ds_xc
from ds_xc.parallel.device_audit import DeviceAudit

GPUS = 8
C, D, IN, B, SEED = 23, 8, 5, 6, 7
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANN = {"type": "ann", "sample_rate": 0.5, "code_bits": 32, "nlist": 3, "nprobe": 2, "top_k": 3, "rerank": 4,
       "rebuild_interval": 2, "backend": "torch", "metrics_interval": 1}
KNN = {"type": "knn", "sample_rate": 0.4, "neighbors": 3, "rebuild_interval": 2}


def _bind_as_a_user() -> torch.device:
    """What a plain torch.distributed user does first on a GPU host; the rank's device object."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")  # the tensors stay on the CPU; made on a given device object they count as on it


def _batch(step: int, rank: int, dim: int = IN, classes: int = C):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B + rank, dim, generator=g), torch.randint(0, classes, (B + rank,), generator=g)


def engine_config(variant: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": B, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 0},
           "extreme_classification": {"num_classes": C, "embedding_dim": D, "loss": {"type": "cosface"},
                                      "init_std": 0.5, "seed": SEED,
                                      "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}}}
    head = cfg["extreme_classification"]
    if variant == "ann_compression":
        head["sampler"] = dict(ANN)
        cfg["gradient_compression"] = {"method": "bayes_prior", "density": 0.3, "min_numel": 1, "warmup_steps": 1,
                                       "stats_sync_interval": 1}
    elif variant == "knn_overlap":
        head["sampler"] = dict(KNN)
        head["overlap"] = {"enabled": True, "num_chunks": 2, "bucket_size_mb": 1e-5}
    else:
        raise ValueError(variant)
    return cfg


def engine_job(rank: int, world: int, variant: str, path: str) -> dict:
    """ds_xc.initialize, two steps, a checkpoint saved and loaded, the held-out top-k."""
    from ds_xc.evaluate import evaluate_topk
    with DeviceAudit(simulate_gpus=GPUS) as audit:
        torch.manual_seed(SEED)
        body = torch.nn.Linear(IN, D, bias=False)
        xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1),
                              config=engine_config(variant))
        dev = xc.engine.device
        for step in range(2):
            x, y = _batch(step, rank)
            xc.backward(xc(x.to(dev), y.to(dev)))
            xc.step()
        xc.save_checkpoint(path, tag="step2", client_state={"step": 2})
        xc.load_checkpoint(path, tag="step2")
        held = [tuple(t.to(dev) for t in _batch(9, rank))]
        xc.eval()
        evaluate_topk(xc.engine, xc.head, held, device=dev)
    return audit.report()


def head_job(rank: int, world: int) -> dict:
    """The head on its own with each sampler (quality metrics every step), topk, a 2-step optimizer,
    the compression wrapper (dense and PowerSGD) and weight imprinting."""
    from ds_xc.head.imprint import ImprintSums, imprint_rows
    with DeviceAudit(simulate_gpus=GPUS) as audit:
        dev = _bind_as_a_user()
        for sampler in ("full", {"type": "uniform", "sample_rate": 0.5}, ANN, KNN):
            head = ds_xc.ClassParallelHead(D, C, loss="arcface", sampler=sampler, seed=SEED, init_std=0.5,
                                           update="dense", device=dev)
            opt = ds_xc.build_head_optimizer(head, {"type": "adamw", "lr": 0.01, "update": "dense"})
            for step in range(2):
                x, y = _batch(step, rank, D)
                head(x.to(dev), y.to(dev)).backward()
                opt.step()
                opt.zero_grad()
            head.topk(_batch(5, rank, D)[0].to(dev), k=3)
            head.state_dict()
        body = torch.nn.Linear(IN, D).to(dev)
        for comp in ({"method": "none"}, {"method": "powersgd", "powersgd": {"rank": 2}, "min_numel": 1}):
            opt = ds_xc.CompressedOptimizer(torch.optim.SGD(body.parameters(), lr=0.1), comp)
            for step in range(2):
                body(_batch(step, rank)[0].to(dev)).square().sum().backward()
                opt.step()
                opt.zero_grad()
        sums = ImprintSums(C - 5, C, D)
        x, y = _batch(3, rank, D, classes=C)
        sums.add(x.to(dev), y.to(dev))
        sums.add_old(x.to(dev), x.to(dev) + 1.0)
        imprint_rows(sums, None, calibrate=True)
    return audit.report()


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"audit_launch_{name}", os.path.join(ROOT, "launch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grow_config(path: str, num_classes: int) -> str:
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
           "extreme_classification": {"num_classes": num_classes, "embedding_dim": D, "loss": {"type": "cosface"},
                                      "optimizer": {"type": "sgd", "lr": 0.05}},
           "xc_train": {"data": "synthetic", "max_steps": 1, "hidden_dim": 16, "eval_every": 0, "eval_samples": 64}}
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return path


def grow_job(rank: int, world: int, folder: str) -> dict:
    """launch/grow.py's ``grow`` with imprinting on a checkpoint of the built-in backbone (the
    checkpoint is written by an engine outside the audit)."""
    from ds_xc.data import build_dataset, dataset_kwargs
    from ds_xc.models import build_backbone
    grow = _tool("grow")
    small, big = grow_config(os.path.join(folder, f"s{rank}.json"), 20), grow_config(
        os.path.join(folder, f"b{rank}.json"), 26)
    raw = json.load(open(small))
    xcfg = ds_xc.parse_config(raw)
    data = build_dataset("synthetic", 20, seed=xcfg.xc_train.seed, **dataset_kwargs(xcfg.xc_train))
    torch.manual_seed(0)
    body = build_backbone(data, D, hidden_dim=16)
    xc = ds_xc.initialize(model=body, config=raw)
    x, y = data.train_batch(0, 8, rank, world)
    xc.backward(xc(x, y))
    xc.step()
    xc.save_checkpoint(os.path.join(folder, "c1"), tag="step1", client_state={"step": 1})
    args = grow.parse_args(["--load_dir", os.path.join(folder, "c1"), "--out_dir", os.path.join(folder, "c2"),
                            "--deepspeed_config", big, "--imprint_samples", "96", "--imprint_old_samples", "16"])
    import torch.distributed as dist
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # the pool's group outlives the tool's run
    try:
        with DeviceAudit(simulate_gpus=GPUS) as audit:
            grow.grow(args)
    finally:
        dist.destroy_process_group = destroy
    return audit.report()


def tune_job(rank: int, world: int, cache: str) -> dict:
    """The tuner's collectives: the shared constants (cached: no calibration) with the link measured on
    the group, one candidate measured, the recall and the held-out count, the accuracy probe."""
    from ds_xc.cost.compute import Constants
    from ds_xc.engine import init_distributed
    from ds_xc.tune.measure import measure_candidate
    from ds_xc.tune.probe import probe_accuracy
    from ds_xc.tune.session import held_out_samples, shared_constants
    path = os.path.join(cache, "constants.json")
    if rank == 0:
        c = Constants(threads=torch.get_num_threads(), machine=os.uname().nodename)
        with open(path + ".tmp", "w") as fh:
            json.dump(c.to_json(), fh)
        os.replace(path + ".tmp", path)
    section = {"num_classes": 40, "embedding_dim": D, "sampler": {"type": "uniform", "sample_rate": 0.5},
               "optimizer": {"type": "sgd", "lr": 0.1}}
    with DeviceAudit(simulate_gpus=GPUS) as audit:
        init_distributed()  # launch/tune.py's start: it must bind the device
        dev = torch.device("cpu")
        batches = [tuple(t.to(dev) for t in _batch(i, rank, D, classes=40)) for i in range(3)]
        import torch.distributed as dist
        dist.barrier(group=dist.group.WORLD)  # rank 0 wrote the constants (a test's collective: not judged)
        shared_constants(path, None)
        measure_candidate(copy.deepcopy(section), lambda i: batches[i % 3], lambda: iter(batches[:1]), steps=1,
                          warmup=1, group=None, recall=True)
        held_out_samples(lambda: iter(batches[:1]), None)
        probe_accuracy(copy.deepcopy(section), lambda i: batches[i % 3], lambda: iter(batches[:2]), 2, None)
    return audit.report()


def summary(reports: list) -> dict:
    """{kind: [distinct "op at site" over the ranks]} and the number of distinct findings."""
    seen = {}
    for rep in reports:
        for f in rep["distinct"]:
            seen.setdefault(f["kind"], set()).add(f"{f['op']} at {f['site']}")
    return {k: sorted(v) for k, v in seen.items()}


__all__ = ["engine_job", "head_job", "grow_job", "tune_job", "summary", "types"]
