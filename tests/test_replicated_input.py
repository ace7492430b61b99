"""input_parallel="replicated" (Megatron's vocab-parallel case) on 2 and 3 gloo ranks.

Every rank passes the same rows; the head skips the gather, the loss is the mean over those
rows, and every rank gets the full gradient with respect to them (the partial gradients of
its shard all-reduced). Compared with the single-process float64 reference (tests/reference.py)
on uneven shards (C = 17), for softmax and a margin loss, the full and the uniform sampler;
with our float64 re-statement of Megatron-core's vocab_parallel_cross_entropy steps (per-shard
max, global max, masked target logit, global sum of exponentials) on uneven shards; and, when
megatron-core imports, with its ``tensor_parallel.vocab_parallel_cross_entropy`` itself on a
gloo tensor-parallel group made by its ``parallel_state`` (even shards: Megatron splits the
vocabulary in equal parts; it computes in float32).
"""
import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import init_shard, shard_range
from tests.dist_pool import catch
from tests.reference import LOSSES, reference

C, D, B, SEED = 29, 6, 7, 11  # C: a sampled shard at 3 ranks (K = max(budget, min(B, L)) < L)
SAMPLERS = {"full": "full", "uniform": {"type": "uniform", "sample_rate": 0.4}}


def shared_batch(rows=B, classes=C, seed=SEED):
    """The rows every rank passes: one generator, the same values on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, D, generator=g, dtype=torch.float64), torch.randint(0, classes, (rows,), generator=g)


def _run(rank, world, loss, sampler):
    head = ClassParallelHead(D, C, loss=loss, sampler=sampler, dtype=torch.float64, init_std=0.5, seed=SEED,
                             chunk_size=3, input_parallel="replicated")
    x, y = shared_batch()
    x.requires_grad_()
    out = head(x, y)
    out.backward()
    index = head.last_active.index
    return {"loss": out.item(), "gx": x.grad, "gw": head.weight.grad, "start": head.class_start,
            "index": None if index is None else index + head.class_start}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("name", ["softmax", "cosface"])
def test_replicated_input_matches_reference(pools, world, sampler, name):
    results = pools(world).run(_run, LOSSES[name], SAMPLERS[sampler])
    x, y = shared_batch()
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64)
    if results[0]["index"] is None:
        ref_loss, ref_gx, ref_gw = reference(x, w, y, LOSSES[name])
    else:  # sampled: the reference sees exactly the union of the shards' active sets
        active = torch.cat([r["index"] for r in results])
        assert active.numel() < C and torch.isin(y, active).all()
        remap = torch.full((C,), -1, dtype=torch.int64)
        remap[active] = torch.arange(active.numel())
        ref_loss, ref_gx, gw_active = reference(x, w[active], remap[y], LOSSES[name])
        ref_gw = torch.zeros_like(w)
        ref_gw[active] = gw_active
    for rank, res in enumerate(results):
        start, count = shard_range(C, world, rank)
        assert res["start"] == start
        assert res["loss"] == pytest.approx(ref_loss.item(), rel=1e-10)
        # the full gradient of the mean over the given rows, the same on every rank (no factor P)
        torch.testing.assert_close(res["gx"], ref_gx, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(res["gw"], ref_gw[start: start + count], rtol=1e-8, atol=1e-10)


def megatron_formula(logits: torch.Tensor, y: torch.Tensor, bounds: list) -> torch.Tensor:
    """Per-row loss by the steps of Megatron-core's vocab-parallel cross entropy, in float64 on one
    process: each shard's row max, their max, each shard's target logit (0 where the target is
    elsewhere) summed over shards, each shard's sum of exp(z - max) summed, log(sum) - target."""
    shards = [logits[:, a:b] for a, b in bounds]
    m = torch.stack([s.max(dim=1).values for s in shards]).max(dim=0).values  # (N,)
    target = torch.zeros_like(m)
    sumexp = torch.zeros_like(m)
    for (a, b), s in zip(bounds, shards):
        z = s - m[:, None]
        inside = (y >= a) & (y < b)
        local = torch.where(inside, y - a, torch.zeros_like(y))
        target = target + torch.where(inside, z.gather(1, local[:, None])[:, 0], torch.zeros_like(m))
        sumexp = sumexp + z.exp().sum(dim=1)
    return sumexp.log() - target


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_softmax_matches_megatron_formula(pools, world):
    results = pools(world).run(_run, LOSSES["softmax"], "full")
    x, y = shared_batch()
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64).requires_grad_()
    xr = x.clone().requires_grad_()
    bounds = [(s, s + n) for s, n in (shard_range(C, world, r) for r in range(world))]
    loss = megatron_formula(xr @ w.t(), y, bounds).mean()
    loss.backward()
    for rank, res in enumerate(results):
        a, b = bounds[rank]
        assert res["loss"] == pytest.approx(loss.item(), rel=1e-10)
        torch.testing.assert_close(res["gx"], xr.grad, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(res["gw"], w.grad[a:b], rtol=1e-8, atol=1e-10)


def _run_megatron(rank, world, classes):
    """Our replicated head and Megatron-core's vocab_parallel_cross_entropy on the same shard."""
    import warnings
    warnings.filterwarnings("ignore")  # megatron warns that Apex / Transformer Engine are absent
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, create_gloo_process_groups=False)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        head = ClassParallelHead(D, classes, dtype=torch.float64, init_std=0.5, seed=SEED, group=group,
                                 input_parallel="replicated")
        x, y = shared_batch(classes=classes)
        ours_x = x.clone().requires_grad_()
        ours = head(ours_x, y)
        ours.backward()
        theirs_x = x.clone().requires_grad_()
        w = head.weight.detach().clone().requires_grad_()
        theirs = vocab_parallel_cross_entropy(theirs_x @ w.t(), y).mean()  # (B,) per-row losses, float32 inside
        theirs.backward()
        gx = theirs_x.grad.clone()
        torch.distributed.all_reduce(gx, group=group)  # Megatron's column-parallel input gradient
        return {"ours": ours.item(), "theirs": theirs.item(), "gx": ours_x.grad, "theirs_gx": gx,
                "gw": head.weight.grad, "theirs_gw": w.grad}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.slow  # importing megatron-core on every rank takes 10-30 s
