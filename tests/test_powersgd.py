"""method powersgd: the low-rank reduction against a float64 single-process reference that
simulates the ranks (P per rank, mean, orthonormalisation by a sign-fixed QR, Q per rank,
mean, approximation, residual), on 2 and 3 gloo ranks with uneven shapes (37 x 19, a conv
kernel 8 x 3 x 5 x 5 viewed 8 x 75, 2 x 60 whose rank is capped at 2) over several steps,
with and without warm start and error feedback; full rank == the dense mean; the error
feedback identity e = M - approx bit for bit; 1-D and small tensors dense; bytes;
checkpoint resume bit for bit; config errors and the refusals (overlapped reducer, DDP
hook, node groups)."""
import copy

import pytest
import torch

from ds_xc.compression import (CompressedDDPHook, CompressedOptimizer, NodeGroups, load_compression_state,
                               parse_compression, save_compression_state)
from ds_xc.compression.compressors import COMPRESSORS
from ds_xc.compression.powersgd import Q_KEY, Q_STREAM, effective_rank, orthonormalise_, wire_floats
from ds_xc.compression.seeds import mix_seed
from ds_xc.parallel.collectives import allreduce_bytes
from ds_xc.config import ConfigError
from tests.dist_pool import catch
from tests.test_compression_dist import _train_classifier as train_mlp

SHAPES = [(37, 19), (8, 3, 5, 5), (300,), (5, 3), (2, 60)]  # (300,): 1-D, dense; (5, 3): small, dense
MIN_NUMEL = 100
COMPRESSED = [0, 1, 4]
SEED = 11


def _cfg(rank=3, warm=True, ef=True, warmup=0):
    return {"method": "powersgd", "min_numel": MIN_NUMEL, "seed": SEED, "error_feedback": ef,
            "warmup_steps": warmup, "powersgd": {"rank": rank, "warm_start": warm}}


def _grads(step, rank):
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 5)
    return [torch.randn(s, generator=g) * (1.0 + i) for i, s in enumerate(SHAPES)]


def _params():
    return [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]


def _step(opt, params, step, rank):
    for p, g in zip(params, _grads(step, rank)):
        p.grad = g.clone()
    opt.step()


def _run(rank, world, cfg, steps):
    """Per step: local gradients, residuals before/after, reduced gradients, Q's, bytes of the step."""
    params = _params()
    opt = CompressedOptimizer(torch.optim.SGD(params, lr=0.1), cfg)
    out = []
    for step in range(steps):
        e_old = [opt.state[p]["residual"].clone() if "residual" in opt.state[p] else None for p in params]
        for p, g in zip(params, _grads(step, rank)):
            p.grad = g.clone()
        opt.reduce_gradients()
        out.append({"g": _grads(step, rank), "red": [p.grad.clone() for p in params], "e_old": e_old,
                    "e": [opt.state[p]["residual"].clone() if "residual" in opt.state[p] else None for p in params],
                    "q": [opt.state[p][Q_KEY].clone() if Q_KEY in opt.state[p] else None for p in params],
                    "bytes": opt.stats()["last"]["bytes_sent"]})
        opt.inner.step()
    return {"steps": out, "stats": opt.stats(), "sparse": opt.layout.sparse,
            "params": [p.detach().clone() for p in params]}


# ---------------------------------------------------------------------------- the float64 reference
def _q0(step, index, shape):
    """The shared starting Q of tensor ``index`` at ``step``: seed (seed, step, tensor, Q_STREAM)."""
    gen = torch.Generator().manual_seed(mix_seed(SEED, step, index, Q_STREAM))
    return torch.randn(shape, generator=gen, dtype=torch.float32).double()


def _orth64(p):
    """Orthonormal columns spanning p (full column rank): QR with the signs of Gram-Schmidt (diag R > 0)."""
    q, r = torch.linalg.qr(p)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def _reference(world, steps, rank, warm, ef, warmup=0):
    """What every rank should hold after each step: reduced gradients, residuals per rank, Q's."""
    e = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(world)]
    qs, out = {}, []
    for step in range(steps):
        grads = [[g.double() for g in _grads(step, r)] for r in range(world)]
        red, qout = [], [None] * len(SHAPES)
        for i, shape in enumerate(SHAPES):
            if step < warmup or i not in COMPRESSED:
                red.append(torch.stack([grads[r][i] for r in range(world)]).mean(0))
                continue
            n = shape[0]
            m = grads[0][i].numel() // n
            ms = [(grads[r][i] + (e[r][i] if ef else 0.0)).reshape(n, m) for r in range(world)]
            q = qs[i] if warm and i in qs else _q0(step, i, (m, min(rank, n, m)))
            p = _orth64(torch.stack([mr @ q for mr in ms]).mean(0))  # (n, r)
            q = torch.stack([mr.t() @ p for mr in ms]).mean(0)  # (m, r)
            approx = p @ q.t()  # (n, m)
            if ef:
                for r in range(world):
                    e[r][i] = (ms[r] - approx).reshape(shape)
            qs[i] = qout[i] = q
            red.append(approx.reshape(shape))
        out.append({"red": red, "e": [[t.clone() for t in er] for er in e], "q": qout})
    return out


