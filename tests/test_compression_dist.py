"""Compressed reduction on 2 and 4 gloo ranks, checked against single-process references:
density 1.0 == the dense mean; otherwise the reduced gradient == the mean of what each rank
sent, where sent + new residual == old residual + gradient bit for bit; replicas stay
bit-identical; random-k indices agree; bayes_prior density over 100 steps of real
training; convergence; per-rank checkpoints; 2 nodes x 2 ranks hierarchy."""
import logging

import pytest
import torch

from ds_xc.compression import CompressedOptimizer, load_compression_state, save_compression_state

IN, HID, OUT = 48, 160, 24  # compressed: 48*160 and 160*24 weights; biases dense (min_numel 1000)


def _net(dtype=torch.float32):
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT)).to(dtype)


def _backward(model, step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, IN, generator=g).to(dtype)
    y = torch.randint(0, OUT, (8,), generator=g)
    torch.nn.functional.cross_entropy(model(x).float(), y).backward()


def _reductions(rank, world, cfg, steps, dtype="float32"):
    """Per step: local gradients, residual before/after, reduced gradients; final parameters."""
    dt = getattr(torch, dtype)
    model = _net(dt)
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), cfg)
    params = list(model.parameters())
    res = opt._buffers.get("residual")
    out = []
    for step in range(steps):
        opt.zero_grad()
        _backward(model, step, rank, dt)
        g = [p.grad.float().clone() for p in params]
        e_old = res.clone() if res is not None else None
        opt.reduce_gradients()
        out.append({"g": g, "red": [p.grad.float().clone() for p in params], "e_old": e_old,
                    "e_new": res.clone() if res is not None else None})
        opt.inner.step()
    lay = opt.layout
    return {"steps": out, "params": [p.detach().clone() for p in params], "stats": opt.stats(),
            "sparse": lay.sparse, "starts": lay.starts, "region": lay.region, "padded": lay.padded}


def _flat(tensors, res):
    """The compressed parameters' tensors as one padded bucket, like the optimizer's."""
    out = torch.zeros(res["padded"])
    for i, s in zip(res["sparse"], res["starts"]):
        out[s: s + tensors[i].numel()] = tensors[i].reshape(-1)
    return out


def _assert_replicas_identical(results):
    for r in results[1:]:
        for a, b in zip(results[0]["params"], r["params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["none", "topk", "randomk", "bayes_prior"])
def test_density_one_is_the_dense_mean(pools, world, method):
    cfg = {"method": method, "density": 1.0, "min_numel": 1000}
    results = pools(world).run(_reductions, cfg, 2)
    for step in range(2):
        for i in range(len(results[0]["params"])):
            mean = torch.stack([r["steps"][step]["g"][i].double() for r in results]).mean(0)
            for r in results:
                torch.testing.assert_close(r["steps"][step]["red"][i].double(), mean, rtol=0, atol=1e-6)
    _assert_replicas_identical(results)
    if method != "none":
        assert results[0]["stats"]["density"] == 1.0


def _check_sparse_exchange(results, x_of, value_dtype="float32"):
    """sent_r = e_old + x - e_new is all-or-nothing per element, and the reduction is its mean."""
    sent_sets = []
    for step in range(len(results[0]["steps"])):
        sents = []
        for rank, r in enumerate(results):
            s = r["steps"][step]
            v = s["e_old"] + x_of(results, step, rank)  # fp32, as the optimizer computes it
            lo, hi = r["region"]
            v, e_new = v[lo:hi], s["e_new"][lo:hi]
            mask = e_new != v  # elements that were sent
            if value_dtype == "float32":
                assert torch.equal(e_new[mask], torch.zeros_like(e_new[mask]))
            sent = torch.zeros(r["padded"])
            sent[lo:hi] = torch.where(mask, v - e_new, torch.zeros_like(v))
            assert torch.equal(sent[lo:hi] + e_new, v)
            sents.append(sent)
            sent_sets.append(mask.nonzero().squeeze(1))
        reduced = _flat(results[0]["steps"][step]["red"], results[0])
        return_mean = _group_mean(results, sents)
        torch.testing.assert_close(reduced.double(), return_mean, rtol=0, atol=1e-6)
        for r in results[1:]:
            assert torch.equal(_flat(r["steps"][step]["red"], r), reduced)
    return sent_sets


def _group_mean(results, sents):
    """Mean over ranks of sent vectors; with a hierarchy each slice averages over the nodes."""
    return torch.stack([s.double() for s in sents]).sum(0) / _num_nodes(results)


def _num_nodes(results):
    regions = {r["region"] for r in results}
    return len(results) // len(regions)


def _own_gradient(results, step, rank):
    return _flat(results[rank]["steps"][step]["g"], results[rank])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method,value_dtype,momentum,granularity", [
    ("topk", "float32", 0.0, "tensor"), ("randomk", "float32", 0.0, "tensor"),
    ("bayes_prior", "float32", 0.0, "tensor"), ("bayes_prior", "bfloat16", 0.0, "tensor"),
    ("topk", "float32", 0.9, "tensor"), ("topk", "float32", 0.0, "bucket"), ("bayes_prior", "float32", 0.0, "bucket")])
