"""The ANN sampler's head-wide scan budget (``scan_budget: head``): each shard scans and
re-ranks its share of scan_rows and rerank, ceil(total * L_r / C), so a 1-rank and a P-rank
head scan the same total rows per query; on 2 and 3 gloo ranks with uneven shards every
rank's retrieval equals a single-process sampler given the same shard and budget."""
import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import init_shard, shard_range
from ds_xc.sampling import build_sampler
from ds_xc.sampling.ann.sampler import shard_share

C, D, B, SEED = 301, 8, 5, 4
SAMPLER = {"type": "ann", "sample_rate": 0.2, "code_bits": 32, "nlist": 6, "nprobe": 1, "scan_rows": 120,
           "rerank": 12, "top_k": 3, "backend": "torch"}


@pytest.mark.parametrize("total,classes,world", [(65536, 1_000_000, 2), (120, 301, 3), (7, 10, 4), (5, 3, 2)])
def test_shard_shares_cover_the_total_once(total, classes, world):
    shares = [shard_share(total, shard_range(classes, world, r)[1], classes) for r in range(world)]
    assert shares == [-(-total * shard_range(classes, world, r)[1] // classes) for r in range(world)]
    assert total <= sum(shares) < total + world  # the union covers the head's budget, at most P-1 more
    assert shard_share(total, classes, classes) == total and shard_share(0, 5, classes) == 0


def _sampler(num_local, start, rank, **over):
    s = build_sampler(dict(SAMPLER, **over), num_local, start, SEED, rank)
    s.num_classes = C
    return s


def test_budgets_per_shard_and_the_old_rule():
    s = _sampler(100, 0, 0)
    assert s.budgets() == (shard_share(120, 100, C), max(3, shard_share(12, 100, C)), 3) == (40, 4, 3)
    assert _sampler(100, 0, 0, rerank=300).budgets()[1] == 100  # capped at the shard
    assert _sampler(10, 0, 0).budgets()[1] == 3  # at least top_k candidates per shard
    assert _sampler(100, 0, 0, scan_budget="shard").budgets() == (120, 12, 3)  # every shard the full counts
    assert _sampler(100, 0, 0, rerank=0).budgets() == (40, 0, 3)


def _rows_scanned(index, queries, share, nprobe):
    """(rows scanned per query (N,), rows before its last list (N,), lists (N,)) of probe()."""
    probes = index.probe(index.unit_queries(queries), nprobe, share)  # (N, P)
    sizes = index.list_offsets[1:] - index.list_offsets[:-1]
    per = torch.where(probes >= 0, sizes[probes.clamp_min(0)], 0)  # (N, P)
    lists = (probes >= 0).sum(dim=1)
    last = per.gather(1, (lists - 1).unsqueeze(1)).squeeze(1)
    return per.sum(dim=1), per.sum(dim=1) - last, lists


def _run(rank, world):
    head = ClassParallelHead(D, C, loss="arcface", sampler=SAMPLER, dtype=torch.float64, init_std=0.5, seed=SEED,
                             update="lazy", chunk_size=7)
    g = torch.Generator().manual_seed(SEED * 10 + rank)
    x = torch.randn(B + rank, D, generator=g, dtype=torch.float64)  # uneven batches too
    y = torch.randint(0, C, (B + rank,), generator=g)
    head(x, y)
    s = head.sampler
    xs = [torch.empty(0)] * world
    torch.distributed.all_gather_object(xs, x)
    queries = torch.nn.functional.normalize(torch.cat(xs).float(), dim=1)
    scanned, before, lists = _rows_scanned(s.index, queries, s.budgets()[0], s.config.nprobe)
    return {"budgets": s.budgets(), "retrieved": s.last_retrieved, "queries": queries, "scanned": scanned,
            "before": before, "lists": lists, "num_local": head.num_local, "start": head.class_start}


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_scans_its_share_and_retrieves_as_a_single_process(pools, world):
    res = pools(world).run(_run)
    assert sum(r["num_local"] for r in res) == C and len({r["num_local"] for r in res}) > 1  # uneven
    shares = [r["budgets"][0] for r in res]
    assert 120 <= sum(shares) < 120 + world
    for rank, r in enumerate(res):
        start, num = shard_range(C, world, rank)
        assert r["budgets"] == (shard_share(120, num, C), max(3, shard_share(12, num, C)), 3)
        # every query scans at least its share, and the list that crossed it was needed
        assert bool((r["scanned"] >= r["budgets"][0]).all()) and bool((r["before"] < r["budgets"][0]).all())
        assert bool((r["lists"] > 1).any()), "the share should need more than nprobe lists here"
        ref = _sampler(num, start, rank)  # the same shard in this process: same seed, same index
        w = init_shard(C, D, start, num, 0.5, SEED, torch.float64)
        ref.rebuild(w)
        torch.testing.assert_close(r["retrieved"], ref.retrieve(r["queries"], w), rtol=0, atol=0)


def test_top_k_is_a_head_budget_with_a_floor():
    s = _sampler(100, 0, 0, top_k=12, rerank=24, top_k_min=2)
    assert s.budgets()[2] == max(2, shard_share(12, 100, C)) == 4
    assert _sampler(100, 0, 0, top_k=12, rerank=24).budgets()[2] == 12  # the floor min(top_k, top_k_min)
    assert _sampler(100, 0, 0, top_k=12, rerank=24, top_k_min=5).budgets()[2] == 5
    assert _sampler(100, 0, 0, top_k=12, rerank=24, top_k_min=2, scan_budget="shard").budgets()[2] == 12
    assert _sampler(3, 0, 0, top_k=12, rerank=24, top_k_min=5).budgets() == (2, 3, 3)  # capped at the shard


@pytest.mark.parametrize("world", [2, 3])
def test_top_k_shares_keep_the_best_candidates_and_recall_at_10(world):
    """Each shard's top_k share is the prefix of what keeping top_k on every shard retrieves (both
    keep the best re-ranked candidates by exact score), so with shares >= 10 the union over the
    shards holds exactly the same classes of every query's exact top-10 (where the re-rank share is at
    least top_k, so both rules re-rank the same candidates)."""
    over = {"top_k": 40, "rerank": 150, "nprobe": 2}
    g = torch.Generator().manual_seed(11)
    w_all = torch.randn(C, D, generator=g, dtype=torch.float64)
    queries = torch.nn.functional.normalize(torch.randn(23, D, generator=g), dim=1)
    exact = (queries.double() @ torch.nn.functional.normalize(w_all, dim=1).t()).topk(10, dim=1).indices  # (Q, 10)
    unions = {}
    for floor in (10, 40):  # 40: every shard keeps top_k (the per-shard rule)
        got = []
        for rank in range(world):
            start, num = shard_range(C, world, rank)
            s = _sampler(num, start, rank, top_k_min=floor, **over)
            w = w_all[start: start + num]
            s.rebuild(w)
            ids = s.retrieve(queries, w)  # (Q, k)
            assert ids.shape[1] == (max(10, shard_share(40, num, C)) if floor == 10 else 40)
            got.append(torch.where(ids >= 0, ids + start, -1))
        unions[floor] = got
    for shares, full in zip(unions[10], unions[40]):
        assert shares.shape[1] < full.shape[1] or world == 1
        torch.testing.assert_close(shares, full[:, : shares.shape[1]], rtol=0, atol=0)
    hit = {f: torch.stack([torch.isin(exact[q], torch.cat([u[q] for u in unions[f]])).sum() for q in range(23)])
           for f in unions}
    assert torch.equal(hit[10], hit[40]) and int(hit[40].sum()) > 0
