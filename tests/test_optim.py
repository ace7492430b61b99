"""Head optimizers: lazy == dense when every row is active; lazy touches active rows only."""
import copy

import pytest
import torch

from ds_xc.head.optim import HeadAdamW, HeadSGD


def _param(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(12, 4, generator=g, dtype=torch.float64))


def _grads(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(12, 4, generator=g, dtype=torch.float64) for _ in range(steps)]


@pytest.mark.parametrize("make", [
    (lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01),
     lambda p, lazy: HeadSGD([p], lr=0.1, momentum=0.9, weight_decay=0.01, lazy=lazy)),
    (lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True),
     lambda p, lazy: HeadSGD([p], lr=0.1, momentum=0.9, nesterov=True, lazy=lazy)),
    (lambda p: torch.optim.AdamW([p], lr=0.01, weight_decay=0.1),
     lambda p, lazy: HeadAdamW([p], lr=0.01, weight_decay=0.1, lazy=lazy)),
])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("lazy", [False, True])
def test_equals_torch_when_all_rows_active(make, sparse, lazy, monkeypatch):
    monkeypatch.setattr("ds_xc.head.optim._BLOCK", 5)  # several row blocks, one partial
    ref_p, p = _param(), _param()
    ref, ours = make[0](ref_p), make[1](p, lazy)
    for g in _grads(4):
        ref_p.grad = g.clone()
        p.grad = g.clone().to_sparse(1) if sparse else g.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(p, ref_p, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls,kw", [(HeadSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1, lazy=True)),
                                    (HeadAdamW, dict(lr=0.1, weight_decay=0.1, lazy=True))])
def test_lazy_touches_only_active_rows(cls, kw):
    p = _param()
    opt = cls([p], **kw)
    rows = torch.tensor([1, 5, 7])
    for g in _grads(3):
        before = p.detach().clone()
        state_before = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v) and v.dim() == 2}
        p.grad = torch.sparse_coo_tensor(rows[None], g[rows], (12, 4), check_invariants=True)
        opt.step()
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(p.detach()[untouched], before[untouched])
        assert not torch.equal(p.detach()[rows], before[rows])
        for k, v in state_before.items():
            assert torch.equal(opt.state[p][k][untouched], v[untouched])


def test_lazy_sgd_active_rows_follow_dense_formula():
    p = _param()
    opt = HeadSGD([p], lr=0.1, momentum=0.5, weight_decay=0.2, lazy=True)
    rows = torch.tensor([0, 3])
    g = _grads(1)[0]
    w0 = p.detach().clone()
    p.grad = torch.sparse_coo_tensor(rows[None], g[rows], (12, 4), check_invariants=True)
    opt.step()
    torch.testing.assert_close(p.detach()[rows], w0[rows] - 0.1 * (g[rows] + 0.2 * w0[rows]))


def test_state_dict_round_trip():
    p, q = _param(), _param()
    a, b = HeadAdamW([p], lr=0.01), HeadAdamW([q], lr=0.01)
    for g in _grads(2):
        p.grad = g.clone()
        a.step()
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as a saved checkpoint
    q.data.copy_(p.data)
    g = _grads(1, seed=7)[0]
    p.grad, q.grad = g.clone(), g.clone()
    a.step()
    b.step()
    torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_dense_optimizer_given_sparse_gradient_keeps_dense_semantics():
    p, q = _param(), _param()
    a, b = HeadSGD([p], lr=0.1, momentum=0.9, weight_decay=0.1), torch.optim.SGD([q], lr=0.1, momentum=0.9,
                                                                                 weight_decay=0.1)
    rows = torch.tensor([2, 4])
    for g in _grads(3):
        p.grad = torch.sparse_coo_tensor(rows[None], g[rows], (12, 4), check_invariants=True)
        q.grad = p.grad.to_dense()
        a.step()
        b.step()
    torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_sorted_uncoalesced_rows_take_the_fast_path_with_the_same_result():
    rows = torch.tensor([0, 3, 7])
    g = _grads(1)[0]
    results = []
    for grad in (torch.sparse_coo_tensor(rows[None], g[rows], (12, 4), check_invariants=True),
                 torch.sparse_coo_tensor(rows[None], g[rows], (12, 4), check_invariants=True).coalesce(),
                 torch.sparse_coo_tensor(torch.tensor([[7, 0, 3, 3]]), torch.cat([g[[7, 0, 3]], 0 * g[[3]]]),
                                         (12, 4), check_invariants=True)):
        p = _param()
        opt = HeadAdamW([p], lr=0.1, lazy=True)
        p.grad = grad
        opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