def test_reduction_is_the_mean_of_what_each_rank_sent(pools, world, method, value_dtype, momentum, granularity):
    cfg = {"method": method, "density": 0.05, "min_numel": 1000, "value_dtype": value_dtype,
           "stats_sync_interval": 2, "momentum_correction": momentum, "granularity": granularity}
    if momentum and world == 4:
        pytest.skip("momentum correction: one world size is enough")
    results = pools(world).run(_reductions, cfg, 3)
    if momentum:  # x = u_t = m u_{t-1} + g_t, u zeroed where sent: rebuild u from the recorded steps
        us = [torch.zeros(results[0]["padded"]) for _ in results]

        def x_of(res, step, rank):
            g = _own_gradient(res, step, rank)
            if step > 0:
                prev = res[rank]["steps"][step - 1]
                u_prev = us[rank] * momentum + _own_gradient(res, step - 1, rank)
                us[rank] = torch.where(prev["e_new"] != prev["e_old"] + u_prev, 0.0, u_prev)
            return us[rank] * momentum + g
    else:
        x_of = _own_gradient
    sets = _check_sparse_exchange(results, x_of, value_dtype)
    if method == "randomk":
        for step in range(3):
            per_rank = sets[step * world: (step + 1) * world]
            assert all(torch.equal(per_rank[0], s) for s in per_rank[1:])
    elif method == "topk":
        assert results[0]["stats"]["density"] == pytest.approx(0.05, abs=1e-3)
        if granularity == "bucket":  # one selection over both weights: their shares differ
            last = results[0]["steps"][-1]
            shares = [float((last["e_new"][s: s + results[0]["params"][i].numel()] == 0).float().mean())
                      for i, s in zip(results[0]["sparse"], results[0]["starts"])]
            assert abs(shares[0] - shares[1]) > 0.005
    _assert_replicas_identical(results)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("method", ["topk", "bayes_prior"])
def test_density_warmup_on_ranks(pools, world, method):
    """density_warmup_steps on 2 and 3 ranks (uneven batches: every rank's own gradient): the reduction is
    still the mean of what each rank sent, replicas stay identical, and top-k sends round(n d_c) per tensor
    and rank at compressed step c of the geometric schedule."""
    cfg = {"method": method, "density": 0.02, "min_numel": 1000, "allocation": "numel",
           "density_warmup_steps": 3, "density_warmup_start": 0.3}
    results = pools(world).run(_reductions, cfg, 4)
    _check_sparse_exchange(results, _own_gradient)
    _assert_replicas_identical(results)
    if method == "topk":
        sizes = [results[0]["params"][i].numel() for i in results[0]["sparse"]]
        for step in range(4):
            d = 0.02 * (0.3 / 0.02) ** (1 - step / 3) if step < 3 else 0.02
            for r in results:
                sent = int((r["steps"][step]["e_new"] != r["steps"][step]["e_old"] + _flat(
                    r["steps"][step]["g"], r)).sum())
                assert sent == sum(round(d * n) for n in sizes), (step, sent)


@pytest.mark.parametrize("method", ["topk", "bayes_prior"])
def test_hierarchy_two_nodes_of_two(pools, method):
    """Dense node mean by reduce-scatter, sparse exchange per slice across nodes, all-gather."""
    cfg = {"method": method, "density": 0.05, "min_numel": 1000, "hierarchy": {"ranks_per_node": 2},
           "stats_sync_interval": 2}
    results = pools(4).run(_reductions, cfg, 3)
    assert [r["region"][0] for r in results] == [0, results[0]["padded"] // 2] * 2

    def node_mean(res, step, rank):
        node = rank // 2
        a, b = (_own_gradient(res, step, node * 2 + k) for k in range(2))
        return (a + b) / 2
    _check_sparse_exchange(results, node_mean)
    _assert_replicas_identical(results)
    stats = results[0]["stats"]
    assert 0 < stats["intra_bytes_sent"] < stats["bytes_sent"]
    dense = pools(4).run(_reductions, dict(cfg, density=1.0), 1)
    for i in range(len(dense[0]["params"])):
        mean = torch.stack([r["steps"][0]["g"][i].double() for r in dense]).mean(0)
        torch.testing.assert_close(dense[0]["steps"][0]["red"][i].double(), mean, rtol=0, atol=1e-6)


def test_bf16_gradients_two_ranks(pools):
    results = pools(2).run(_reductions, {"method": "bayes_prior", "density": 1.0, "min_numel": 1000}, 2, "bfloat16")
    for i in range(len(results[0]["params"])):
        mean = torch.stack([r["steps"][0]["g"][i].double() for r in results]).mean(0)
        torch.testing.assert_close(results[0]["steps"][0]["red"][i].double(), mean, rtol=1e-2, atol=1e-4)
    _assert_replicas_identical(results)


# ---------------------------------------------------------------------------- training
def _train_classifier(rank, world, cfg, steps, lr=0.5):
    """An MLP on the built-in synthetic data: real training gradients; returns losses and stats."""
    from ds_xc.data import build_dataset
    from ds_xc.models import build_backbone
    data = build_dataset("synthetic", 64, seed=3)
    torch.manual_seed(0)
    model = build_backbone(data, 64, hidden_dim=256)
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), cfg)
    losses, densities = [], []
    for step in range(steps):
        x, y = data.train_batch(step, 32, rank, world)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        densities.append(opt.stats()["last"].get("global_density", 1.0))
    return {"losses": losses, "stats": opt.stats(), "densities": densities}


