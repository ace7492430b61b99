"""LAMB / LARS from the DeepSpeed JSON through ds_xc.initialize on 2 gloo ranks (ZeRO 0 and 1,
uneven per-rank batches, a DeepSpeed warm-up schedule changing the lr) equal the plain
optimizer run on one process on the concatenated batch; the config checks name the key."""
import argparse
import json
import logging

import pytest
import torch

import ds_xc
from ds_xc.engine import check_supported
from ds_xc.head import init_shard
from ds_xc.optim import Lamb, Lars
from tests.reference import LOSSES, per_row_loss

C, D, IN, SEED, STEPS = 23, 6, 5, 11, 4
SIZES = (3, 5)  # rows per rank: uneven
LR_HEAD = 0.5
PARAMS = {"lamb": {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.01, "max_coeff": 5.0,
                   "min_coeff": 0.05, "exclude_bias_and_norm": True},
          "lars": {"lr": 3.0, "momentum": 0.9, "weight_decay": 0.001, "trust_coefficient": 0.01,
                   "exclude_bias_and_norm": False}}
TYPES = {"lamb": "Lamb", "lars": "LARS"}


def _backbone():
    torch.manual_seed(SEED)  # 2-D weights, biases and a norm layer: 118 parameters, split mid-layer at ZeRO 1
    return torch.nn.Sequential(torch.nn.Linear(IN, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(), torch.nn.Linear(8, D))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(SIZES[rank], IN, generator=g), torch.randint(0, C, (SIZES[rank],), generator=g)


def _config(kind, stage, bf16=False):
    accum = {"data_types": {"grad_accum_dtype": "fp32"}} if bf16 == "fp32_accum" else {}
    return {**accum, "bf16": {"enabled": bool(bf16)},
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
        "optimizer": {"type": TYPES[kind], "params": dict(PARAMS[kind])},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": PARAMS[kind]["lr"] / 10, "warmup_max_lr": PARAMS[kind]["lr"],
                                                     "warmup_num_steps": STEPS, "warmup_type": "linear"}},
        "extreme_classification": {
            "num_classes": C, "embedding_dim": D, "loss": LOSSES["cosface"], "init_std": 0.5, "seed": SEED,
            "optimizer": {"type": "sgd", "lr": LR_HEAD, "momentum": 0.0, "lr_schedule": "constant"}},
    }


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(rank, world, kind, stage, path, bf16=False):
    records = _Records()
    logging.getLogger("ds_xc").addHandler(records)
    logging.getLogger("ds_xc").setLevel(logging.INFO)
    body = _backbone()
    if path:  # the JSON file through args.deepspeed_config, as launch/train.py passes it
        path = f"{path}.rank{rank}"  # one file per rank: a shared one would be truncated by one rank as another reads
        with open(path, "w") as fh:
            json.dump(_config(kind, stage), fh)
        xc = ds_xc.initialize(args=argparse.Namespace(deepspeed_config=path, local_rank=rank), model=body)
    else:
        xc = ds_xc.initialize(model=body, config=_config(kind, stage, bf16))
    lrs, weights = [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        x = x.to(torch.bfloat16) if bf16 else x
        lrs.append(xc.engine.basic_optimizer.param_groups[0]["lr"])  # what this step uses
        xc.backward(xc(x, y))
        xc.step()
        weights.append([p.detach().float().clone() for p in xc.engine.module.parameters()])
    logging.getLogger("ds_xc").removeHandler(records)
    layouts = list(getattr(xc.engine.basic_optimizer, "layouts", {}).values())
    return {"lrs": lrs, "weights": weights, "log": records.lines, "basic": type(xc.engine.basic_optimizer).__name__,
            "wrapper": type(xc.engine.optimizer).__name__,
            "segments": [s for lay in layouts for s in _segments(lay)]}


def _segments(layout):
    keys = layout.key.tolist()
    return sorted({k for k in keys if k < layout.num_layers})


def _reference(kind, lrs):
    """The plain optimizer on one process: the concatenated batch, the dense head stepped by SGD."""
    body = _backbone()
    opt = (Lamb if kind == "lamb" else Lars)(body.parameters(), **PARAMS[kind])
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float32).requires_grad_()
    head_opt = torch.optim.SGD([w], lr=LR_HEAD)
    out = []
    for step in range(STEPS):
        xs, ys = zip(*(_batch(step, r) for r in range(len(SIZES))))
        loss = per_row_loss(body(torch.cat(xs)), w, torch.cat(ys), LOSSES["cosface"]).mean()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        opt.step()
        head_opt.step()
        opt.zero_grad()
        head_opt.zero_grad()
        out.append([p.detach().clone() for p in body.parameters()])
    return out


