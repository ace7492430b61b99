"""ANN index and samplers (single process): codes, lists, search vs brute force, upkeep,
state, kNN graph, quality metrics against brute-force references."""
import math

import pytest
import torch
import torch.nn.functional as F

from ds_xc import ClassParallelHead
from ds_xc.sampling import build_sampler
from ds_xc.sampling.active import assemble
from ds_xc.sampling.fill import FillStream
from ds_xc.sampling.ann import AnnIndex, exact_cosine_rerank, group_bounds
from ds_xc.sampling.ann.codes import encode, itq_projection, random_projection
from ds_xc.sampling.ann.ivf import build_lists, spherical_kmeans
from ds_xc.sampling.knn import knn_graph_ann, knn_graph_exact
from ds_xc.sampling.metrics import active_set_quality
from ds_xc_ops.hamming import hamming_topk_flat, unpack_bits


def clustered(n=3000, d=32, clusters=30, spread=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = F.normalize(torch.randn(clusters, d, generator=g), dim=1)
    return F.normalize(centers[torch.randint(0, clusters, (n,), generator=g)]
                       + spread * torch.randn(n, d, generator=g) / math.sqrt(d), dim=1)


def test_random_projection_is_orthogonal_and_deterministic():
    p = random_projection(16, 48, seed=3)
    assert p.shape == (16, 48) and torch.equal(p, random_projection(16, 48, seed=3))
    for b in range(3):
        block = p[:, 16 * b: 16 * (b + 1)]
        torch.testing.assert_close(block.t() @ block, torch.eye(16), atol=1e-5, rtol=0)


def test_fast_packing_matches_the_ops_layout():
    from ds_xc.sampling.ann.codes import pack
    from ds_xc_ops.hamming import pack_signs
    v = torch.randn(37, 96)
    assert torch.equal(pack(v), pack_signs(v))


def test_hamming_distance_estimates_the_angle():
    x = clustered(2000, 32, clusters=1, spread=3.0)
    p = random_projection(32, 1024, seed=1)
    bits = unpack_bits(encode(x, p)).float()  # (n, 1024)
    ham = (bits[:200, None, :] != bits[None, :200, :]).float().mean(2)
    angle = torch.acos((x[:200] @ x[:200].t()).clamp(-1, 1)) / math.pi
    assert (ham - angle).abs().mean() < 0.02


def test_itq_needs_fewer_bits_than_dim_and_reduces_quantisation_error():
    x = clustered(4000, 32)
    with pytest.raises(ValueError, match="code_bits <= embedding_dim"):
        itq_projection(x, 64, 5, 0)
    def err(p):
        v = x @ p
        return (torch.sign(v) - v / v.abs().mean()).pow(2).mean()
    assert err(itq_projection(x, 32, 30, 0)) < err(random_projection(32, 32, 0))


def test_kmeans_and_lists():
    x = clustered(3000, 16, clusters=10, spread=0.1)
    c = spherical_kmeans(x, 10, 10, seed=0)
    torch.testing.assert_close(c.norm(dim=1), torch.ones(10))
    a = (x @ c.t()).argmax(1)
    offsets, ids = build_lists(a, 10)
    assert offsets[-1] == 3000 and torch.equal(ids.sort().values, torch.arange(3000))
    for j in range(10):
        members = ids[offsets[j]: offsets[j + 1]]
        assert (a[members] == j).all() and torch.equal(members, members.sort().values)


def test_search_with_every_list_probed_equals_brute_force():
    w = clustered(2000, 32)
    index = AnnIndex(32, 128, nlist=20, seed=1, backend="torch")
    index.build(w)
    q = clustered(50, 32, seed=9)
    ids = index.search(q, nprobe=20, k=15)
    codes = encode(w, index.projection)
    ref_d, ref_ids = hamming_topk_flat(encode(q, index.projection), codes, 15, backend="torch")
    assert torch.equal(ids, ref_ids)


@pytest.mark.parametrize("nprobe,scan_rows", [(2, 500), (1, 1), (1, 90), (7, 300), (3, 1900), (2, 1999)])
def test_probe_adds_lists_in_score_order_until_scan_rows(nprobe, scan_rows):
    """Every query's lists: at least nprobe, then in score order until scan_rows rows (a partial sort of the
    scores where the budget cannot reach every list, a full one where it can)."""
    w = clustered(2000, 32)
    index = AnnIndex(32, 64, nlist=20, seed=1, backend="torch")
    index.build(w)
    q = F.normalize(clustered(30, 32, seed=5), dim=1)
    sizes = (index.list_offsets[1:] - index.list_offsets[:-1]).tolist()
    got = index.probe(q, nprobe=nprobe, scan_rows=scan_rows)
    scores = q @ index.centroids.t()
    for i in range(30):
        order = torch.argsort(scores[i], descending=True).tolist()
        want, rows = [], 0
        for j, lst in enumerate(order):  # reference: at least nprobe lists, then until scan_rows rows
            if j >= nprobe and rows >= scan_rows:
                break
            want.append(lst)
            rows += sizes[lst]
        row = got[i].tolist()
        assert row[: len(want)] == want and all(v == -1 for v in row[len(want):])
    assert torch.equal(index.probe(q, nprobe=3, scan_rows=0), torch.topk(scores, 3, dim=1).indices)


def test_scan_rows_covering_the_shard_scans_flat():
    w = clustered(2000, 32)
    index = AnnIndex(32, 128, nlist=20, seed=1, backend="torch")
    index.build(w)
    q = clustered(50, 32, seed=9)
    ids = index.search(q, nprobe=1, k=15, scan_rows=2000)  # the whole shard is within budget
    _, ref_ids = hamming_topk_flat(encode(q, index.projection), encode(w, index.projection), 15, backend="torch")
    assert torch.equal(ids, ref_ids)


def test_refresh_re_encodes_changed_rows_in_place():
    w = clustered(1000, 32)
    index = AnnIndex(32, 64, nlist=10, seed=0, backend="torch")
    index.build(w)
    w2 = w.clone()
    rows = torch.tensor([3, 500, 999])
    w2[rows] = -w2[rows]
    index.refresh(w2, rows)
    fresh = encode(w2, index.projection)
    assert torch.equal(index.list_codes[index.position], fresh)


def test_exact_rerank_keeps_best_cosines():
    w = clustered(500, 16)
    q = clustered(8, 16, seed=4)
    cand = torch.stack([torch.randperm(500)[:40] for _ in range(8)])  # distinct, as search returns
    cand[:, -5:] = -1
    top = exact_cosine_rerank(q, w, cand, 10)
    for i in range(8):
        c = cand[i][cand[i] >= 0].unique()
        best = c[torch.topk(q[i] @ w[c].t(), 10).indices]
        assert set(top[i].tolist()) == set(best.tolist())


def test_assemble_takes_candidates_in_rank_order():
    cand = torch.tensor([[5, 7, -1], [7, 9, 2], [1, 5, 3]])  # per row, best first; rank-major: 5 7 1 | 7 9 5 | 2 3
    fill = FillStream(0, 0)
    local = torch.tensor([9, 30])
    out = assemble(local, torch.ones(2, dtype=torch.bool), 40, 5, fill, cand.t().reshape(-1), core=5)
    assert out.index.tolist() == sorted([9, 30, 5, 7, 1])  # the positives, then the first 3 distinct candidates
    assert out.stats.read() == {"active": 5, "positives": 2, "retrieved": 5, "kept": 3, "cut": 2, "fill": 0}
    assert out.index[out.targets].tolist() == [9, 30]
    assert set(out.core.tolist()) == {9, 30, 5, 7, 1}  # C = 5: exactly the positives and the kept
    out = assemble(torch.tensor([0]), torch.ones(1, dtype=torch.bool), 40, 20, fill, cand.t().reshape(-1))
    assert out.index.numel() == 20 and out.index.unique().numel() == 20 and out.stats.read()["fill"] == 13
    assert set([0, 5, 7, 1, 9, 2, 3]) <= set(out.index.tolist())


def _ann_head(rate=0.1, **kw):
    cfg = dict({"type": "ann", "sample_rate": rate, "code_bits": 64, "nlist": 10, "nprobe": 4, "top_k": 8,
                "rerank": 16, "backend": "torch"}, **kw)
    return ClassParallelHead(16, 300, loss={"type": "cosface", "scale": 10.0}, sampler=cfg, update="lazy",
                             init_std=1.0, dtype=torch.float64, seed=2)


def test_rate_one_equals_full_softmax():
    x = torch.randn(20, 16, dtype=torch.float64)
    y = torch.randint(0, 300, (20,))
    full = ClassParallelHead(16, 300, loss={"type": "cosface", "scale": 10.0}, init_std=1.0,
                             dtype=torch.float64, seed=2)
    assert _ann_head(rate=1.0)(x, y).item() == full(x, y).item()


def test_positives_always_active_with_groups():
    head = _ann_head(rate=0.02, groups=3)
    x = torch.randn(30, 16, dtype=torch.float64)
    y = torch.randint(0, 300, (30,))
    head(x, y)
    a = head.last_active
    assert a.bounds == group_bounds(30, 3) == [0, 10, 20, 30]
    for rows, idx in a.groups():
        assert torch.equal(idx[a.targets[rows]], y[rows])
        assert idx.numel() == max(6, rows.stop - rows.start)  # K = max(budget, min(rows, L)): static
        assert idx.unique().numel() == idx.numel()


def test_upkeep_re_encodes_active_rows_and_rebuilds_on_schedule():
    head = _ann_head(rebuild_interval=3, encode_rows="active")
    opt = torch.optim.SGD([head.weight], lr=5.0)
    x = torch.randn(12, 16, dtype=torch.float64)
    y = torch.randint(0, 300, (12,))
    for step in range(5):
        head(x, y).backward()
        opt.step()
        opt.zero_grad()
        s = head.sampler
        assert s.staleness == [1, 2, 3, 1, 2][step]
    before = s.index.list_codes[s.index.position].clone()
    codes = s.index.encode(s.index.unit_rows(head.weight.detach(), normalise=False))
    assert not torch.equal(before, codes)  # the last step changed rows: codes are stale
    head(x, y)  # re-encodes exactly the rows the last step changed (lazy updates)
    assert torch.equal(s.index.list_codes[s.index.position], codes)
    assert s.index.builds == 2


def test_state_round_trip_continues_identically_and_mismatch_invalidates():
    a, b = _ann_head(), _ann_head()
    x = torch.randn(12, 16, dtype=torch.float64)
    y = torch.randint(0, 300, (12,))
    opt = torch.optim.SGD([a.weight], lr=1.0)
    for _ in range(2):
        a(x, y).backward()
        opt.step()
        opt.zero_grad()
    b.load_state_dict(a.state_dict())
    assert b.sampler.built_at is not None
    la, lb = a(x, y), b(x, y)
    assert la.item() == lb.item()
    assert torch.equal(a.last_active.index, b.last_active.index)
    state = a.state_dict()
    state["weight"] = state["weight"] + 1.0
    b.load_state_dict(state)
    assert b.sampler.built_at is None  # rebuilt at the next forward


def test_knn_graph_exact_and_ann():
    w = clustered(800, 16, clusters=8)
    g = knn_graph_exact(w, 5, chunk=100)
    sims = w @ w.t()
    sims.fill_diagonal_(-2)
    ref = torch.topk(sims, 5, dim=1).indices
    assert (g == ref).float().mean() > 0.99  # ties aside
    approx = knn_graph_ann(w, 5, seed=0)
    recall = (approx[:, :, None] == ref[:, None, :]).any(2).float().mean()
    assert recall > 0.8


def test_exact_knn_graph_in_bounded_tiles():
    """The similarity tiles of an exact graph build stay under tile_bytes (issue 56: 4,096 x L float32 was
    16 GB at L = 10^6), with the same graph as one tile."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tiles(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ == "mm":
                Tiles.largest = max(Tiles.largest, out.numel() * out.element_size())
            return out

    w = clustered(300, 16)
    with Tiles():
        tiled = knn_graph_exact(w, 5, tile_bytes=40 * 300 * 4)  # 40 rows of 300 similarities per tile
    assert 0 < Tiles.largest <= 40 * 300 * 4
    assert torch.equal(tiled, knn_graph_exact(w, 5))


def test_knn_sampler_takes_neighbours_of_positives():
    w = clustered(200, 16)
    g = knn_graph_exact(w, 4)
    s = build_sampler({"type": "knn", "sample_rate": 0.05, "neighbors": 4, "retrieved_share": 1.0}, 200, 0,
                      seed=0, rank=0)
    a = s.sample(torch.tensor([3, 50]), None, w)
    must = {3, 50} | set(g[3, :4].tolist()) | set(g[50, :4].tolist())
    assert a.index.numel() == 10 and must <= set(a.index.tolist())
    # default share 0.5: half the room (4 of 8) goes to neighbours in rank order, the rest is fill
    s = build_sampler({"type": "knn", "sample_rate": 0.05, "neighbors": 4}, 200, 0, seed=0, rank=0)
    a = s.sample(torch.tensor([3, 50]), None, w)
    first = {3, 50} | set(g[3, :2].tolist()) | set(g[50, :2].tolist())
    assert a.index.numel() == 10 and first <= set(a.index.tolist())
    assert s.last_stats["kept"] == 4 and s.last_stats["fill"] == 4


def test_quality_metrics_match_brute_force():
    w = clustered(400, 16)
    x = clustered(30, 16, seed=5)
    gen = torch.Generator().manual_seed(0)
    index = torch.randperm(400, generator=gen)[:100].sort().values
    from ds_xc.sampling.base import ActiveSet
    active = ActiveSet(index=index, targets=torch.full((30,), -1))
    got = active_set_quality(x, w, 0, active, normalised=True, scale=5.0, k=10, chunk=7)
    z = 5.0 * F.normalize(x, dim=1) @ F.normalize(w, dim=1).t()
    top = torch.topk(z, 10, dim=1).indices
    mask = torch.zeros(400, dtype=torch.bool)
    mask[index] = True
    assert got["recall_active@10"] == pytest.approx(mask[top].float().mean().item())
    p = torch.softmax(z.double(), 1)
    assert got["softmax_mass"] == pytest.approx(p[:, mask].sum(1).mean().item(), rel=1e-6)
    full = active_set_quality(x, w, 0, ActiveSet(index=None, targets=active.targets), True, 5.0)
    assert full["recall_active@10"] == 1.0 and full["softmax_mass"] == pytest.approx(1.0)


def test_dot_metric_ranks_by_inner_product():
    g = torch.Generator().manual_seed(0)
    w = clustered(1000, 16) * torch.rand(1000, 1, generator=g).mul(3).add(0.1)  # varying norms
    q = torch.randn(20, 16, generator=g)
    index = AnnIndex(16, 256, nlist=10, seed=0, backend="torch", metric="dot")
    index.build(w)
    unit = index.unit_rows(w)
    torch.testing.assert_close(unit.norm(dim=1), torch.ones(1000))
    # cosine in the augmented space orders like the inner product, for each query
    aug = index.unit_queries(q) @ unit.t()
    assert torch.equal(aug.argsort(dim=1, descending=True)[:, :10], (q @ w.t()).argsort(dim=1, descending=True)[:, :10])
    cand = index.search(q, nprobe=10, k=1000)  # every row: re-rank is then exact
    top = exact_cosine_rerank(q, w, cand, 10, metric="dot")
    assert torch.equal(top, torch.topk(q @ w.t(), 10, dim=1).indices)
    coarse = index.search(q, nprobe=3, k=50)
    recall = (exact_cosine_rerank(q, w, coarse, 10, metric="dot")[:, :, None]
              == torch.topk(q @ w.t(), 10, dim=1).indices[:, None, :]).any(2).float().mean()
    assert recall > 0.7


def test_background_rebuild_is_adopted_and_rows_changed_meanwhile_are_re_encoded():
    head = _ann_head(rebuild_interval=2, background_rebuild=True, encode_rows="active")  # every changed row
    opt = torch.optim.SGD([head.weight], lr=5.0)
    x = torch.randn(12, 16, dtype=torch.float64)
    y = torch.randint(0, 300, (12,))
    s = head.sampler
    for _ in range(3):
        head(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert s._pending is not None  # started at the third forward
    s._pending.result()  # let the worker finish, as a slow step would
    head(x, y).backward()
    opt.step()
    opt.zero_grad()
    assert s._pending is None and s.index.builds == 2 and s.built_at == 2
    head(x, y)  # every row's code now matches the current weights
    codes = s.index.encode(s.index.unit_rows(head.weight.detach(), normalise=False))
    assert torch.equal(s.index.list_codes[s.index.position], codes)