@pytest.mark.parametrize("form,velocity", [("uniform", None), ("dirichlet", None), ("tuned", 0.0),
                                           ("tuned", None)])
def test_bayes_prior_density_within_20_percent_over_100_steps(pools, form, velocity):
    """velocity None: the default momentum correction, m = the SGD's 0.9 (the selection ranks the velocity)."""
    cfg = {"method": "bayes_prior", "density": 0.01, "min_numel": 4096, "preset": "paper",
           "prior": {"form": form, "strength": 0.1, "pseudo_count": 1.0}, "momentum_correction": velocity}
    if form == "tuned":  # exploit_power 32, no exploration, thresholds every 2 steps
        cfg = {"method": "bayes_prior", "density": 0.01, "min_numel": 4096, "preset": "tuned",
               "momentum_correction": velocity}
    results = pools(2).run(_train_classifier, cfg, 100, 0.2)
    for r in results:
        assert r["stats"]["compressed_steps"] == 100
        # no step far off either (a stray step triggers a re-sync); with exploit_power 32 the thresholds of the
        # first syncs (steps 0, 1, 2, 4, 8), from a histogram of 4 bins an octave, can overshoot a few steps;
        # with a velocity of m = 0.9 for ~30 steps (u builds up to 10 g: between two syncs the values grow)
        settled = 0 if form != "tuned" else 10 if velocity == 0.0 else 30
        assert max(r["densities"][settled:]) < 0.02 and max(r["densities"]) < 0.05
        assert sum(r["densities"][settled:]) / (100 - settled) == pytest.approx(0.01, rel=0.2)
        overall = 0.2 if settled < 30 else 0.3  # the velocity's first steps overshoot: 0.012 measured
        assert r["stats"]["global_density"] == pytest.approx(0.01, rel=overall)
        assert r["stats"]["density"] == pytest.approx(0.01, rel=overall)


CONVERGENCE = {"none": {}, "topk": {}, "randomk": {}, "bayes_prior": {},
               "bayes_sharp": {"method": "bayes_prior", "exploit_power": 8.0, "prior": {"strength": 0.0}}}


def test_convergence_matches_dense_training(pools):
    """Density 0.01 with error feedback, SGD lr 0.1 momentum 0.9, 240 steps on 2 ranks: every
    method trains; top-k and sharpened bayes_prior end within 25% of dense training's loss
    (measured: 1.08x and 1.11x; at 120 steps they still lag by 1.4x, and random-k and
    bayes_prior with exploit_power 1 lag by about 1.45x even at 240: see docs)."""
    finals = {}
    for name, extra in CONVERGENCE.items():
        cfg = dict({"method": name, "density": 0.01, "min_numel": 4096}, **extra)
        res = pools(2).run(_train_classifier, cfg, 240, 0.1)
        finals[name] = sum(res[0]["losses"][-20:]) / 20
        first = sum(res[0]["losses"][:5]) / 5
        assert finals[name] < 0.7 * first, (name, first, finals[name])
    for name in ["topk", "bayes_sharp"]:
        assert finals[name] < 1.25 * finals["none"], finals


# ---------------------------------------------------------------------------- checkpoints
def _checkpoint_run(rank, world, path, phase):
    """phase 'straight': 6 steps; 'save': 3 steps then save; 'resume': load, then steps 3..5."""
    cfg = {"method": "bayes_prior", "density": 0.05, "min_numel": 1000, "stats_sync_interval": 2}
    model = _net()
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), cfg,
                              rank_state_in_state_dict=False)
    start, stop = {"straight": (0, 6), "save": (0, 3), "resume": (3, 6)}[phase]
    if phase == "resume":
        state = torch.load(f"{path}/model_{min(rank, 1)}.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])  # rank 0's inner state, as DeepSpeed would
        found = load_compression_state(path, opt)
    for step in range(start, stop):
        opt.zero_grad()
        _backward(model, step, rank)
        opt.step()
    if phase == "save":
        save_compression_state(path, opt)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}/model_{rank}.pt")
    res = opt._buffers["residual"]
    return {"params": [p.detach().clone() for p in model.parameters()], "residual_norm": float(res.norm()),
            "steps": opt.stats()["steps"], "found": found if phase == "resume" else None}


