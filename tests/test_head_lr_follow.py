"""``lr_schedule: follow_engine`` under a schedule built before ds_xc.initialize or by DeepSpeed: the head's
lr at every step equals its configured lr times the engine's lr over the schedule's reference lr
(ds_xc/engine/lr_follow.py), against a float64 restatement of each schedule, on 2 gloo ranks. Before
the fix the reference was the optimizer's lr at initialize: 0 after a warm-up from 0 (the head's lr
never moved), a warm-up fraction (the head's peak a multiple of its configured lr), or the optimizer's
lr where DeepSpeed's WarmupLR peaks at its own warmup_max_lr."""
import math

import pytest
import torch

import ds_xc
from ds_xc.config import ConfigError
from ds_xc.engine.lr_follow import check_follow_engine
from tests.dist_pool import catch

C, D, IN, B, SEED, STEPS = 17, 6, 5, 4, 3, 12
LR_BODY, LR_HEAD = 0.01, 0.05
W, T, POWER = 4, 10, 2.0  # warm-up steps, total steps, decay power of the polynomial schedule


def _config(**extra):
    return {
        "train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,
        "extreme_classification": {
            "num_classes": C, "embedding_dim": D, "seed": SEED, "loss": {"type": "cosface"},
            "optimizer": {"type": "sgd", "lr": LR_HEAD, "momentum": 0.9, "update": "dense"}},
        **extra,
    }


def warmup_from_zero(t: int) -> float:
    """LambdaLR factor: linear warm-up from 0 over W steps, then 1 (lr 0 at construction)."""
    return min(1.0, t / W)


def warmup_poly(t: int) -> float:
    """LambdaLR factor: warm-up from 1/(W+1) (that fraction at construction), then polynomial decay to 0 at T."""
    if t < W:
        return (t + 1) / (W + 1)
    return max(0.0, 1.0 - (t - W) / (T - W)) ** POWER


def _train(rank, world, schedule, ds_scheduler):
    """STEPS steps; (the engine's lr, the head's lr) each step took."""
    torch.manual_seed(SEED)
    model = torch.nn.Linear(IN, D)
    if ds_scheduler is None:  # a client optimizer and a client LambdaLR, built before initialize
        opt = torch.optim.SGD(model.parameters(), lr=LR_BODY, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, {"zero": warmup_from_zero, "poly": warmup_poly}[schedule])
        xc = ds_xc.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=_config())
    else:  # DeepSpeed builds the optimizer and the scheduler from its config
        xc = ds_xc.initialize(model=model, config=_config(
            optimizer={"type": "AdamW", "params": {"lr": LR_BODY, "weight_decay": 0.0, "torch_adam": True}},
            scheduler=ds_scheduler))
    body, head = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(B, IN, generator=g), torch.randint(0, C, (B,), generator=g)
        body.append(float(xc.engine.get_lr()[0]))  # the lr of this step (DeepSpeed steps the schedule after it)
        loss = xc(x, y)
        xc.backward(loss)
        xc.step()
        head.append(float(xc.head_optimizer.param_groups[0]["lr"]))  # set before the head's step
    return body, head


@pytest.mark.parametrize("name,factor", [("zero", warmup_from_zero), ("poly", warmup_poly)])
def test_head_follows_a_client_lambda_schedule(pools, name, factor):
    got = pools(2).run(_train, name, None)
    want = [factor(t) for t in range(STEPS)]  # float64
    for body, head in got:
        assert body == pytest.approx([LR_BODY * f for f in want], rel=1e-12, abs=1e-15)
        assert head == pytest.approx([LR_HEAD * f for f in want], rel=1e-12, abs=1e-15)
    assert max(got[0][1]) == pytest.approx(LR_HEAD, rel=1e-12)  # the configured head lr is the peak


def deepspeed_warmup_lr(t: int, lo: float, hi: float, steps: int) -> float:
    """DeepSpeed's WarmupLR (warmup_type log) at step t: lo at construction and after the first step
    (log 1 = 0), lo + (hi - lo) * log(t) / log(steps) while t - 1 < steps, then hi."""
    if t == 0:
        return lo
    gamma = math.log(t) / math.log(steps) if t - 1 < steps else 1.0
    return lo + (hi - lo) * gamma


def test_head_follows_deepspeed_warmup_lr_section(pools):
    lo, hi, steps = 0.002, 0.04, 6  # the peak is not the optimizer's lr (LR_BODY)
    section = {"type": "WarmupLR", "params": {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": steps}}
    got = pools(2).run(_train, None, section)
    want = [deepspeed_warmup_lr(t, lo, hi, steps) for t in range(STEPS)]
    for body, head in got:
        assert body == pytest.approx(want, rel=1e-12)
        assert head == pytest.approx([LR_HEAD * lr / hi for lr in want], rel=1e-12)
    assert got[0][1][-1] == pytest.approx(LR_HEAD, rel=1e-12)


class _NoReference:
    """A scheduler that keeps no base/peak lr: nothing to scale the head's lr by."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, *args, **kwargs):
        for g in self.optimizer.param_groups:
            g["lr"] *= 0.5

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    get_last_lr = get_lr

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _unknown_scheduler(rank, world, schedule):
    torch.manual_seed(SEED)
    model = torch.nn.Linear(IN, D)
    opt = torch.optim.SGD(model.parameters(), lr=LR_BODY)
    raw = _config()
    raw["extreme_classification"]["optimizer"]["lr_schedule"] = schedule
    return catch(lambda: ds_xc.initialize(model=model, optimizer=opt, lr_scheduler=_NoReference(opt), config=raw))


def test_a_scheduler_without_a_reference_is_refused_on_every_rank(pools):
    got = pools(2).run(_unknown_scheduler, "follow_engine")
    for kind, message in got:
        assert kind == "ConfigError"
        assert "extreme_classification.optimizer.lr_schedule='follow_engine'" in message
        assert "_NoReference" in message and "base_lrs" in message and "'constant'" in message
    assert pools(2).run(_unknown_scheduler, "constant") == [None, None]  # constant: nothing to follow


@pytest.mark.parametrize("ref", [0.0, float("nan"), -1.0])
def test_a_reference_that_is_not_positive_is_refused(ref):
    sched = type("S", (), {"base_lrs": [ref]})()
    with pytest.raises(ConfigError, match=r"lr_schedule='follow_engine': the engine's reference lr is"):
        check_follow_engine(sched, 0.1)
    with pytest.raises(ConfigError, match=r"reference lr is 0\.0 \(from the optimizer's lr at initialize"):
        check_follow_engine(None, 0.0)
