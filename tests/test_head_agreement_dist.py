"""The head's ranks agree before every collective, and nothing is lost or reinterpreted silently (issue 59).

On 2 and 3 gloo ranks:

* embeddings of different dtypes on different ranks (float16 / float32; float16 / bfloat16, one byte size) raise
  on every rank, naming ``embeddings.dtype`` and each rank's dtype, before any gather; so do different widths
  (heads of different embedding_dim);
  the weights, the optimizer state and the sampler are unchanged, and a good step afterwards works;
* in an unchecked step (``check_interval``, batch_sizes given) a rank whose rows come in another dtype than
  the one agreed at the last check has them cast to it (== passing the cast rows, float64 values);
* the overlap schedule's backbone mode (rows made after the check) agrees on their dtype before its gathers;
* heads built with different options (here chunk_size, which sets the number of the loss's collectives)
  raise on every rank at the first call, naming the option and each rank's value;
* ``batch_sizes`` of the wrong length, or with wrong values, on one rank only raise on every rank;
* ``topk``: dtype and k agreed (raised on every rank), every rank empty gives (0, k), a NaN row gets ids -1
  and the other rows the dense float64 reference's ids;
* a global step where every rank has 0 rows is a no-op: weights, AdamW state (no weight decay, no step
  counted) and the sampler are as if it had not been called, and so is the next step.
"""
import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import build_head_optimizer, init_shard
from tests.reference import LOSSES

C, D, SEED = 29, 8, 11
UNIFORM = {"type": "uniform", "sample_rate": 0.5}


def _batch(rank, rows, case, dtype=torch.float64):
    g = torch.Generator().manual_seed(SEED * 1000 + case * 10 + rank)
    return torch.randn(rows, D, generator=g, dtype=torch.float64).to(dtype), torch.randint(0, C, (rows,), generator=g)


def _head(dim=D, **kw):
    kw.setdefault("sampler", UNIFORM)
    kw.setdefault("dtype", torch.float32)
    return ClassParallelHead(dim, C, init_std=0.5, seed=SEED, **kw)


def _message(fn):
    try:
        fn()
    except ValueError as exc:  # every error of a bad input or a disagreement (the dtype's is a TypeError too)
        assert isinstance(exc, TypeError) == (type(exc).__name__ == "DtypeDisagreementError")
        return f"{type(exc).__name__}: {exc}"
    return None


