"""Agreement and bad input through ds_xc.initialize / XCEngine on 2 and 3 gloo ranks (DeepSpeed).

* ``num_classes`` below the number of ranks: a ConfigError naming
  ``extreme_classification.num_classes``, the value, the world size and what is allowed, on
  every rank, before ``deepspeed.initialize`` runs; a config that differs on one rank is a
  DisagreementError naming the key and each rank's value, also before DeepSpeed starts.
* save_checkpoint with another tag on one rank: an error on every rank, nothing written; a
  rank that cannot write its files: every rank raises, nothing published, ``latest`` unchanged.
  load_checkpoint with a corrupt compression file, a missing head shard or a cut DeepSpeed
  file on one rank: an error on every rank naming the file, and head, head optimizer,
  backbone, backbone optimizer and residuals bitwise unchanged; afterwards the same
  checkpoint loads and training goes on.
* NaN backbone gradients on one rank under ZeRO 1 and 2 (fp32 and bf16) and bf16 ZeRO 0:
  the step is skipped on every rank (head included, which DeepSpeed never sees), weights
  and optimizer states bitwise unchanged, counted once, and training goes on exactly as if
  the bad batch never came.
"""
import os

import pytest
import torch

import ds_xc
from tests.test_reliability import CASES, Body, _assert_same, _batch, _config, _state
from tests.dist_pool import catch

B = 4


_catch = catch


def _cfg(stage=0, bf16=False, case="exact_sgd", **over):
    cfg = _config(**dict(CASES[case], **over))
    cfg["zero_optimization"] = {"stage": stage}
    cfg["zero_allow_untested_optimizer"] = True
    cfg["bf16"] = {"enabled": bf16}
    return cfg


def _build(rank, cfg):
    torch.manual_seed(11)
    body = Body()
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9), config=cfg)
    torch.manual_seed(111 + rank)
    return xc


def _train(xc, rank, start, stop, faults=None, bf16=False, gas=1):
    """Optimizer steps [start, stop) of ``gas`` micro-steps; faults {(step, micro, rank): fault}."""
    losses = []
    for step in range(start, stop):
        for m in range(gas):
            fault = (faults or {}).get((step, m, rank))
            xc.engine.module.fault = fault
            x, y = _batch(step * gas + m if fault is None else 10**5 + step, rank)
            losses.append(xc.forward_backward(x.to(torch.bfloat16) if bf16 else x, y).item())
            xc.step()
            xc.engine.module.fault = None
    return losses


# ---------------------------------------------------------------------- initialize
def _init_refused(rank, world, case):
    import deepspeed
    real = deepspeed.initialize

    def must_not_run(*args, **kwargs):
        raise AssertionError("deepspeed.initialize ran before the config was refused")
    deepspeed.initialize = must_not_run
    try:
        cfg = _cfg()
        if case == "few_classes":
            cfg["extreme_classification"]["num_classes"] = world - 1
        else:
            cfg["extreme_classification"]["optimizer"]["lr"] = 0.5 if rank == 1 else 0.25
        return _catch(lambda: _build(rank, cfg))
    finally:
        deepspeed.initialize = real


def test_initialize_refuses_few_classes_and_disagreeing_configs_early(pools):
    world = 3
    for rank, (kind, msg) in enumerate(pools(world).run(_init_refused, "few_classes")):
        assert kind == "ConfigError"
        assert (f"extreme_classification.num_classes={world - 1} is below the number of ranks the classes are "
                f"sharded over ({world})") in msg and f"use num_classes >= {world}" in msg
    for rank, (kind, msg) in enumerate(pools(world).run(_init_refused, "disagree")):
        assert kind == "DisagreementError"
        assert "the DeepSpeed config" in msg
        assert "extreme_classification.optimizer.lr (rank 0: 0.25, rank 1: 0.5, rank 2: 0.25)" in msg


# ---------------------------------------------------------------------- checkpoints
def _everything(xc):
    out = _state(xc)
    out["residual"] = xc.compression._buffers["residual"].clone() if xc.compression is not None else None
    return out


def _same(a, b):
    _assert_same(a, b)
    assert (a["residual"] is None) == (b["residual"] is None)
    if a["residual"] is not None:
        assert torch.equal(a["residual"], b["residual"])


