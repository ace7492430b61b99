"""The adaptive lr schedule inside ds_xc.initialize: DeepSpeed builds and steps it, the head follows it
(lr_schedule follow_engine), a real engine checkpoint resumes it to the same rates on 2 and 3 gloo
ranks (uneven shards) whose observations differ, and clashing configs are refused by name."""
import pytest
import torch

import ds_xc
from ds_xc.config import ConfigError, parse_config
from ds_xc.engine.setup import check_supported
from tests.test_adaptive_lr import reference_lrs

C, D, IN, B, SEED = 23, 6, 5, 4, 11
LR_BODY, LR_HEAD = 0.01, 0.05
ADAPTIVE = {"reference_batch": 8, "warmup_samples": 24, "patience": 2, "factor": 0.5, "cooldown": 1,
            "threshold": 0.0, "monitor": "auto", "loss_ema": 0.5}


def _config(adaptive=ADAPTIVE):
    return {
        "train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR_BODY, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0, "adaptive_lr": adaptive,
        "extreme_classification": {
            "num_classes": C, "embedding_dim": D, "init_std": 0.5, "seed": SEED, "loss": {"type": "softmax"},
            "optimizer": {"type": "adamw", "lr": LR_HEAD, "weight_decay": 0.0}},
    }


def _metric(step, rank):
    """The held-out value rank ``rank`` observes after ``step``: ranks disagree on purpose."""
    return [0.1, 0.3, 0.2, 0.2, 0.25, 0.2, 0.2, 0.2, 0.4, 0.4, 0.4, 0.4][step % 12] + 0.05 * rank


def _run(rank, world, path, steps, resume, save):
    torch.manual_seed(SEED)
    xc = ds_xc.initialize(model=torch.nn.Linear(IN, D, bias=False), config=_config())
    start = xc.load_checkpoint(path)["step"] if resume else 0
    lrs, head_lrs, losses = [], [], []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(B, IN, generator=g), torch.randint(0, C, (B,), generator=g)
        loss = xc(x, y)
        xc.backward(loss)
        xc.step()  # the head steps with the lr the engine holds now, then DeepSpeed steps the schedule
        head_lrs.append(xc.head_optimizer.param_groups[0]["lr"])
        lrs.append(xc.engine.get_lr()[0])
        losses.append(loss.item())
        if step % 3 == 2:
            xc.observe_metric(_metric(step, rank))
    if save:
        xc.save_checkpoint(path, client_state={"step": start + steps})
    return {"lrs": lrs, "head": head_lrs, "losses": losses, "state": xc.lr_scheduler.state_dict(),
            "type": type(xc.lr_scheduler).__name__}


@pytest.mark.parametrize("world", [2, 3])
def test_engine_schedule_follows_rank0_and_resumes(pools, tmp_path, world):
    pool = pools(world)
    straight = pool.run(_run, str(tmp_path / "a"), 12, False, False)
    pool.run(_run, str(tmp_path / "b"), 7, False, True)
    resumed = pool.run(_run, str(tmp_path / "b"), 5, True, False)
    # the reference: rank 0's loss of every step, rank 0's metric of the step before (observed after
    # that step, folded in at the next); global batch B * world
    events = [{"loss": [straight[0]["losses"][k]]} for k in range(12)]
    for k in range(1, 12):
        if (k - 1) % 3 == 2:
            events[k]["eval"] = _metric(k - 1, 0)
    want = reference_lrs(dict(ADAPTIVE), LR_BODY, B * world, events)
    for r in range(world):
        assert straight[r]["type"] == "AdaptiveLR"
        assert straight[r]["lrs"] == pytest.approx(want[1:], rel=1e-12)
        assert resumed[r]["lrs"] == straight[r]["lrs"][7:]  # bitwise after the engine checkpoint
        assert _same_state(resumed[r]["state"], straight[0]["state"])  # rank 0's state on every rank
        # the head's lr follows the engine's (lr_schedule follow_engine): the lr it stepped with
        assert straight[r]["head"] == pytest.approx([LR_HEAD * lr / LR_BODY for lr in want[:12]], rel=1e-12)
    assert straight[0]["state"]["decays"] >= 1 and len(set(want)) >= 3  # warm-up, peak, a decay


def _same_state(a, b):
    return all(repr(a[k]) == repr(b[k]) for k in a)


def test_scheduler_section_and_adaptive_lr_clash():
    raw = _config()
    raw["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    with pytest.raises(ConfigError, match=r"scheduler: got DeepSpeed's scheduler 'WarmupLR'.*adaptive_lr.*allowed"):
        check_supported(raw)
    raw["adaptive_lr"] = dict(ADAPTIVE, enabled=False)
    check_supported(raw)  # disabled: DeepSpeed's scheduler alone


@pytest.mark.parametrize("key,value,words", [
    ("factor", 1.5, r"adaptive_lr\.factor: got 1\.5; Input should be less than 1"),
    ("patience", 0, r"adaptive_lr\.patience: got 0; Input should be greater than or equal to 1"),
    ("monitor", "top5", r"adaptive_lr\.monitor: got 'top5'; input should be 'auto', 'eval' or 'train_loss'"),
    ("batch_scaling", "cube", r"adaptive_lr\.batch_scaling: got 'cube'; input should be 'linear', 'sqrt' or 'none'"),
    ("patiense", 3, r"adaptive_lr\.patiense: unknown key"),
])
def test_bad_adaptive_lr_values_are_named(key, value, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(_config(dict(ADAPTIVE, **{key: value})))
