"""Reliability through XCEngine on 2 gloo ranks: exact resume, refused checkpoints, bad input
and NaN/Inf steps.

* Resume: 3 steps + save + resume + 3 steps gives bit for bit the losses and final weights
  of 6 steps straight, with a dropout backbone (global RNG per rank), an exact head, a
  uniform and an ANN sampler (index rebuilt across the save), lazy AdamW, bayes_prior
  residuals, the overlap pipeline and gradient accumulation.
* A checkpoint of another class count or embedding dim is refused, naming both, and
  nothing (head, head optimizer, backbone) changes.
* An out-of-range label, a wrong embedding width or dtype on one rank raises on both ranks
  (the faulty rank names label/position/shape, the other names that rank); the pool keeps
  working afterwards, so nobody hung.
* NaN embeddings or NaN gradients on one rank: both ranks skip the step, head, head
  optimizer, backbone and backbone optimizer are unchanged, the counter says 1, and
  training goes on exactly as if the bad batch had never come; with nonfinite="raise" both
  ranks raise.
"""
import pytest
import torch

import ds_xc
from ds_xc.head import init_shard
from tests.reference import reference

C, D, IN, B, SEED = 23, 6, 8, 4, 11
COMPRESSION = {"method": "bayes_prior", "density": 0.3, "min_numel": 16, "stats_sync_interval": 2}
ANN = {"type": "ann", "sample_rate": 0.5, "code_bits": 32, "nlist": 3, "nprobe": 2, "top_k": 3, "rerank": 0,
       "rebuild_interval": 2}
CASES = {
    "exact_sgd": dict(sampler={"type": "full"}, opt={"type": "sgd", "lr": 0.5, "momentum": 0.9}),
    "uniform_lazy_adamw_compressed_overlap": dict(
        sampler={"type": "uniform", "sample_rate": 0.4}, opt={"type": "adamw", "lr": 0.05, "update": "lazy"},
        compression=True, overlap=True),
    "ann_lazy_adamw_compressed_overlap_gas2": dict(
        sampler=ANN, opt={"type": "adamw", "lr": 0.05, "update": "lazy"}, compression=True, overlap=True, gas=2),
    # an AdamW backbone: after one dense step the wrapper takes its steps with the variance frozen
    "uniform_adamw_backbone_frozen_overlap": dict(
        sampler={"type": "uniform", "sample_rate": 0.4}, opt={"type": "adamw", "lr": 0.05, "update": "lazy"},
        compression=True, overlap=True, backbone="adamw"),
}


class Body(torch.nn.Module):
    """Linear + dropout, with switches that break one rank's output or gradient on purpose."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.lin = torch.nn.Linear(IN, D, bias=False)
        self.drop = torch.nn.Dropout(dropout)
        self.fault = None  # None | "nan_out" | "nan_grad" | "wide" | "int"

    def forward(self, x):
        out = self.drop(self.lin(x))
        if self.fault == "nan_out":
            out = out * torch.tensor([1.0, 1.0, float("nan"), 1.0]).view(B, 1)
        elif self.fault == "nan_grad":
            out = NanGrad.apply(out)
        elif self.fault == "wide":
            out = torch.cat([out, out[:, :1]], dim=1)
        elif self.fault == "int":
            out = out.detach().long()
        return out


class NanGrad(torch.autograd.Function):
    """Identity forward; a NaN gradient backward (a non-finite step on one rank; also used by
    tests/test_compression_zero.py)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def _config(sampler, opt, compression=False, overlap=False, gas=1, nonfinite="skip"):
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
           "extreme_classification": {"num_classes": C, "embedding_dim": D, "sampler": sampler,
                                      "loss": {"type": "arcface", "scale": 8.0, "margin": 0.2},
                                      "init_std": 0.5, "seed": SEED, "nonfinite": nonfinite,
                                      "optimizer": dict(opt, weight_decay=0.01)}}
    if compression:
        cfg["gradient_compression"] = dict(COMPRESSION)
    if overlap:
        cfg["extreme_classification"]["overlap"] = {"enabled": True, "num_chunks": 2, "bucket_size_mb": 1e-5}
    return cfg


def _batch(i, rank):
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(B, IN, generator=g), torch.randint(0, C, (B,), generator=g)


def _build(rank, case, dropout=0.0, nonfinite="skip", **over):
    torch.manual_seed(SEED)
    body = Body(dropout)
    spec = dict(CASES[case], **over)
    adamw = spec.pop("backbone", "sgd") == "adamw"
    opt = (torch.optim.AdamW(body.parameters(), lr=0.01) if adamw
           else torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9))
    cfg = _config(nonfinite=nonfinite, **spec)
    if adamw:
        cfg["gradient_compression"].update(warmup_steps=1, adam_variance="auto")
    xc = ds_xc.initialize(model=body, optimizer=opt, config=cfg)
    assert xc.compression is None or xc.compression.frozen_variance == adamw
    torch.manual_seed(SEED + 100 * rank)  # each rank's dropout stream, the same in every run
    return xc, spec.get("gas", 1)