@pytest.mark.parametrize("world", [2, 3])
def test_replicated_softmax_matches_megatron_core(pools, world):
    pytest.importorskip("megatron.core.tensor_parallel")
    classes = 6 * world  # Megatron splits the vocabulary into equal parts
    for res in pools(world).run(_run_megatron, classes):
        assert res["ours"] == pytest.approx(res["theirs"], rel=1e-6)
        torch.testing.assert_close(res["gx"], res["theirs_gx"].double(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(res["gw"], res["theirs_gw"].double(), rtol=1e-5, atol=1e-7)


def _run_topk(rank, world):
    head = ClassParallelHead(D, C, loss="cosface", dtype=torch.float64, init_std=0.5, seed=SEED,
                             input_parallel="replicated")
    return head.topk(shared_batch()[0], k=4)


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_topk_over_all_classes(pools, world):
    x, _ = shared_batch()
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64)
    ref = (torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(w, dim=1).t()).topk(4, dim=1)
    for ids in pools(world).run(_run_topk):
        assert torch.equal(ids, ref.indices)


def _run_unequal_rows(rank, world):
    head = ClassParallelHead(D, C, dtype=torch.float64, seed=SEED, input_parallel="replicated")
    x, y = shared_batch(rows=B - (rank == 1))
    return catch(lambda: head(x, y))


def test_replicated_input_refuses_unequal_rows_on_every_rank(pools):
    results = pools(2).run(_run_unequal_rows)
    for kind, text in results:
        assert kind == "ValueError"
        assert "input_parallel='replicated'" in text and f"[{B}, {B - 1}]" in text


def test_replicated_input_refuses_the_overlap_schedule_and_a_bad_name():
    from ds_xc.config import ConfigError
    from ds_xc.overlap import ChunkedHeadSchedule
    head = ClassParallelHead(D, C, input_parallel="replicated")
    with pytest.raises(ValueError, match="input_parallel='replicated'"):
        ChunkedHeadSchedule(head, 2)
    with pytest.raises(ConfigError, match="input_parallel: got 'tensor'"):
        ClassParallelHead(D, C, input_parallel="tensor")


def test_replicated_input_single_process_equals_data():
    x, y = shared_batch()
    losses, grads = [], []
    for mode in ("data", "replicated"):
        head = ClassParallelHead(D, C, loss=LOSSES["arcface"], dtype=torch.float64, init_std=0.5, seed=SEED,
                                 input_parallel=mode)
        xr = x.clone().requires_grad_()
        loss = head(xr, y)
        loss.backward()
        losses.append(loss.item())
        grads.append(xr.grad)
    ref_loss, ref_gx, _ = reference(x, init_shard(C, D, 0, C, 0.5, SEED, torch.float64), y, LOSSES["arcface"])
    assert losses[0] == losses[1] == pytest.approx(ref_loss.item(), rel=1e-10)
    torch.testing.assert_close(grads[1], ref_gx, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