def _disagree(rank, world, kind):
    """One good step, then a faulty one; returns the message, whether anything changed, the next loss."""
    dims = {"width": [D, D + 1, D][rank]}.get(kind, D)
    head = _head(dims, chunk_size=[0, 2, 0][rank] if kind == "chunk" else 0)
    opt = build_head_optimizer(head, {"type": "adamw", "lr": 0.1, "weight_decay": 0.1})
    x, y = _batch(rank, 3, 1)
    x = x[:, :dims] if dims <= D else torch.cat([x, x[:, :1]], 1)
    if kind not in ("width", "chunk"):  # a good step first: the optimizer has state
        head(x.float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    weight, sampler = head.weight.detach().clone(), str(head.sampler.state_dict())
    state = {k: v.clone() for k, v in opt.state[head.weight].items() if torch.is_tensor(v)}
    dtype = {"f16_f32": [torch.float16, torch.float32, torch.float32],
             "f16_bf16": [torch.float16, torch.bfloat16, torch.float16]}.get(kind, [torch.float32] * 3)[rank]
    sizes = None
    if kind == "sizes_length" and rank == 1:
        sizes = [3] * (world + 1)
    elif kind == "sizes_values" and rank == world - 1:
        sizes = [3] * (world - 1) + [4]
    msg = _message(lambda: head(x.to(dtype), y, sizes))
    unchanged = (torch.equal(head.weight.detach(), weight) and head.weight.grad is None
                 and str(head.sampler.state_dict()) == sampler
                 and all(torch.equal(opt.state[head.weight][k], v) for k, v in state.items()))
    after = None if kind in ("width", "chunk") else float(head(x.float(), y))  # the ranks are still in step
    return {"msg": msg, "unchanged": unchanged, "after": after}


@pytest.mark.parametrize("world", [2, 3])
def test_disagreements_raise_on_every_rank(pools, world):
    expect = {
        "f16_f32": ("DtypeDisagreementError: embeddings.dtype differs across the ranks of the head's group: rank 0: torch.float16, "
                    "rank 1: torch.float32"),
        "f16_bf16": ("DtypeDisagreementError: embeddings.dtype differs across the ranks of the head's group: rank 0: "
                     "torch.float16, rank 1: torch.bfloat16"),
        "width": f"ranks disagree on the head's options (ClassParallelHead arguments / the extreme_classification "
                 f"section; allowed: the same on every rank of the head's group): embedding_dim (rank 0: {D}, "
                 f"rank 1: {D + 1}",
        "sizes_values": f"do not match the rows the ranks passed, {[3] * world}",
        "chunk": "ranks disagree on the head's options (ClassParallelHead arguments / the extreme_classification "
                 "section; allowed: the same on every rank of the head's group): chunk_size (rank 0: 0, rank 1: 2",
    }
    for kind, text in expect.items():
        res = pools(world).run(_disagree, kind)
        for rank, r in enumerate(res):
            assert r["msg"] is not None and text in r["msg"], (kind, rank, r["msg"])
            assert "allowed" in r["msg"] or kind == "sizes_values", r["msg"]
            assert r["msg"].startswith("DtypeDisagreementError") == kind.startswith("f16"), r["msg"]
            assert r["unchanged"], (kind, rank)
            assert r["after"] is None or r["after"] == res[0]["after"]
    res = pools(world).run(_disagree, "sizes_length")
    assert f"batch_sizes has {world + 1} entries" in res[1]["msg"] and "allowed: one entry per rank" in res[1]["msg"]
    for rank, r in enumerate(res):
        assert r["msg"] is not None and r["unchanged"] and r["after"] == res[0]["after"], (rank, r)
        if rank != 1:
            assert "another rank reported" in r["msg"] and "rank(s) [1]" in r["msg"], r["msg"]


def _unchecked_cast(rank, world, cast):
    """check_interval 2, batch_sizes given: call 1 is unchecked; rank 1 passes float32 rows in it."""
    head = _head(dtype=torch.float64, check_interval=2)
    sizes = [3, 2, 4][:world]
    x, y = _batch(rank, sizes[rank], 2)
    head(x, y, sizes)
    x1, y1 = _batch(rank, sizes[rank], 3)
    if rank == 1:
        x1 = x1.float() if cast == "head" else x1.float().double()
    x1.requires_grad_()
    loss = head(x1, y1, sizes)
    loss.backward()
    return float(loss), x1.grad.double(), head.weight.grad.to_dense() if head.weight.grad.is_sparse \
        else head.weight.grad


def test_unchecked_step_casts_to_the_agreed_dtype(pools):
    by_head = pools(2).run(_unchecked_cast, "head")
    by_hand = pools(2).run(_unchecked_cast, "hand")
    for a, b in zip(by_head, by_hand):
        assert a[0] == b[0]
        torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-9)  # rank 1's gradient: float32, as its rows
        torch.testing.assert_close(a[2], b[2], rtol=1e-12, atol=1e-15)


def _backbone_mode(rank, world):
    """The overlap schedule's backbone mode: the check runs before the rows exist; rank 1's backbone gives
    float32 rows, the others float64."""
    from ds_xc.overlap import ChunkedHeadSchedule
    from tests.test_uneven_dist import _comm_group
    head = _head(dtype=torch.float64)
    x, y = _batch(rank, 4, 6)
    sched = ChunkedHeadSchedule(head, 2, comm_group=_comm_group(world))
    dtype = torch.float32 if rank == 1 else torch.float64
    msg = _message(lambda: sched.run_backbone(lambda part: part.to(dtype), x, y))
    after = float(sched.run_backbone(lambda part: part * 1.0, x.requires_grad_(), y))  # still in step
    return msg, after


