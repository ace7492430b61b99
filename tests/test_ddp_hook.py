"""ds_xc's compressed reduction as a DDP communication hook (ds_xc/compression/ddp_hook.py) leaves
the same gradients, parameters, error-feedback residuals and thresholds as
CompressedOptimizer.reduce_gradients() on the same gradients and seeds, on 2 and 3 gloo ranks,
over several steps (warm-up, statistics syncs), with DDP's several buckets; its state resumes
bit for bit. Bitwise on 2 ranks; on 3, gloo's dense all-reduce sums a flat buffer in an order
that depends on its length, so DDP's per-bucket dense all-reduces round differently: 1e-6."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ds_xc import CompressedDDPHook, CompressedOptimizer, compressed_ddp_hook
from ds_xc.config import ConfigError

IN, HID, OUT, B = 24, 96, 80, 8
BUCKET_MB = 0.012  # about 12 kB: DDP makes several buckets of this model


def _net():
    torch.manual_seed(3)  # small biases stay dense (min_numel), the weights are compressed
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, HID), torch.nn.Tanh(),
                               torch.nn.Linear(HID, OUT))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(B + rank, IN, generator=g), torch.randn(B + rank, OUT, generator=g)  # uneven rows


def _ddp(config, count_buckets=True):
    net = _net()
    ddp = DDP(net, bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    hook = CompressedDDPHook(ddp, opt, config)
    buckets = set()

    def counting_hook(state, bucket):
        buckets.add(bucket.index())
        return compressed_ddp_hook(state, bucket)
    ddp.register_comm_hook(hook, counting_hook if count_buckets else compressed_ddp_hook)
    return net, ddp, opt, hook, buckets


def _ddp_steps(rank, ddp, opt, steps, first=0):
    grads = []
    for step in range(first, first + steps):
        x, t = _batch(rank, step)
        ((ddp(x) - t) ** 2).mean().backward()
        grads.append([p.grad.clone() for p in ddp.module.parameters()])
        opt.step()
        opt.zero_grad()
    return grads


def _run_equal(rank, world, config, steps):
    ref = _net()
    ref_opt = CompressedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5), config)
    ref_grads = []
    for step in range(steps):
        x, t = _batch(rank, step)
        ((ref(x) - t) ** 2).mean().backward()
        ref_opt.reduce_gradients()
        ref_grads.append([p.grad.clone() for p in ref.parameters()])
        ref_opt.skip_reduction()  # the next step() only steps the inner optimizer
        ref_opt.step()
        ref_opt.zero_grad()
    net, ddp, opt, hook, buckets = _ddp(config)
    grads = _ddp_steps(rank, ddp, opt, steps)
    res = [(ref_opt.state[p].get("residual"), hook.optimizer.state[q].get("residual"))
           for p, q in zip(ref.parameters(), net.parameters())]
    return {"buckets": len(buckets),
            "grad": max((a - b).abs().max().item() for s0, s1 in zip(ref_grads, grads) for a, b in zip(s0, s1)),
            "param": max((a - b).abs().max().item() for a, b in zip(ref.parameters(), net.parameters())),
            "residual": max([(a - b).abs().max().item() for a, b in res if a is not None] or [0.0]),
            "residual_norm": sum(float(a.norm()) for a, _ in res if a is not None),
            "has_residual": [(a is None, b is None) for a, b in res],
            "tau": [[o.state[p].get("tau") for p in o.params] for o in (ref_opt, hook.optimizer)],
            "stats": [o.stats()["global_density"] for o in (ref_opt, hook.optimizer)],
            "steps": [o.stats()["steps"] for o in (ref_opt, hook.optimizer)],
            "moved": max((p.detach() - q.detach()).abs().max().item() for p, q in zip(net.parameters(),
                                                                                    _net().parameters()))}


CONFIGS = [
    {"method": "bayes_prior", "density": 0.05, "min_numel": 256, "warmup_steps": 1, "stats_sync_interval": 2},
    {"method": "topk", "density": 0.05, "min_numel": 256, "momentum_correction": 0.5, "value_dtype": "bfloat16"},
    {"method": "randomk", "density": 0.1, "min_numel": 256},
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", CONFIGS, ids=["bayes_prior", "topk_momentum_bf16", "randomk"])
def test_ddp_hook_equals_compressed_optimizer(pools, world, config):
    tol = 0.0 if world == 2 else 1e-6
    for r in pools(world).run(_run_equal, config, 5):
        assert r["buckets"] > 1, r  # DDP's buckets split the layout
        assert r["grad"] <= tol and r["param"] <= tol and r["residual"] <= tol, r
        assert all(a == b for a, b in r["has_residual"]) and r["residual_norm"] > 0, r
        for a, b in zip(*r["tau"]):
            assert (a is None and b is None) or a == pytest.approx(b, rel=1e-5), r["tau"]
        assert r["stats"][0] == r["stats"][1] and r["steps"] == [5, 5], r
        assert r["moved"] > 0  # training happened


def _run_resume(rank, world, config, tmp):
    net, ddp, opt, hook, _ = _ddp(config, count_buckets=False)  # the library's hook as registered
    _ddp_steps(rank, ddp, opt, 5)
    whole = [p.detach().clone() for p in net.parameters()]
    whole_res = [hook.optimizer.state[p].get("residual") for p in net.parameters()]
    net, ddp, opt, hook, _ = _ddp(config)
    _ddp_steps(rank, ddp, opt, 2)
    path = f"{tmp}/hook_rank{rank}.pt"
    torch.save({"hook": hook.state_dict(), "opt": opt.state_dict(), "net": net.state_dict()}, path)
    state = torch.load(path, weights_only=True)
    net, ddp, opt, hook, _ = _ddp(config)
    net.load_state_dict(state["net"])
    opt.load_state_dict(state["opt"])
    hook.load_state_dict(state["hook"])
    _ddp_steps(rank, ddp, opt, 3, first=2)
    resumed_res = [hook.optimizer.state[p].get("residual") for p in net.parameters()]
    # the same run without loading the residuals: must differ, or the test could not fail
    net2, ddp2, opt2, _, _ = _ddp(config)
    net2.load_state_dict(state["net"])
    opt2.load_state_dict(state["opt"])
    _ddp_steps(rank, ddp2, opt2, 3, first=2)
    return {"param": max((a - b).abs().max().item() for a, b in zip(whole, net.parameters())),
            "residual": max((a - b).abs().max().item() for a, b in zip(whole_res, resumed_res) if a is not None),
            "fresh_param": max((a - b).abs().max().item() for a, b in zip(whole, net2.parameters())),
            "step": hook.stats()["steps"]}


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_hook_resume_equals_uninterrupted(pools, world, tmp_path):
    tol = 0.0 if world == 2 else 1e-6  # gloo's 3-rank all-reduce may sum in another order from run to run
    for r in pools(world).run(_run_resume, CONFIGS[0], str(tmp_path)):
        assert r["param"] <= tol and r["residual"] <= tol and r["step"] == 5, r
        assert r["fresh_param"] > 1000 * max(tol, 1e-9), r


def _run_refused(rank, world, config):
    net = _net()
    ddp = DDP(net)
    try:
        CompressedDDPHook(ddp, torch.optim.SGD(net.parameters(), lr=0.1), config)
    except ConfigError as e:
        return str(e)
    return None


def test_ddp_hook_refuses_bucket_granularity(pools):
    msgs = pools(2).run(_run_refused, {"method": "topk", "density": 0.05, "granularity": "bucket"})
    assert all("gradient_compression.granularity: got 'bucket'" in m for m in msgs), msgs