def _close(a, b, tol):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("warm,ef,warmup", [(True, True, 0), (False, True, 0), (True, False, 1)])
def test_matches_the_float64_reference(pools, world, warm, ef, warmup):
    steps, rank = 4, 3
    results = pools(world).run(_run, _cfg(rank, warm, ef, warmup), steps)
    ref = _reference(world, steps, rank, warm, ef, warmup)
    assert results[0]["sparse"] == COMPRESSED
    for step in range(steps):
        for r, res in enumerate(results):
            got = res["steps"][step]
            for i in range(len(SHAPES)):
                _close(got["red"][i], ref[step]["red"][i], 2e-4)
                assert torch.equal(got["red"][i], results[0]["steps"][step]["red"][i])  # replicas agree bitwise
                if ef and i in COMPRESSED and step >= warmup:
                    _close(got["e"][i], ref[step]["e"][r][i], 2e-4)
                if warm and i in COMPRESSED and step >= warmup:
                    _close(got["q"][i], ref[step]["q"][i], 2e-4)
                    assert torch.equal(got["q"][i], results[0]["steps"][step]["q"][i])
                if not warm or i not in COMPRESSED:
                    assert got["q"][i] is None  # Q is kept only for the warm start
    # the approximation is not the mean (rank 3 < min(n, m) for the first two tensors)
    dense = torch.stack([_grads(steps - 1, r)[0] for r in range(world)]).mean(0)
    assert (results[0]["steps"][-1]["red"][0] - dense).norm() > 0.1 * dense.norm()