@pytest.mark.parametrize("kind,stage,via_args", [("lamb", 0, False), ("lars", 0, True), ("lamb", 1, True),
                                                 ("lars", 1, False), ("lars", 2, False)])
def test_engine_steps_equal_the_plain_optimizer(pools, tmp_path, kind, stage, via_args):
    res = pools(2).run(_train, kind, stage, str(tmp_path / "ds.json") if via_args else None)
    lrs = res[0]["lrs"]
    assert len(set(lrs)) >= STEPS - 1  # the scheduler changes the lr
    expected = _reference(kind, lrs)
    start = [p.detach() for p in _backbone().parameters()]
    for r in res:
        assert r["lrs"] == lrs
        name = "Lamb" if kind == "lamb" else "Lars"
        assert r["basic"] == name
        assert any(f"runs ds_xc.optim.{kind}.{name}" in line for line in r["log"]), r["log"]
        for step in range(STEPS):
            for got, want in zip(r["weights"][step], expected[step]):
                torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    assert any(not torch.allclose(a, b) for a, b in zip(expected[-1], start))
    if stage > 0:  # layers split between the two ranks' partitions: the norms are summed over ranks
        assert set(res[0]["segments"]) & set(res[1]["segments"]), (res[0]["segments"], res[1]["segments"])


@pytest.mark.parametrize("kind,stage,bf16", [("lamb", 0, True), ("lars", 0, True), ("lars", 1, True),
                                             ("lamb", 1, "fp32_accum"), ("lamb", 2, True)])
def test_bf16_follows_the_plain_optimizer(pools, kind, stage, bf16):
    """bf16: with ZeRO 0 DeepSpeed keeps an fp32 master copy per tensor (its unfused wrapper); with ZeRO 1/2
    its ZeRO optimizer, or with ZeRO 1 and fp32 gradient accumulation its BF16_Optimizer, keep fp32 flat
    partitions; our optimizer steps those. The bf16 weights stay within bf16 rounding of the fp32 plain run."""
    res = pools(2).run(_train, kind, stage, None, bf16)
    wrapper = "FP16_UnfusedOptimizer" if stage == 0 else \
        "BF16_Optimizer" if bf16 == "fp32_accum" else "DeepSpeedZeroOptimizer"
    assert res[0]["wrapper"] == wrapper
    if stage > 0:
        assert set(res[0]["segments"]) & set(res[1]["segments"])  # a layer split between the ranks
    expected = _reference(kind, res[0]["lrs"])
    start = [p.detach() for p in _backbone().parameters()]
    moved = max((a - b).abs().max().item() for a, b in zip(expected[-1], start))
    for r in res:
        assert r["basic"] == ("Lamb" if kind == "lamb" else "Lars")
        err = max((a - b).abs().max().item() for a, b in zip(r["weights"][-1], expected[-1]))
        assert err < 0.5 * moved, (err, moved)  # bf16 forward and weights: a weak check (bf16 ulp ~ the motion)
        for got, want in zip(r["weights"][-1], expected[-1]):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=3e-3)


def _raw(kind="lamb", **params):
    raw = _config(kind, 0)
    raw["optimizer"]["params"].update(params)
    return raw


