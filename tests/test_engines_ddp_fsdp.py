"""A ClassParallelHead beside a backbone wrapped in torch's DistributedDataParallel or FSDP2
(``fully_shard``), the head outside the wrapper with ds_xc's head optimizer: two training
steps equal the single-process float64 reference (same init, the whole global batch on one
process, a dense head, torch.optim.SGD on both), on 2 and 3 gloo ranks with uneven local
batches and num_classes % world_size != 0 (docs/engines.md)."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ds_xc
from ds_xc.head import init_shard
from tests.reference import LOSSES, per_row_loss

IN, D, C, STD = 5, 6, 7, 0.5
SIZES = {2: (3, 6), 3: (4, 1, 5)}  # uneven local batches
STEPS, LR, HEAD_LR, MOM, WD = 2, 0.1, 0.5, 0.9, 1e-3
HEAD_OPT = {"type": "sgd", "lr": HEAD_LR, "momentum": MOM, "weight_decay": WD, "update": "dense"}


def _backbone():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(IN, 9), torch.nn.Tanh(), torch.nn.Linear(9, D)).double()


def _global_batch(world, step):
    n = sum(SIZES[world])
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, IN, generator=g, dtype=torch.float64), torch.randint(0, C, (n,), generator=g)


def _reference(world, loss):
    """One process, float64, the dense (C, d) head: the parameters after STEPS steps."""
    net, w = _backbone(), torch.nn.Parameter(init_shard(C, D, 0, C, STD, 0, torch.float64))
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOM)
    head_opt = torch.optim.SGD([w], lr=HEAD_LR, momentum=MOM, weight_decay=WD)
    for step in range(STEPS):
        x, y = _global_batch(world, step)
        per_row_loss(net(x), w, y, LOSSES[loss]).mean().backward()
        opt.step(), head_opt.step()
        opt.zero_grad(), head_opt.zero_grad()
    return [p.detach() for p in net.parameters()], w.detach()


def _wrap(net, engine, world):
    if engine == "ddp":
        return DDP(net)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    fully_shard(net, mesh=init_device_mesh("cpu", (world,)))  # the parameters become DTensor shards
    return net


def _run(rank, world, engine, loss):
    head = ds_xc.ClassParallelHead(D, C, loss=LOSSES[loss], group=None, dtype="float64", init_std=STD,
                                   update="dense")
    head_opt = ds_xc.build_head_optimizer(head, HEAD_OPT)
    net = _backbone()
    model = _wrap(net, engine, world)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)  # after fully_shard: the shards
    lo = sum(SIZES[world][:rank])
    losses = []
    for step in range(STEPS):
        x, y = _global_batch(world, step)
        x, y = x[lo: lo + SIZES[world][rank]], y[lo: lo + SIZES[world][rank]]  # this rank's rows
        out = head(model(x), y)  # the mean over the global batch, the same on every rank
        out.backward()
        opt.step(), head_opt.step()
        opt.zero_grad(), head_opt.zero_grad()
        losses.append(float(out))
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    ref_params, ref_w = _reference(world, loss)
    start, count = head.class_start, head.num_local
    return {"backbone": max((a.detach() - b).abs().max().item() for a, b in zip(params, ref_params)),
            "head": (head.weight.detach() - ref_w[start: start + count]).abs().max().item(),
            "moved": max((a.detach() - b.detach()).abs().max().item() for a, b in zip(params, _backbone().parameters())),
            "head_moved": (head.weight.detach() - init_shard(C, D, start, count, STD, 0, torch.float64)).abs().max().item(),
            "losses": losses}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("engine,loss", [("ddp", "cosface"), ("fsdp", "cosface"), ("ddp", "softmax")])
def test_head_beside_wrapped_backbone_equals_reference(pools, world, engine, loss):
    results = pools(world).run(_run, engine, loss)
    for r in results:
        assert r["backbone"] < 1e-12 and r["head"] < 1e-12, r
        assert r["moved"] > 1e-3 and r["head_moved"] > 1e-3, r  # both trained
        assert r["losses"] == results[0]["losses"]