def _ckpt_cases(rank, world, folder):
    import torch.distributed as dist
    from ds_xc.compression.checkpoint import compression_file
    from ds_xc.checkpoint import shard_file
    xc = _build(rank, _cfg(case="uniform_lazy_adamw_compressed_overlap", overlap=False))
    _train(xc, rank, 0, 2)
    out = {"tag": _catch(lambda: xc.save_checkpoint(folder, tag="step2" if rank == 0 else "step3"))}
    out["nothing_written"] = not os.path.exists(folder) or os.listdir(folder) == []
    xc.save_checkpoint(folder, tag="step2", client_state={"step": 2})
    import ds_xc.engine.checkpointing as engine_module  # where save_checkpoint looks the name up
    real = engine_module.save_head_state

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device (injected on rank 1)")
    if rank == 1:
        engine_module.save_head_state = disk_full
    out["write"] = _catch(lambda: xc.save_checkpoint(folder, tag="step2b"))
    engine_module.save_head_state = real
    with open(os.path.join(folder, "latest")) as fh:
        out["latest"] = fh.read()
    out["published"] = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    expect = _train(xc, rank, 2, 4)
    _train(xc, rank, 4, 5)  # move away from the checkpoint
    before = _everything(xc)
    tag_dir = os.path.join(folder, "step2")
    damages = {"compression": compression_file(tag_dir, 1, world), "head": shard_file(tag_dir, 1, world),
               "deepspeed": os.path.join(tag_dir, "mp_rank_00_model_states.pt")}
    manifest = os.path.join(tag_dir, "ds_xc_manifest.json")
    for checked in (True, False):  # with the checksum manifest, and without (an older checkpoint)
        if not checked and rank == 0:
            os.replace(manifest, manifest + ".keep")
        for name, path in damages.items():
            keep = path + ".keep"
            dist.barrier()
            if rank == 1:
                os.replace(path, keep)
                if name != "head":  # head: missing; the others: cut in half
                    with open(keep, "rb") as src, open(path, "wb") as dst:
                        dst.write(src.read()[: os.path.getsize(keep) // 2])
            dist.barrier()
            out[(name, checked)] = _catch(lambda: xc.load_checkpoint(folder))
            _same(before, _everything(xc))
            dist.barrier()
            if rank == 1:
                os.replace(keep, path)
        dist.barrier()
        if not checked and rank == 0:
            os.replace(manifest + ".keep", manifest)
    dist.barrier()
    out["other_tag"] = _catch(lambda: xc.load_checkpoint(folder, tag="step2" if rank else "step9"))
    _same(before, _everything(xc))
    start = xc.load_checkpoint(folder)["step"]
    out["resumed"] = _train(xc, rank, start, 4) == expect
    out["paths"] = damages
    return out


def test_checkpoint_disagreement_and_damage_raise_everywhere_and_change_nothing(pools, tmp_path):
    world = 2
    res = pools(world).run(_ckpt_cases, str(tmp_path / "ck"))
    paths = res[0]["paths"]
    for rank, r in enumerate(res):
        kind, msg = r["tag"]
        assert kind == "DisagreementError" and "save_checkpoint(save_dir, tag)" in msg
        assert "'step2')" in msg and "'step3')" in msg and r["nothing_written"]
        kind, msg = r["write"]
        assert kind == "OSError" and "No space left on device (injected on rank 1)" in msg
        assert ("writing the head shards, residuals and RNG states" in msg) == (rank == 0)
        assert r["latest"] == "step2" and r["published"] == ["latest", "step2"]
        for key in ("compression", "head", "deepspeed"):  # the manifest names the damaged file first
            kind, msg = r[(key, True)]
            assert kind == "CheckpointError" and "fails its checksums" in msg and paths[key] in msg, (key, msg)
        kind, msg = r[("compression", False)]
        assert kind == "CheckpointError" and f"cannot read compression state file {paths['compression']!r}" in msg
        kind, msg = r[("head", False)]
        assert kind == "FileNotFoundError" and f"head shard {paths['head']!r} is missing" in msg
        kind, msg = r[("deepspeed", False)]
        assert kind == "CheckpointError" and f"DeepSpeed checkpoint file {paths['deepspeed']!r}" in msg
        for key in ("compression", "head"):  # rank 1's own files: rank 0 names rank 1
            assert ("failed on rank(s) [1]" in r[(key, False)][1]) == (rank == 0), (key, r[(key, False)])
        kind, msg = r["other_tag"]
        assert kind == "DisagreementError" and "'step9')" in msg and "'step2')" in msg
        assert r["resumed"]


# ---------------------------------------------------------------------- NaN gradients under ZeRO 1/2 and bf16
def _nonfinite(rank, world, stage, bf16, extra, gas, micro):
    cfg = _cfg(stage, bf16, gas=gas)
    cfg.update(extra)
    xc = _build(rank, cfg)
    clean = _train(xc, rank, 0, 2, bf16=bf16, gas=gas)
    before = _state(xc)
    bad = _train(xc, rank, 2, 3, {(2, micro, 1): "nan_grad"}, bf16, gas)
    _assert_same(before, _state(xc))
    rest = _train(xc, rank, 2, 4, bf16=bf16, gas=gas)
    ref = _build(rank, cfg)
    return {"optimizer": type(xc.engine.optimizer).__name__, "bad": bad, "skipped": xc.stats()["skipped_steps"],
            "ds_skipped": xc.engine.skipped_steps, "losses": clean + rest,
            "ref": _train(ref, rank, 0, 4, bf16=bf16, gas=gas)}


@pytest.mark.parametrize("stage,bf16,extra,gas,micro,optimizer", [
    (1, False, {}, 1, 0, "DeepSpeedZeroOptimizer"),
    (2, False, {}, 1, 0, "DeepSpeedZeroOptimizer"),
    (1, False, {}, 2, 0, "DeepSpeedZeroOptimizer"),  # NaN in the first micro-step of the window
    (2, False, {}, 2, 0, "DeepSpeedZeroOptimizer"),  # ZeRO 2 reduces it into the partitions at once
    (0, True, {}, 1, 0, "FP16_UnfusedOptimizer"),
    (2, True, {}, 2, 1, "DeepSpeedZeroOptimizer"),
    (1, True, {"data_types": {"grad_accum_dtype": "fp32"}}, 1, 0, "BF16_Optimizer"),
])
def test_nonfinite_backbone_gradients_are_skipped_under_zero_and_bf16(pools, stage, bf16, extra, gas, micro,
                                                                      optimizer):
    for rank, r in enumerate(pools(2).run(_nonfinite, stage, bf16, extra, gas, micro)):
        assert r["optimizer"] == optimizer
        assert all(v == v for v in r["bad"])  # finite losses: only the gradients were NaN
        assert r["skipped"] == 1 and r["ds_skipped"] == 1  # counted once
        assert r["losses"] == r["ref"], (rank, r["losses"], r["ref"])  # as if the bad batch never came