def test_config_errors_name_the_key_and_the_allowed_ones():
    with pytest.raises(ds_xc.ConfigError, match=r"optimizer.params.momentum: unknown key .*allowed: lr, betas"):
        check_supported(_raw("lamb", momentum=0.9))
    with pytest.raises(ds_xc.ConfigError, match=r"optimizer.params.max_coeff: unknown key .*trust_coefficient"):
        check_supported(_raw("lars", max_coeff=1.0))
    with pytest.raises(ds_xc.ConfigError, match="max_grad_norm.*gradient_clipping"):
        check_supported(_raw("lamb", max_grad_norm=1.0))
    with pytest.raises(ds_xc.ConfigError, match=r"optimizer.params.betas"):
        check_supported(_raw("lamb", betas=[0.9, 1.0]))
    with pytest.raises(ds_xc.ConfigError, match="min_coeff=2.0 is above max_coeff=1.0"):
        check_supported(_raw("lamb", min_coeff=2.0, max_coeff=1.0))
    with pytest.raises(ds_xc.ConfigError, match=r"optimizer.params.momentum"):
        check_supported(_raw("lars", momentum=1.0))
    extra = _raw("lars")
    extra["optimizer"]["param"] = {}
    with pytest.raises(ds_xc.ConfigError, match="optimizer.param: unknown key of the optimizer section"):
        check_supported(extra)
    check_supported(_raw("lamb"))  # the valid one passes
    other = _raw("lamb")
    other["optimizer"] = {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True, "anything": 1}}
    check_supported(other)  # DeepSpeed's own types are left to DeepSpeed


def test_section_and_client_optimizer_together_are_refused():
    from ds_xc.optim.deepspeed import build_backbone_optimizer
    body = _backbone()
    with pytest.raises(ds_xc.ConfigError, match="give one of them"):
        build_backbone_optimizer(_raw("lars"), list(body.parameters()), torch.optim.SGD(body.parameters(), lr=0.1))
    opt, ds_raw = build_backbone_optimizer(_raw("lamb"), list(body.parameters()))
    assert isinstance(opt, Lamb) and "optimizer" not in ds_raw and "optimizer" in _raw("lamb")
    assert opt.defaults["max_coeff"] == 5.0 and opt.defaults["betas"] == (0.9, 0.99)


def test_lamb_falls_back_to_ours_and_says_why(monkeypatch, caplog):
    """Without CUDA ours runs; where CUDA looks present but FusedLamb cannot build or run, ours runs too."""
    from ds_xc.optim.deepspeed import build_backbone_optimizer
    body = _backbone()
    with caplog.at_level(logging.INFO, logger="ds_xc"):
        opt, _ = build_backbone_optimizer(_raw("lamb", exclude_bias_and_norm=False), list(body.parameters()))
    cuda = torch.cuda.is_available()
    assert type(opt).__name__ == ("FusedLamb" if cuda else "Lamb")  # on a GPU machine: DeepSpeed's op
    expected = "DeepSpeed's CUDA op" if cuda else "no CUDA device"
    assert any("runs" in r.getMessage() and expected in r.getMessage() for r in caplog.records), caplog.text
    if cuda:
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine where the op cannot run
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds_xc"):
        opt, _ = build_backbone_optimizer(_raw("lamb", exclude_bias_and_norm=False), list(body.parameters()))
    assert type(opt) is Lamb
    assert any("FusedLamb could not build or run" in r.getMessage() for r in caplog.records), caplog.text
    with caplog.at_level(logging.INFO, logger="ds_xc"):
        opt, _ = build_backbone_optimizer(_raw("lamb"), list(body.parameters()))  # ours-only option
    assert type(opt) is Lamb and any("exclude_bias_and_norm=true" in r.getMessage() for r in caplog.records)


def _resume(rank, world, kind, stage, path, steps, resume):
    body = _backbone()
    xc = ds_xc.initialize(model=body, config=_config(kind, stage))
    start = xc.load_checkpoint(path)["step"] if resume else 0
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        xc.backward(xc(x, y))
        xc.step()
    if not resume:
        xc.save_checkpoint(path, client_state={"step": start + steps})
    return [p.detach().clone() for p in xc.engine.module.parameters()]


@pytest.mark.parametrize("kind,stage", [("lamb", 0), ("lars", 1)])
def test_engine_checkpoint_resumes_the_optimizer_state(pools, tmp_path, kind, stage):
    """Save after 2 steps, resume in a new engine, 2 more: equal to 4 straight steps (moments, velocity, layout)."""
    pool = pools(2)
    straight = pool.run(_resume, kind, stage, str(tmp_path / "a"), STEPS, False)
    pool.run(_resume, kind, stage, str(tmp_path / "b"), 2, False)
    resumed = pool.run(_resume, kind, stage, str(tmp_path / "b"), STEPS - 2, True)
    for r in range(2):
        for a, b in zip(straight[r], resumed[r]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