def _train(xc, rank, gas, start, stop, faults=None):
    """Optimizer steps [start, stop): batch (step, micro) is a pure function of the position."""
    losses = []
    for step in range(start, stop):
        for m in range(gas):
            fault = (faults or {}).get((step, m, rank))
            xc.engine.module.fault = fault
            x, y = _batch(step * gas + m if fault is None else 10**5 + step, rank)
            losses.append(xc.forward_backward(x, y).item())
            xc.step()
        xc.engine.module.fault = None
    return losses


def _state(xc):
    """Copies of everything a step may change: head, head optimizer, backbone, backbone optimizer."""
    def tensors(sd):
        return {f"{k}.{n}": v.clone() for k, st in sd["state"].items() for n, v in st.items() if torch.is_tensor(v)}
    return {"head": xc.head.weight.detach().clone(), "head_opt": tensors(xc.head_optimizer.state_dict()),
            "body": {n: p.detach().clone() for n, p in xc.engine.module.named_parameters()},
            "body_opt": tensors(xc.engine.basic_optimizer.state_dict())}


def _assert_same(a, b):
    assert torch.equal(a["head"], b["head"])
    for part in ("head_opt", "body", "body_opt"):
        assert a[part].keys() == b[part].keys(), part
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part}.{k}"


# ---------------------------------------------------------------------- exact resume
def _resume_run(rank, world, case, path, phase):
    xc, gas = _build(rank, case, dropout=0.3)
    if phase == "straight":
        losses = _train(xc, rank, gas, 0, 6)
    elif phase == "first":
        losses = _train(xc, rank, gas, 0, 3)
        xc.save_checkpoint(path, tag="step3", client_state={"step": 3})
    else:
        start = xc.load_checkpoint(path)["step"]
        losses = _train(xc, rank, gas, start, 6)
    out = _state(xc)
    out["losses"] = losses
    out["skipped"] = xc.stats()["skipped_steps"]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_exact(pools, tmp_path, case):
    pool = pools(2)
    straight = pool.run(_resume_run, case, str(tmp_path / "a"), "straight")
    pool.run(_resume_run, case, str(tmp_path / "b"), "first")
    resumed = pool.run(_resume_run, case, str(tmp_path / "b"), "resume")
    gas = CASES[case].get("gas", 1)
    for r in range(2):
        assert resumed[r]["losses"] == straight[r]["losses"][3 * gas:]  # bitwise on CPU
        _assert_same(resumed[r], straight[r])
        assert straight[r]["skipped"] == resumed[r]["skipped"] == 0
    assert len(set(straight[0]["losses"])) == len(straight[0]["losses"])  # the steps changed the model
    assert (tmp_path / "b" / "latest").read_text() == "step3"
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["latest", "step3"]  # no staging left


# ---------------------------------------------------------------------- refused checkpoints
def _load_mismatched(rank, world, path, change):
    torch.manual_seed(SEED)
    body = Body()
    cfg = _config(**CASES["uniform_lazy_adamw_compressed_overlap"])
    cfg["extreme_classification"].update(change)
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9),
                          config=cfg)
    x, y = _batch(0, rank)
    xc.forward_backward(x, y % cfg["extreme_classification"]["num_classes"])
    xc.step()  # optimizer states exist
    before = _state(xc)
    try:
        xc.load_checkpoint(path)
    except RuntimeError as exc:
        msg = str(exc)
    else:
        msg = None
    _assert_same(before, _state(xc))
    return msg


def _save_only(rank, world, path):
    xc, gas = _build(rank, "uniform_lazy_adamw_compressed_overlap")
    _train(xc, rank, gas, 0, 1)
    xc.save_checkpoint(path, tag="step1", client_state={"step": 1})


@pytest.mark.parametrize("classes", [C + 2, C - 3])
def test_mismatched_checkpoint_is_refused_and_nothing_changes(pools, tmp_path, classes):
    pool = pools(2)
    pool.run(_save_only, str(tmp_path))
    msgs = pool.run(_load_mismatched, str(tmp_path), {"num_classes": classes})
    expect = [f"{C} classes on 2 ranks", f"{classes} classes on 2 ranks", "nothing was loaded",
              "same num_classes"]
    for msg in msgs:
        assert msg is not None and all(e in msg for e in expect), msg


# ---------------------------------------------------------------------- bad input
def _bad_input(rank, world, fault, faulty_rank, case):
    xc, gas = _build(rank, case)
    x, y = _batch(0, rank)
    if rank == faulty_rank:
        if fault == "label":
            y[2] = C
        else:
            xc.engine.module.fault = fault
    try:
        xc.forward_backward(x, y)
        err = None
    except (ValueError, TypeError) as exc:
        err = (type(exc).__name__, str(exc))
    xc.engine.module.fault = None
    xc.head_optimizer.zero_grad()
    xc.engine.zero_grad()
    after = _train(xc, rank, 1, 1, 2)  # collectives still line up on both ranks
    return err, after


