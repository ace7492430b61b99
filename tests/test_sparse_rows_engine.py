"""XCEngine with ``extreme_classification.topology.sparse_rows``: an embedding backbone's table reduced as its
nonzero rows moves the backbone and the head as DeepSpeed's own dense all-reduce does (bit for bit on 2
ranks, within float rounding on 3), with uneven local batches, serial and overlapped; refusals name the key."""
import pytest
import torch

import ds_xc
from ds_xc.models import TokenBackbone
from tests.test_engine import _config

VOCAB, CONTEXT, D, C = 97, 2, 8, 13
BATCHES = (6, 3, 5)  # local batch per rank: uneven


def _tokens(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = BATCHES[rank % len(BATCHES)]
    return torch.randint(0, VOCAB, (n, CONTEXT), generator=g), torch.randint(0, C, (n,), generator=g)


def _run(rank, world, sparse_rows, overlap, steps=3, stage=0, compression=False):
    torch.manual_seed(0)
    body = TokenBackbone(VOCAB, CONTEXT, D, hidden_dim=4)
    cfg = _config(stage, 1)
    cfg["train_micro_batch_size_per_gpu"] = max(BATCHES)
    cfg["extreme_classification"].update(num_classes=C, embedding_dim=D)
    cfg["extreme_classification"]["topology"] = {"sparse_rows": sparse_rows, "bucket_size_mb": 1e-4}
    if overlap:
        cfg["extreme_classification"]["overlap"] = {"enabled": True, "num_chunks": 2, "bucket_size_mb": 1e-4}
    if compression:
        cfg["gradient_compression"] = {"method": "topk", "density": 0.3}
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.3, momentum=0.5),
                          config=cfg)
    losses, modes, sent = [], [], []
    for step in range(steps):
        x, y = _tokens(step, rank)
        losses.append(xc.forward_backward(x, y).item())
        xc.step()
        if xc.grad_reducer is not None:
            modes.append(list(xc.grad_reducer.row_modes))
            sent.append(xc.grad_reducer.bytes_sent)
    return {"losses": losses, "body": [p.detach().clone() for p in xc.engine.module.parameters()],
            "head": xc.head.weight.detach().clone(), "modes": modes, "sent": sent,
            "allreduce_on": xc.engine.enable_backward_allreduce}


@pytest.mark.parametrize("world,overlap", [(2, False), (3, False), (2, True)])
def test_rows_engine_equals_deepspeed_dense(pools, world, overlap):
    """3 ranks: one step (the ring's summation order and DeepSpeed's * 1/P differ from rows' / P in the last
    bit, and the tiny MLP with its normalisation amplifies that step after step)."""
    steps = 3 if world == 2 else 1
    dense = pools(world).run(_run, False, overlap, steps)
    rows = pools(world).run(_run, True, overlap, steps)
    numel = sum(p.numel() for p in rows[0]["body"])
    for d, r in zip(dense, rows):
        assert r["modes"] == [["rows"]] * steps and not r["allreduce_on"]  # ds_xc owns the reduction
        ring = 2 * (world - 1) / world * 4 * numel
        assert all(0 < s < 0.6 * ring for s in r["sent"])  # the table's rows cost a fraction of the ring
        for a, b in zip(r["body"] + [r["head"]], d["body"] + [d["head"]]):
            if world == 2:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert r["losses"] == pytest.approx(d["losses"], rel=1e-6)
        assert torch.equal(r["body"][0], rows[0]["body"][0])  # the same table on every rank


@pytest.mark.parametrize("stage,compression,match", [
    (1, False, "topology.sparse_rows=true with zero_optimization.stage=1"),
    (0, True, "topology.sparse_rows=true with gradient_compression enabled")])
def test_refusals(pools, stage, compression, match):
    with pytest.raises(RuntimeError, match=match):
        pools(2).run(_run, True, False, 1, stage, compression)