def test_error_feedback_identity_bitwise_and_bytes(pools):
    world, rank = 3, 3
    results = pools(world).run(_run, _cfg(rank), 3)
    dense_numel = sum(torch.Size(s).numel() for i, s in enumerate(SHAPES) if i not in COMPRESSED)
    mats = [(s[0], torch.Size(s).numel() // s[0]) for i, s in enumerate(SHAPES) if i in COMPRESSED]
    p_floats = sum(n * min(rank, n, m) for n, m in mats)
    q_floats = sum(m * min(rank, n, m) for n, m in mats)
    expected = (allreduce_bytes(4 * dense_numel, world) + allreduce_bytes(4 * p_floats, world)
                + allreduce_bytes(4 * q_floats, world))
    for res in results:
        for st in res["steps"]:
            for i in COMPRESSED:
                assert torch.equal(st["e"][i], (st["e_old"][i] + st["g"][i]) - st["red"][i])  # e = M - approx
            assert st["bytes"] == expected
        stats = res["stats"]
        compressed_numel = sum(n * m for n, m in mats)
        assert stats["density"] == pytest.approx((p_floats + q_floats) / compressed_numel)
        assert stats["bytes_sent"] == 3 * expected
        assert stats["dense_bytes"] == 3 * allreduce_bytes(4 * sum(torch.Size(s).numel() for s in SHAPES), world)
    assert wire_floats([SHAPES[i] for i in COMPRESSED], rank) == p_floats + q_floats


@pytest.mark.parametrize("world", [2, 3])
def test_full_rank_is_the_dense_mean(pools, world):
    results = pools(world).run(_run, _cfg(rank=64), 3)
    for step in range(3):
        mean = [torch.stack([_grads(step, r)[i].double() for r in range(world)]).mean(0) for i in range(len(SHAPES))]
        for res in results:
            st = res["steps"][step]
            for i in range(len(SHAPES)):
                _close(st["red"][i], mean[i], 1e-5)
        for i in COMPRESSED:  # e_r = M_r - mean: each rank keeps its deviation, which sums to zero
            parts = [res["steps"][step]["e"][i].double() for res in results]
            total = sum(parts)
            # up to float32 rounding relative to the entries (the full-rank factors are orthogonalised in
            # float32): 1.49e-5 at entries up to 3.0 on 3 ranks (torch 2.13), over a flat 1e-5
            scale = max(1.0, max(float(p.abs().max()) for p in parts))
            _close(total, torch.zeros_like(total), 1e-5 * scale)


def _train_classifier(rank, world, cfg, steps):
    """The MLP of tests/test_compression_dist.py on the built-in synthetic data (real training
    gradients, SGD momentum 0.9) at lr 0.1; the losses."""
    return train_mlp(rank, world, cfg, steps, 0.1)["losses"]


def test_training_with_rank_4_follows_dense_training(pools):
    """240 steps on 2 ranks: PowerSGD rank 4 (warm start, error feedback) trains, and ends within 20%
    of dense training's loss. Measured (mean of the last 20 losses): dense 0.788, rank 4 0.826
    (1.05x), rank 4 without warm start 0.842 (1.07x), rank 1 1.217 (1.55x); top-k at density
    0.01 0.853 (1.08x)."""
    finals = {}
    for name, cfg in {"dense": {"method": "none"},
                      "powersgd": {"method": "powersgd", "min_numel": 4096, "powersgd": {"rank": 4}}}.items():
        losses = pools(2).run(_train_classifier, cfg, 240)[0]
        finals[name] = sum(losses[-20:]) / 20
        assert finals[name] < 0.7 * sum(losses[:5]) / 5, (name, losses[:5], finals[name])
    assert finals["powersgd"] < 1.2 * finals["dense"], finals


# ---------------------------------------------------------------------------- one process
def test_orthonormalise_against_qr_and_on_rank_deficient_input():
    g = torch.Generator().manual_seed(3)
    p = torch.randn(50, 5, generator=g)
    ref = _orth64(p.double())
    _close(orthonormalise_(p.clone()), ref, 1e-5)
    d = torch.randn(40, 6, generator=g)
    d[:, 3] = d[:, 0] - 2 * d[:, 1]  # dependent: its remainder is rounding noise
    d[:, 5] = 0.0  # zero: stays zero
    out = orthonormalise_(d.clone())
    gram = out.double().t() @ out.double()
    _close(gram, torch.diag(torch.tensor([1.0, 1, 1, 1, 1, 0], dtype=torch.float64)), 1e-5)
    assert torch.equal(out[:, 5], torch.zeros(40))


def test_zero_first_gradient_redraws_q():
    """A tensor whose first gradient is zero leaves Q = 0; the next step draws a fresh Q (full rank: exact)."""
    params = _params()
    opt = CompressedOptimizer(torch.optim.SGD(params, lr=0.1), _cfg(rank=64))
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.reduce_gradients()
    assert not opt.state[params[0]][Q_KEY].any()
    grads = _grads(1, 0)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.reduce_gradients()
    for i in COMPRESSED:
        _close(params[i].grad, grads[i], 1e-5)


def _train(opt, params, start, steps):
    for step in range(start, start + steps):
        _step(opt, params, step, 0)


def test_state_dict_round_trip_continues_bitwise():
    cfg = _cfg(rank=2)
    pa = _params()
    opt_a = CompressedOptimizer(torch.optim.SGD(pa, lr=0.1, momentum=0.9), cfg)
    _train(opt_a, pa, 0, 3)
    saved = copy.deepcopy(opt_a.state_dict())
    snapshot = [p.detach().clone() for p in pa]
    assert set(saved["compression"]["state"][0]) == {"residual", Q_KEY}
    _train(opt_a, pa, 3, 3)
    pb = [torch.nn.Parameter(t.clone()) for t in snapshot]
    opt_b = CompressedOptimizer(torch.optim.SGD(pb, lr=0.1, momentum=0.9), cfg)
    opt_b.load_state_dict(saved)
    _train(opt_b, pb, 3, 3)
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
    for i in COMPRESSED:
        assert torch.equal(opt_a.state[pa[i]][Q_KEY], opt_b.state[pb[i]][Q_KEY])
        assert torch.equal(opt_a.state[pa[i]]["residual"], opt_b.state[pb[i]]["residual"])


def _checkpoint_run(rank, world, path):
    """6 steps straight vs 3 steps, per-rank save, a fresh optimizer loading it, 3 more steps."""
    cfg = _cfg(rank=2)
    pa = _params()
    opt_a = CompressedOptimizer(torch.optim.SGD(pa, lr=0.1), cfg)
    for step in range(6):
        _step(opt_a, pa, step, rank)
    pb = _params()
    opt_b = CompressedOptimizer(torch.optim.SGD(pb, lr=0.1), cfg)
    for step in range(3):
        _step(opt_b, pb, step, rank)
    save_compression_state(path, opt_b)
    pc = [torch.nn.Parameter(p.detach().clone()) for p in pb]
    opt_c = CompressedOptimizer(torch.optim.SGD(pc, lr=0.1), cfg)
    found = load_compression_state(path, opt_c)
    for step in range(3, 6):
        _step(opt_c, pc, step, rank)
    same = all(torch.equal(a, c) for a, c in zip(pa, pc))
    same_q = all(torch.equal(opt_a.state[pa[i]][Q_KEY], opt_c.state[pc[i]][Q_KEY]) for i in COMPRESSED)
    return found, same, same_q, float(opt_a.state[pa[0]]["residual"].norm())


def test_per_rank_checkpoint_resumes_bitwise(pools, tmp_path):
    results = pools(2).run(_checkpoint_run, str(tmp_path))
    for found, same, same_q, _ in results:
        assert found and same and same_q
    assert results[0][3] != results[1][3]  # the residuals are per rank


def test_bf16_gradients_full_rank_single_process():
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in SHAPES]
    opt = CompressedOptimizer(torch.optim.SGD(params, lr=0.1), _cfg(rank=64))
    grads = [g.bfloat16() for g in _grads(0, 0)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.reduce_gradients()
    for i in COMPRESSED:
        assert opt.state[params[i]]["residual"].dtype == torch.float32
        _close(params[i].grad, grads[i], 2e-2)  # the exact mean, rounded to bf16


# ---------------------------------------------------------------------------- config and refusals
def _err(section) -> str:
    with pytest.raises(ConfigError) as info:
        parse_compression(section)
    return str(info.value)


def test_config_defaults_and_registry():
    c = parse_compression({"method": "powersgd"})
    assert c.powersgd.rank == 4 and c.powersgd.warm_start and c.enabled
    assert c.resolved_allocation == "numel"
    assert parse_compression({"method": "powersgd", "allocation": "nonzero"}).resolved_allocation == "numel"
    assert COMPRESSORS["powersgd"].low_rank and COMPRESSORS["powersgd"].min_dim == 2
    assert effective_rank((8, 3, 5, 5), 4) == 4 and effective_rank((2, 60), 4) == 2


@pytest.mark.parametrize("extra,key,words", [
    ({"powersgd": {"rank": 0}}, "gradient_compression.powersgd.rank", "greater than or equal to 1"),
    ({"powersgd": {"rnak": 2}}, "gradient_compression.powersgd.rnak", "unknown key"),
    ({"granularity": "bucket"}, "granularity='bucket' with method='powersgd'", "allowed: 'tensor'"),
    ({"hierarchy": {"ranks_per_node": 2}}, "hierarchy.ranks_per_node=2 with method='powersgd'", "allowed: 0 or 1"),
    ({"momentum_correction": 0.5}, "momentum_correction=0.5 with method='powersgd'", "allowed: 0.0"),
    ({"value_dtype": "bfloat16"}, "value_dtype='bfloat16' with method='powersgd'", "allowed: 'float32'"),
])
def test_config_errors_name_field_value_and_allowed(extra, key, words):
    msg = _err(dict({"method": "powersgd"}, **extra))
    assert key in msg and words in msg
    assert "gradient_compression" in msg


def test_overlapped_reducer_and_node_groups_refused():
    params = _params()
    opt = CompressedOptimizer(torch.optim.SGD(params, lr=0.1), _cfg())
    with pytest.raises(ConfigError, match="overlap_grad_reduce=true with gradient_compression.method='powersgd'"):
        opt.overlapped_reducer()
    nodes = NodeGroups(intra=None, inter=None, local_rank=0, local_size=2, num_nodes=1)
    with pytest.raises(ConfigError, match="method='powersgd' with node_groups"):
        CompressedOptimizer(torch.optim.SGD(params, lr=0.1), _cfg(), node_groups=nodes)


def _ddp_refusal(rank, world):
    model = torch.nn.Linear(20, 30)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return catch(lambda: CompressedDDPHook(ddp, torch.optim.SGD(model.parameters(), lr=0.1), _cfg()))


def test_ddp_hook_refused_pointing_to_torch_hook(pools):
    for kind, msg in pools(2).run(_ddp_refusal):
        assert kind == "ConfigError"
        assert "gradient_compression.method: got 'powersgd'" in msg and "powerSGD_hook" in msg
