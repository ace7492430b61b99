"""DeepSpeed glue on 2 and 3 gloo ranks: after one step each head shard moved by exactly
its own gradient of the global loss, the backbone by the data-parallel mean gradient,
for ZeRO 0/1/2 and gradient accumulation; checkpoints resume the loss curve."""
import pytest
import torch

import ds_xc
from ds_xc.head import init_shard, shard_range
from tests.reference import LOSSES, per_row_loss

C, D, IN, B, SEED = 23, 6, 5, 4, 11
LR_HEAD, LR_BODY = 0.5, 0.2


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, IN, generator=g), torch.randint(0, C, (B,), generator=g)


def _backbone():
    torch.manual_seed(SEED)
    return torch.nn.Linear(IN, D, bias=False)


def _config(stage, gas, loss="cosface", sampler="full", bf16=False, momentum=0.0):
    return {
        "train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "extreme_classification": {
            "num_classes": C, "embedding_dim": D, "loss": LOSSES[loss], "sampler": {"type": sampler},
            "init_std": 0.5, "seed": SEED,
            "optimizer": {"type": "sgd", "lr": LR_HEAD, "momentum": momentum, "weight_decay": 0.0}},
    }


def _one_step(rank, world, stage, gas):
    body = _backbone()
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=LR_BODY),
                          config=_config(stage, gas))
    w0 = xc.head.weight.detach().clone()
    losses = []
    for micro in range(gas):
        x, y = _batch(micro, rank)
        loss = xc(x, y)
        xc.backward(loss)
        xc.step()
        losses.append(loss.item())
    a1 = xc.engine.module.weight.detach().clone()
    return {"w0": w0, "w1": xc.head.weight.detach().clone(), "a1": a1, "losses": losses,
            "steps": xc.global_steps}


def check_one_step_against_reference(res: list, world: int, gas: int):
    """Float64 reference of one optimizer step over ``gas`` micro-batches: checks every rank's
    micro-batch losses and step count, returns (backbone weight, head weight) with their gradients."""
    a0 = _backbone().weight.detach().double().requires_grad_()
    w0 = init_shard(C, D, 0, C, 0.5, SEED, torch.float64).requires_grad_()
    total = 0.0
    for micro in range(gas):
        xs, ys = zip(*(_batch(micro, r) for r in range(world)))
        x, y = torch.cat(xs).double(), torch.cat(ys)
        lm = per_row_loss(x @ a0.t(), w0, y, LOSSES["cosface"]).mean()
        for r in res:
            assert r["losses"][micro] == pytest.approx(lm.item(), rel=1e-5)
        total = total + lm / gas
    total.backward()
    for r in res:
        assert r["steps"] == 1
    return a0, w0


@pytest.mark.parametrize("world,stage,gas", [(2, 0, 1), (2, 1, 1), (2, 2, 2), (3, 0, 2), (3, 2, 1)])
def test_step_moves_each_shard_by_its_own_gradient(pools, world, stage, gas):
    res = pools(world).run(_one_step, stage, gas)
    a0, w0 = check_one_step_against_reference(res, world, gas)
    for rank, r in enumerate(res):
        start, n = shard_range(C, world, rank)
        torch.testing.assert_close(r["w0"].double(), w0.detach()[start: start + n])
        expected = w0.detach()[start: start + n] - LR_HEAD * w0.grad[start: start + n]
        torch.testing.assert_close(r["w1"].double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["a1"].double(), a0.detach() - LR_BODY * a0.grad, rtol=1e-5, atol=1e-6)


def _train_and_checkpoint(rank, world, path, steps, resume, sampler, bf16):
    body = _backbone()
    cfg = _config(0, 1, loss="arcface", sampler=sampler, bf16=bf16, momentum=0.9)
    if sampler == "uniform":
        cfg["extreme_classification"]["sampler"] = {"type": "uniform", "sample_rate": 0.3}
        cfg["extreme_classification"]["optimizer"]["update"] = "lazy"
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=LR_BODY, momentum=0.9),
                          config=cfg)
    start = 0
    if resume:
        start = xc.load_checkpoint(path)["step"]
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        if bf16:
            x = x.to(torch.bfloat16)
        loss = xc(x, y)
        xc.backward(loss)
        xc.step()
        losses.append(loss.item())
    if not resume:
        xc.save_checkpoint(path, client_state={"step": start + steps})
    return losses


@pytest.mark.parametrize("sampler,bf16", [("full", False), ("uniform", False), ("full", True)])
def test_resume_continues_the_loss_curve(pools, tmp_path, sampler, bf16):
    pool = pools(2)
    straight = pool.run(_train_and_checkpoint, str(tmp_path / "a"), 6, False, sampler, bf16)
    pool.run(_train_and_checkpoint, str(tmp_path / "b"), 3, False, sampler, bf16)
    resumed = pool.run(_train_and_checkpoint, str(tmp_path / "b"), 3, True, sampler, bf16)
    for r in range(2):
        assert resumed[r] == straight[r][3:]  # bitwise on CPU
    assert len(set(straight[0])) == 6  # the steps really changed the model


def _load_into_other_world(rank, world, path):
    body = _backbone()
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=LR_BODY),
                          config=_config(0, 1, loss="arcface", momentum=0.9))
    w = xc.head.weight.detach().clone()
    try:
        xc.load_checkpoint(path)
    except RuntimeError as exc:
        return str(exc), torch.equal(w, xc.head.weight.detach())
    return None, True


def test_world_size_mismatch_is_refused(pools, tmp_path):
    pools(2).run(_train_and_checkpoint, str(tmp_path), 1, False, "full", False)
    msgs = pools(3).run(_load_into_other_world, str(tmp_path))
    for msg, unchanged in msgs:
        assert msg is not None and "2 ranks" in msg and "3 ranks" in msg
        assert unchanged


def test_unsupported_combinations_refused():
    body = _backbone()
    for patch, key in [({"fp16": {"enabled": True}}, "fp16.enabled"),
                       ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage")]:
        cfg = dict(_config(0, 1), **patch)
        with pytest.raises(ds_xc.ConfigError, match=key):
            ds_xc.initialize(model=body, config=cfg)
    cfg = _config(0, 1)
    del cfg["extreme_classification"]
    with pytest.raises(ds_xc.ConfigError, match="extreme_classification"):
        ds_xc.initialize(model=body, config=cfg)