def test_backbone_mode_agrees_on_the_dtype(pools):
    res = pools(2).run(_backbone_mode)
    for msg, after in res:
        assert msg is not None and "embeddings.dtype" in msg and "rank 0: 'torch.float64', rank 1: 'torch.float32'" \
            in msg, msg
        assert after == res[0][1]


# ---------------------------------------------------------------------------- topk
def _topk(rank, world, kind):
    head = _head(dtype=torch.float64, loss=LOSSES["cosface"], sampler="full")
    x, _ = _batch(rank, [3, 2, 4][rank], 4)
    if kind == "empty":
        return tuple(head.topk(x[:0], k=4).shape)
    if kind == "dtype":
        return _message(lambda: head.topk(x.to([torch.float16, torch.bfloat16, torch.float16][rank]), k=3))
    if kind == "k":
        return _message(lambda: head.topk(x, k=3 + (rank == 1)))
    if kind == "nan" and rank == 1:
        x[1, 2] = float("nan")
    return head.topk(x, k=3), x


@pytest.mark.parametrize("world", [2, 3])
def test_topk_agrees_handles_empty_and_nan(pools, world):
    pool = pools(world)
    assert pool.run(_topk, "empty") == [(0, 4)] * world
    for msg in pool.run(_topk, "dtype"):
        assert "topk: embeddings.dtype differs" in msg and "rank 0: torch.float16, rank 1: torch.bfloat16" in msg
    for msg in pool.run(_topk, "k"):
        assert "topk: k differs across the ranks of the head's group: rank 0: 3, rank 1: 4" in msg, msg
    res = pool.run(_topk, "nan")
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64)
    for rank, (ids, x) in enumerate(res):
        scores = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(w, dim=1).t()
        ref = scores.topk(3, dim=1).indices
        if rank == 1:
            assert torch.equal(ids[1], torch.full((3,), -1))
            ids, ref = ids[[0]], ref[[0]]
        assert torch.equal(ids, ref), rank


# ---------------------------------------------------------------------------- all-empty steps
def _empty_steps(rank, world, sampler, with_empty, mode="serial"):
    head = _head(dtype=torch.float64, sampler=sampler, update="auto", loss=LOSSES["arcface"])
    opt = build_head_optimizer(head, {"type": "adamw", "lr": 0.1, "weight_decay": 0.2})
    losses = []
    for step in range(3):
        if step == 1 and with_empty:
            e = torch.zeros((0, D), dtype=torch.float64, requires_grad=True)
            if mode == "serial":
                loss = head(e, torch.zeros(0, dtype=torch.int64))
                loss.backward()
                assert e.grad.shape == (0, D)
            else:
                from ds_xc.overlap import ChunkedHeadSchedule
                from tests.test_uneven_dist import _comm_group
                sched = ChunkedHeadSchedule(head, 2, comm_group=_comm_group(world))
                loss = sched.run_backbone(lambda part: part * 1.0, e, torch.zeros(0, dtype=torch.int64))
            assert loss.item() == 0.0 and head.weight.grad is None
            opt.step()
            opt.zero_grad(set_to_none=True)
        x, y = _batch(rank, [3, 2, 4][rank], 10 + step)
        x.requires_grad_()
        loss = head(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    head.catch_up()
    state = {k: v.clone() for k, v in opt.state[head.weight].items() if torch.is_tensor(v)}
    return losses, head.weight.detach().clone(), state, str(head.sampler.state_dict())


@pytest.mark.parametrize("sampler,mode", [("full", "serial"), ("uniform", "serial"), ("uniform", "backbone")])
def test_an_all_empty_step_is_a_no_op(pools, sampler, mode):
    spec = "full" if sampler == "full" else UNIFORM
    with_empty = pools(2).run(_empty_steps, spec, True, mode)
    without = pools(2).run(_empty_steps, spec, False)
    for a, b in zip(with_empty, without):
        assert a[0] == b[0] and a[3] == b[3]
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
        assert a[2].keys() == b[2].keys()
        for k in a[2]:
            torch.testing.assert_close(a[2][k], b[2][k], rtol=0, atol=0)
