"""AnnIndex.refresh re-encodes only rows whose code may have changed (a safe radius per row around
the unit vector it was encoded from): the codes equal those of encoding every row, step after step,
for both metrics and both rotations; the radius is safe and nearly tight; rescaled rows are skipped."""
import pytest
import torch
import torch.nn.functional as F

from ds_xc import ClassParallelHead
from ds_xc.head import build_head_optimizer
from ds_xc.sampling.ann.codes import encode
from ds_xc.sampling.ann.index import AnnIndex

L, D = 2000, 24


def _all_codes(index, w):
    """The reference: every row encoded afresh, in list order."""
    return encode(index.unit_rows(w, normalise=False), index.projection)[index.list_ids]


@pytest.mark.parametrize("metric,rotation", [("cosine", "random"), ("dot", "random"), ("cosine", "itq")])
def test_refresh_equals_encoding_every_row(metric, rotation):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(L, D, generator=g)
    index = AnnIndex(D, 24 if rotation == "itq" else 128, rotation, 0, 4, 3, "torch", metric=metric)
    index.build(w)
    index.track_max_share = 1.0  # keep tracking whatever share of the rows moves (see the next test)
    assert torch.equal(index.list_codes, _all_codes(index, w)) and index.encoded_from is None
    index.refresh(w)  # the first refresh of every row starts tracking: every row encoded
    assert index.last_refresh == (L, L) and torch.equal(index.list_codes, _all_codes(index, w))
    index.build(w)  # a rebuild keeps tracking
    assert index.encoded_from is not None and torch.equal(index.list_codes, _all_codes(index, w))
    buf, skipped = torch.zeros_like(w), 0
    for step in range(40):  # SGD with momentum and weight decay on a sparse gradient (10% of the rows)
        grad = torch.zeros_like(w)
        act = torch.randperm(L, generator=g)[: L // 10]
        grad[act] = torch.randn(act.numel(), D, generator=g) * (0.3 if step < 20 else 0.01)
        buf.mul_(0.9 if step < 30 else 0.0).add_(grad + 5e-3 * w)
        w -= 0.1 * buf
        if step % 3 == 0:  # a lazy refresh of some rows, then the dense one
            rows = torch.randperm(L, generator=g)[:300]
            index.refresh(w, rows)
            assert index.last_refresh[0] == 300
            codes = index.list_codes.clone()
            codes[index.position[rows]] = encode(index.unit_rows(w[rows], normalise=False), index.projection)
            assert torch.equal(index.list_codes, codes)
        index.refresh(w)
        assert torch.equal(index.list_codes, _all_codes(index, w)), step
        skipped += index.last_refresh[0] - index.last_refresh[1]
        if step >= 30 and metric == "cosine":  # no momentum left: an inactive row only shrinks, keeps its code
            assert index.last_refresh[1] <= L // 10 + (index.radius < 0).sum()
    assert skipped > 5 * L


def test_tracking_pauses_when_most_rows_move_and_restarts():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(L, D, generator=g)
    index = AnnIndex(D, 128, "random", 0, 4, 3, "torch")
    index.build(w)
    index.retry_every = 3
    states = []
    for step in range(12):
        moving = L if step in (2, 3) else L // 20  # steps 2 and 3 move every row
        w[:moving] += 0.05 * torch.randn(moving, D, generator=g)
        index.refresh(w)
        assert torch.equal(index.list_codes, _all_codes(index, w)), step
        states.append((index.encoded_from is not None, index.last_refresh[1]))
    # step 0 starts tracking (all encoded); 1 re-encodes ~5% (+ the rows without a safe radius);
    # 2: every row moved -> pause; 3, 4: plain encodes; 5 (3 refreshes later): tracking again
    assert [t for t, _ in states] == [True, True, False, False, False, True] + [True] * 6
    assert states[0][1] == L and states[1][1] < L // 4 and states[2][1] > L // 2
    assert states[3][1] == states[4][1] == states[5][1] == L and max(n for _, n in states[6:]) < L // 4


def test_radius_is_safe_and_nearly_tight():
    """Move each unit row straight at its nearest sign boundary: by 0.999 radius no bit flips; by
    (radius + slack) * 1.001 plus the remaining margin the bit does flip (the bound is no looser than the
    float slack)."""
    g = torch.Generator().manual_seed(1)
    w = F.normalize(torch.randn(500, D, generator=g, dtype=torch.float64), dim=1).float()
    index = AnnIndex(D, 96, "random", 0, 3, 7, "torch")
    index.build(w)
    index.refresh(w)
    p = index.projection  # (d, b)
    z = w @ p
    j = z.abs().argmin(dim=1)  # (n,) the bit nearest its boundary
    pj = p[:, j].t()  # (n, d)
    toward = -torch.sign(z.gather(1, j[:, None])) * pj / pj.norm(dim=1, keepdim=True)
    ok = index.radius > 0
    near = w + 0.999 * index.radius[:, None] * toward
    assert torch.equal(encode(near[ok], p), encode(w[ok], p))
    index.refresh(near)
    assert index.last_refresh[1] == int((~ok).sum())  # only the rows with no safe radius were encoded
    margin = z.abs().amin(dim=1) / w.norm(dim=1)
    far = w + (margin * 1.01)[:, None] * toward
    assert (encode(far, p) != encode(w, p)).any(dim=1).all()
    assert ok.float().mean() > 0.95
    torch.testing.assert_close(index.radius[ok], margin[ok] - (6 * D + 16) * 2.0 ** -24, rtol=1e-5, atol=1e-6)


def test_dense_ann_head_keeps_exact_codes_and_skips_rows():
    """A head with update dense: after each step the index holds the codes of every current row."""
    sampler = {"type": "ann", "sample_rate": 0.1, "code_bits": 64, "nprobe": 4, "top_k": 8, "rerank": 16,
               "rebuild_interval": 0}
    head = ClassParallelHead(D, 600, loss={"type": "cosface", "scale": 10.0}, sampler=sampler, update="dense",
                             seed=2)
    opt = build_head_optimizer(head, {"type": "sgd", "lr": 0.5, "momentum": 0.0, "weight_decay": 1e-3})
    g = torch.Generator().manual_seed(3)
    encoded = []
    for step in range(12):
        x = torch.randn(32, D, generator=g)
        y = torch.randint(0, 600, (32,), generator=g)
        head(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        index = head.sampler.index
        if step:
            encoded.append(index.last_refresh[1])
        assert index.last_refresh[0] in (0, 600)
    head(x, y)  # the refresh of the last step's changes, before the query
    assert torch.equal(index.list_codes, _all_codes(index, head.weight.detach()))
    assert encoded[0] == 600  # the first refresh of every row starts tracking
    assert max(encoded[1:]) < 600 // 4  # then the active rows (60) and the rows without a safe radius
    state = head.sampler.state_dict()
    head.sampler.load_state_dict(state)  # the reference vectors are not saved: re-encoded when refreshed
    assert head.sampler.index.encoded_from is None
    head.sampler.index.refresh(head.weight)
    assert head.sampler.index.last_refresh == (600, 600)
    assert torch.equal(head.sampler.index.list_codes, _all_codes(index, head.weight.detach()))


def test_reduced_precision_matmuls_widen_the_slack():
    """With TF32/bf16 matmuls allowed, the rounding slack grows to 2^-8 units: radii go negative and
    every refreshed row is re-encoded (still the exact codes)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, D, generator=g)
    index = AnnIndex(D, 64, "random", 0, 3, 2, "torch")
    index.build(w)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        index.refresh(w)
        assert (index.radius < 0).float().mean() > 0.9
    finally:
        torch.set_float32_matmul_precision(before)
    w[:10] *= 1.5
    index.refresh(w)
    assert index.last_refresh[1] > 270 and torch.equal(index.list_codes, _all_codes(index, w))
