"""The head, the compressed optimizer and a checkpoint on a subgroup, next to other groups' work.

4 gloo ranks split into two groups of 2 ({0, 1}, {2, 3}); 3 ranks as a group {0, 2} and an
idle rank 1. The groups are made by every rank with ``ds_xc.parallel.groups.new_groups``.
On each group, one training step of a float64 backbone (Linear) + ClassParallelHead
(uneven shards and uneven batches) + CompressedOptimizer (top-k at density 1.0), then a
checkpoint of the head shards and the residuals (saved, checksummed by the manifest, read
back into fresh objects, agreed) runs on that group only, while the other group runs a
different head on its own group, with extra all-reduces of its own in between. Every group
checks against the single-process float64 reference of its own global batch: the loss, the
reduced backbone gradient (the gradient of the global mean loss), the head shards' gradients,
the parameters after the SGD step, and the checkpoint read back. A component that fell back
to the world would mix in the other group's rows or wait for ranks that never come.
"""
import pytest
import torch

from ds_xc import ClassParallelHead, CompressedOptimizer
from ds_xc.head import init_shard, shard_range
from tests.reference import LOSSES, per_row_loss

D_IN, D, LR = 5, 6, 0.1
# group index -> (classes, loss, local batch sizes by rank in the group, seed)
JOBS = {0: (17, "cosface", [5, 3], 3), 1: (13, "softmax", [2, 6], 8)}
COMPRESSION = {"method": "topk", "density": 1.0, "min_numel": 16}


