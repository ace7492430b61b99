"""A forward without grad (a validation loss under ``torch.inference_mode()`` or ``torch.no_grad()``) leaves the
head trainable and its training state as it was (issue 59, item 5).

For the exact head and each sampled head (uniform, ann, knn; update auto, so lazy_exact for the sampled ones,
under AdamW with weight decay, check_interval 2 with batch_sizes given), float64: training steps, then an
inference_mode and a no_grad forward (at an unchecked and at a checked position), then
more training steps give the same losses, weights and optimizer state as the run without the two evaluation
forwards; the evaluation loss is the exact loss over every class (the float64 dense reference). Also ``topk``
under inference_mode, and the workspace never keeps a tensor made in inference mode.
"""
import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import build_head_optimizer
from ds_xc.head.workspace import Workspace
from tests.reference import LOSSES, per_row_loss

C, D, B, SEED = 60, 8, 12, 5
SAMPLERS = {
    "full": "full",
    "uniform": {"type": "uniform", "sample_rate": 0.3},
    "ann": {"type": "ann", "sample_rate": 0.3, "code_bits": 32, "nlist": 3, "nprobe": 2, "top_k": 3, "rerank": 4,
            "backend": "torch", "rebuild_interval": 2},
    "knn": {"type": "knn", "sample_rate": 0.3, "neighbors": 3, "rebuild_interval": 2},
}


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randint(0, C, (B,), generator=g)


def _run(sampler, loss, evaluate_at):
    head = ClassParallelHead(D, C, loss=LOSSES[loss], sampler=SAMPLERS[sampler], dtype=torch.float64,
                             init_std=0.5, seed=SEED, update="auto", check_interval=2)
    opt = build_head_optimizer(head, {"type": "adamw", "lr": 0.05, "weight_decay": 0.1})
    losses, evals = [], []
    for step in range(6):
        if step in evaluate_at:  # 1: where an unchecked training step would come (check_interval 2)
            x, y = _batch(99)
            with torch.inference_mode():
                evals.append((head(x, y), head.topk(x, k=3)))
            with torch.no_grad():
                evals.append((head(x, y), None))
        x, y = _batch(step)
        x.requires_grad_()
        out = head(x, y, [B])
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.detach())
    head.catch_up()
    state = {k: v.clone() for k, v in opt.state[head.weight].items() if torch.is_tensor(v)}
    return head, torch.stack(losses), head.weight.detach().clone(), state, evals


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_an_evaluation_forward_changes_nothing(sampler):
    loss = "cosface" if sampler in ("ann", "knn") else "softmax"
    _, losses, weight, state, _ = _run(sampler, loss, evaluate_at=())
    head, losses_e, weight_e, state_e, evals = _run(sampler, loss, evaluate_at=(1, 3))
    torch.testing.assert_close(losses_e, losses, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight_e, weight, rtol=1e-12, atol=1e-12)
    assert state.keys() == state_e.keys()
    for k in state:
        torch.testing.assert_close(state_e[k], state[k], rtol=1e-12, atol=1e-12)
    # the evaluation loss: exact over every class, with the weights after 3 steps (both modes alike)
    head3 = ClassParallelHead(D, C, loss=LOSSES[loss], sampler=SAMPLERS[sampler], dtype=torch.float64,
                              init_std=0.5, seed=SEED, update="auto")
    opt3 = build_head_optimizer(head3, {"type": "adamw", "lr": 0.05, "weight_decay": 0.1})
    for step in range(3):
        x, y = _batch(step)
        head3(x, y).backward()
        opt3.step()
        opt3.zero_grad(set_to_none=True)
    head3.catch_up()
    x, y = _batch(99)
    ref = per_row_loss(x, head3.weight.detach(), y, LOSSES[loss]).mean()
    assert not evals[2][0].is_inference() and not evals[2][0].requires_grad
    torch.testing.assert_close(evals[2][0], ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(evals[3][0], ref, rtol=1e-10, atol=1e-12)
    scores = (torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(head3.weight.detach(), dim=1).t()
              if loss != "softmax" else x @ head3.weight.detach().t())
    assert torch.equal(evals[2][1], scores.topk(3, dim=1).indices)


def test_workspace_keeps_no_inference_tensor():
    ws = Workspace()
    with torch.inference_mode():
        a = ws.buffer("logits", (4, 3), torch.float32, "cpu")
    assert a.is_inference() and ws.kept_bytes() == 0
    b = ws.buffer("logits", (4, 3), torch.float32, "cpu")
    b.add_(1.0)  # usable outside inference mode
    assert not b.is_inference() and ws.kept_bytes() == 48


@pytest.mark.parametrize("sampler", ["ann", "knn"])
def test_index_rebuilt_under_inference_mode_trains_on(sampler):
    """An index (or graph) rebuilt, and the shard caught up, under inference mode: later steps still train."""
    head = ClassParallelHead(D, C, loss=LOSSES["cosface"], sampler=SAMPLERS[sampler], dtype=torch.float64,
                             init_std=0.5, seed=SEED, update="auto")
    opt = build_head_optimizer(head, {"type": "adamw", "lr": 0.05, "weight_decay": 0.1})
    for step in range(4):
        if step == 2:
            with torch.inference_mode():
                head.rebuild_index()
                head.state_dict()
        x, y = _batch(step)
        head(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert torch.isfinite(head.weight).all()