def test_per_rank_checkpoint_round_trip_and_world_size_change(pools, tmp_path, caplog):
    path = str(tmp_path)
    straight = pools(2).run(_checkpoint_run, path, "straight")
    pools(2).run(_checkpoint_run, path, "save")
    resumed = pools(2).run(_checkpoint_run, path, "resume")
    for a, b in zip(straight, resumed):
        assert b["found"] and b["steps"] == 6
        for pa, pb in zip(a["params"], b["params"]):
            assert torch.equal(pa, pb)
    assert straight[0]["residual_norm"] != straight[1]["residual_norm"]  # residuals are per rank
    with caplog.at_level(logging.WARNING):
        other = pools(4).run(_checkpoint_run, path, "resume")
    for r in other:
        assert r["found"] is False and r["steps"] == 6


class _EmbedNet(torch.nn.Module):
    """A row-sparse gradient (the embedding: only the batch's tokens) next to dense layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(400, 24)  # 9600 elements, compressed
        self.fc = torch.nn.Linear(48, 40)  # 1920 weight elements, compressed; bias dense

    def forward(self, tokens):
        return self.fc(self.embed(tokens).flatten(1))


def _alloc_reductions(rank, world, method, steps=4):
    """Like _reductions, on _EmbedNet with ``allocation: nonzero``; also the densities per step."""
    model = _EmbedNet()
    cfg = {"method": method, "density": 0.05, "min_numel": 1000, "allocation": "nonzero", "stats_sync_interval": 2}
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), cfg)
    params = list(model.parameters())
    res = opt._buffers["residual"]
    out = []
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 400, (6, 2), generator=g)  # at most 12 of 400 rows
        torch.nn.functional.cross_entropy(model(tokens), torch.randint(0, 40, (6,), generator=g)).backward()
        grads = [p.grad.float().clone() for p in params]
        e_old = res.clone()
        opt.reduce_gradients()
        out.append({"g": grads, "red": [p.grad.float().clone() for p in params], "e_old": e_old,
                    "e_new": res.clone(), "density": [opt.state[p].get("density") for p in params]})
        opt.inner.step()
    lay = opt.layout
    return {"steps": out, "params": [p.detach().clone() for p in params], "stats": opt.stats(),
            "sparse": lay.sparse, "starts": lay.starts, "region": lay.region, "padded": lay.padded}


@pytest.mark.parametrize("method", ["topk", "randomk", "bayes_prior"])
def test_allocation_nonzero_shares_the_budget_by_nonzeros(pools, method):
    """After the measuring steps (compressed steps 0 and 1 with interval 2) every rank holds the same
    densities, equal to the water-filled shares of the nonzeros summed over the ranks; the
    embedding (a few rows of 400 nonzero) gets far less than the dense layer; the exchange
    stays the mean of what each rank sent, and the replicas stay identical."""
    from ds_xc.compression.compressors import allocate_densities
    results = pools(2).run(_alloc_reductions, method)
    sparse = results[0]["sparse"]
    numel = [results[0]["params"][i].numel() for i in sparse]
    for step in (0, 1):  # measured on these steps' fresh gradients, used from the next step on
        nnz = [sum(int(torch.count_nonzero(r["steps"][step]["g"][i])) for r in results) for i in sparse]
        want = allocate_densities(numel, [max(c, 0.05 * 2 * n) for c, n in zip(nnz, numel)], 0.05)  # floor
        for r in results:
            got = [r["steps"][step]["density"][i] for i in sparse]
            assert got == pytest.approx(want, rel=1e-12)
    embed, fc = results[0]["steps"][-1]["density"][sparse[0]], results[0]["steps"][-1]["density"][sparse[1]]
    assert embed < 0.05 < fc and embed * numel[0] + fc * numel[1] == pytest.approx(0.05 * sum(numel))
    if method == "topk":  # exact counts per tensor at the allocated densities
        last, dens = results[0]["steps"][-1], results[0]["steps"][-2]["density"]
        for j, i in enumerate(sparse):
            start = results[0]["starts"][j]
            sent = (last["e_new"][start: start + numel[j]] != last["e_old"][start: start + numel[j]]
                    + last["g"][i].reshape(-1)).sum()
            assert int(sent) == max(1, round(dens[i] * numel[j]))
    _check_sparse_exchange(results, _own_gradient)
    _assert_replicas_identical(results)