def _backbone(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(D_IN, D).double()


def _batch(seed, rank, rows, classes):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(rows, D_IN, generator=g, dtype=torch.float64), torch.randint(0, classes, (rows,), generator=g)


def _job(group, job, tag_dir):
    """One step and a checkpoint round trip on ``group``; what the test compares."""
    import torch.distributed as dist
    from ds_xc.checkpoint import load_head_state, save_head_state
    from ds_xc.compression import load_compression_state, save_compression_state
    from ds_xc.manifest import list_files, read_manifest, verify_manifest_all_ranks, write_manifest_all_ranks
    from ds_xc.parallel.agree import agree, all_or_none
    from ds_xc.parallel.groups import group_rank
    classes, loss, sizes, seed = JOBS[job]
    rank = group_rank(group)
    model = _backbone(seed)
    head = ClassParallelHead(D, classes, loss=LOSSES[loss], group=group, dtype=torch.float64, init_std=0.5,
                             seed=seed, chunk_size=3)
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), COMPRESSION, group=group)
    head_opt = torch.optim.SGD(head.parameters(), lr=LR)
    x, y = _batch(seed, rank, sizes[rank], classes)
    out = head(model(x), y)
    out.backward()
    noise = torch.full((3,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(noise, group=group)  # other traffic of this group between the steps of the job
    grad_w = head.weight.grad.clone()
    opt.step()
    head_opt.step()
    reduced = [p.grad.clone() for p in model.parameters()]
    with all_or_none("saving", group):
        save_head_state(tag_dir, head, head_opt)
        save_compression_state(tag_dir, opt)
    write_manifest_all_ranks(tag_dir, group)
    agree(tag_dir, "the checkpoint folder", group)  # rank 0 of the group has written the manifest
    verify_manifest_all_ranks(tag_dir, group)
    listed = sorted(read_manifest(tag_dir))
    fresh = ClassParallelHead(D, classes, loss=LOSSES[loss], group=group, dtype=torch.float64, seed=seed + 1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=LR)
    comp = CompressedOptimizer(torch.optim.SGD(_backbone(seed).parameters(), lr=LR), COMPRESSION, group=group)
    with all_or_none("loading", group):
        load_head_state(tag_dir, fresh, fresh_opt)
    restored = load_compression_state(tag_dir, comp)
    return {"job": job, "rank": rank, "loss": out.item(), "gw": grad_w, "start": head.class_start,
            "reduced": reduced, "params": [p.detach().clone() for p in model.parameters()],
            "weight": head.weight.detach().clone(), "loaded": fresh.weight.detach().clone(),
            "restored": restored, "noise": noise, "listed": listed, "files": sorted(list_files(tag_dir)),
            "seed_rank": opt._seed_rank}


def _run(rank, world, layout, base):
    from ds_xc.parallel.groups import new_groups
    group = new_groups(layout)  # every rank, the full set
    for job, ranks in enumerate(layout):
        if rank in ranks and job in JOBS:
            return _job(group, job, f"{base}/job{job}")
    return None  # an idle rank: no collective at all


def _reference(job):
    """Single process, float64: the whole global batch of the job through backbone and head."""
    classes, loss, sizes, seed = JOBS[job]
    model = _backbone(seed)
    batches = [_batch(seed, r, b, classes) for r, b in enumerate(sizes)]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    w = init_shard(classes, D, 0, classes, 0.5, seed, torch.float64).requires_grad_()
    mean = per_row_loss(model(x), w, y, LOSSES[loss]).mean()
    mean.backward()
    grads = [p.grad for p in model.parameters()]
    return {"loss": mean.item(), "grads": grads, "gw": w.grad, "w": w.detach(),
            "params": [(p - LR * g).detach() for p, g in zip(model.parameters(), grads)]}


def _check(results, layout):
    seen = set()
    for res in results:
        if res is None:
            continue
        job, rank = res["job"], res["rank"]
        seen.add(job)
        ref = _reference(job)
        classes, _, sizes, _ = JOBS[job]
        start, count = shard_range(classes, len(sizes), rank)
        assert res["start"] == start and res["seed_rank"] == rank
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-10)
        torch.testing.assert_close(res["gw"], ref["gw"][start: start + count], rtol=1e-8, atol=1e-10)
        for got, want in zip(res["reduced"], ref["grads"]):  # the compressed values travel as float32
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        for got, want in zip(res["params"], ref["params"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(res["weight"], ref["w"][start: start + count] - LR * ref["gw"][start: start + count],
                                   rtol=1e-8, atol=1e-10)
        assert torch.equal(res["loaded"], res["weight"]) and res["restored"] is True
        assert torch.equal(res["noise"], torch.full((3,), 3.0, dtype=torch.float64))  # 1 + 2: its own group only
        assert res["listed"] == res["files"] and len(res["files"]) == 2 * len(sizes) + 1  # every file hashed
    assert seen == {job for job in JOBS if job < len(layout)}


def test_two_groups_of_two_on_four_ranks(pools, tmp_path):
    layout = [[0, 1], [2, 3]]
    results = pools(4).run(_run, layout, str(tmp_path), timeout=120)
    _check(results, layout)


def test_group_of_two_beside_an_idle_rank_on_three_ranks(pools, tmp_path):
    layout = [[0, 2]]  # rank 1 is in no group and stays idle
    results = pools(3).run(_run, layout, str(tmp_path), timeout=120)
    assert results[1] is None
    _check(results, layout)


def _copies(rank, world):
    """copy_subgroups on every rank: a copy of each rank's own subgroup; copy_group refuses a subgroup."""
    import torch.distributed as dist
    from ds_xc.parallel.groups import copy_group, copy_subgroups, group_ranks, new_groups
    from tests.dist_pool import catch
    group = new_groups([[0, 1], [2, 3]])
    copy = copy_subgroups(group)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=copy)
    return group_ranks(copy), t.item(), catch(lambda: copy_group(group))


def test_copies_of_subgroups_are_made_by_every_rank(pools):
    results = pools(4).run(_copies, timeout=120)
    for rank, (ranks, total, refused) in enumerate(results):
        assert ranks == ([0, 1] if rank < 2 else [2, 3])
        assert total == (1.0 if rank < 2 else 5.0)  # 0 + 1, 2 + 3: each copy holds its group only
        assert refused[0] == "ValueError" and "proper subgroup" in refused[1] and "copy_subgroups" in refused[1]


def _mesh_head(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from tests.dist_pool import catch
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(40 + rank)
    x, y = torch.randn(3, D, generator=g, dtype=torch.float64), torch.randint(0, 11, (3,), generator=g)
    losses = []
    for group in (mesh, mesh["tp"], None):  # the mesh, its named dimension, the world: the same group
        head = ClassParallelHead(D, 11, group=group, dtype=torch.float64, init_std=0.5, seed=4)
        losses.append(head(x, y).item())
    square = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    return losses, catch(lambda: ClassParallelHead(D, 11, group=square))


def test_a_one_dimensional_device_mesh_names_the_group(pools):
    for losses, refused in pools(4).run(_mesh_head, timeout=120):
        assert losses[0] == losses[1] == losses[2]
        assert refused[0] == "ValueError" and "DeviceMesh of 2 dimensions" in refused[1]