@pytest.mark.parametrize("fault,faulty,case,own", [
    ("label", 1, "exact_sgd", f"label {C} at position 2 on rank 1 is outside [0, {C})"),
    ("label", 0, "uniform_lazy_adamw_compressed_overlap", f"label {C} at position 2 on rank 0 is outside [0, {C})"),
    ("wide", 1, "exact_sgd", f"embeddings must have shape (batch, {D}), got ({B}, {D + 1}) on rank 1"),
    ("int", 0, "exact_sgd", "embeddings must be floating point, got torch.int64 on rank 0"),
])
def test_bad_input_raises_on_every_rank(pools, fault, faulty, case, own):
    pool = pools(2)
    res = pool.run(_bad_input, fault, faulty, case)
    clean = pool.run(_clean, case, 1, 1)  # the same step on engines that never saw the bad input
    for rank, (err, after) in enumerate(res):
        assert err is not None, f"rank {rank} did not raise"
        if rank == faulty:
            assert own in err[1]
        else:
            assert f"another rank reported invalid labels, embedding shape, dtype or device: rank(s) [{faulty}]" in err[1]
            assert f"this is rank {rank}" in err[1]
        # the refused step left nothing behind (weights, optimizer, sampler draws): bit for bit the same loss
        assert after == clean[rank], (after, clean[rank])
    assert res[0][1] == res[1][1]  # the global-batch mean, the same on both ranks
    if CASES[case]["sampler"]["type"] == "full":  # exact head at its initial weights: the float64 formula
        assert res[0][1][0] == pytest.approx(_reference_first_loss(1), rel=1e-5)


def _reference_first_loss(batch):
    """ArcFace loss of batch ``batch`` (both ranks) at the initial weights, float64 (tests/reference.py)."""
    torch.manual_seed(SEED)
    w_body = Body().lin.weight.detach().double()  # (D, IN), the engine's rank-0 init
    xs, ys = zip(*(_batch(batch, r) for r in range(2)))
    emb = torch.cat(xs).double() @ w_body.t()  # (2B, D)
    w_head = init_shard(C, D, 0, C, 0.5, SEED).double()  # (C, D): every class, as the shards hold them
    cfg = _config(**CASES["exact_sgd"])["extreme_classification"]["loss"]
    return float(reference(emb, w_head, torch.cat(ys), cfg)[0])


# ---------------------------------------------------------------------- NaN / Inf
def _nonfinite(rank, world, case, fault, faulty_rank, bad_step):
    xc, gas = _build(rank, case)
    faults = {(bad_step, 0, faulty_rank): fault}
    losses = _train(xc, rank, gas, 0, bad_step)
    before = _state(xc)
    bad = _train(xc, rank, gas, bad_step, bad_step + 1, faults)
    after = _state(xc)
    _assert_same(before, after)
    steps_done = xc.global_steps
    rest = _train(xc, rank, gas, bad_step, bad_step + 2)  # the batches the bad one displaced
    return {"losses": losses + rest, "bad": bad, "stats": xc.stats(), "skipped_ds": xc.engine.skipped_steps,
            "global_steps": steps_done}


def _clean(rank, world, case, steps, start=0):
    xc, gas = _build(rank, case)
    return _train(xc, rank, gas, start, start + steps)


@pytest.mark.parametrize("case", ["exact_sgd", "uniform_lazy_adamw_compressed_overlap",
                                  "uniform_adamw_backbone_frozen_overlap"])
@pytest.mark.parametrize("fault", ["nan_out", "nan_grad"])
def test_nonfinite_step_is_skipped_everywhere(pools, case, fault):
    pool = pools(2)
    res = pool.run(_nonfinite, case, fault, 1, 2)
    clean = pool.run(_clean, case, 4)
    for rank, r in enumerate(res):
        assert r["stats"]["skipped_steps"] == 1 and r["skipped_ds"] == 1
        assert r["global_steps"] == 3  # a skipped step still counts, as DeepSpeed's fp16 overflow skip
        if fault == "nan_out":
            assert r["bad"][0] != r["bad"][0]  # NaN loss reported
            assert r["stats"]["nonfinite_inputs"] == 1
        else:
            assert r["bad"][0] == r["bad"][0]  # finite loss, NaN gradients
        if fault == "nan_out" or case == "exact_sgd":
            # nothing of the bad batch stayed behind: training goes on as if it never came
            assert r["losses"] == clean[rank], (r["losses"], clean[rank])
        else:  # NaN gradients reached the overlapped compressed buckets: residuals restarted
            assert r["losses"][:2] == clean[rank][:2] and all(v == v for v in r["losses"])


def _nonfinite_raise(rank, world, fault):
    xc, gas = _build(rank, "exact_sgd", nonfinite="raise")
    try:
        _train(xc, rank, gas, 0, 1, {(0, 0, 1): fault})
    except FloatingPointError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("fault", ["nan_out", "nan_grad"])
def test_nonfinite_raise_policy_raises_on_every_rank(pools, fault):
    msgs = pools(2).run(_nonfinite_raise, fault)
    for rank, msg in enumerate(msgs):
        assert msg is not None and "nonfinite='raise'" in msg
    if fault == "nan_out":
        assert "embeddings row 2 on rank 1 contains NaN or Inf" in msgs[1]
        assert "another rank reported NaN or Inf embeddings: rank(s) [1] (this is rank 0" in msgs[0]
