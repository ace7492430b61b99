"""CUDA graphs of the head's step (ds_xc/head/graphs.py), proven on the CPU as far as a CPU allows.

* The captured code path (``graphed``: device scalars, in-place products, persistent buffers) trains as
  the plain eager head does, float64, every sampler, update mode and head optimizer.
* Two plain steps of it launch the same ops with the same arguments on the same persistent tensors
  (ds_xc/replay_check.py): one captured graph replays both. The plain eager path does not (its step count
  is a Python number baked into the kernels): the check can fail.
* A replay's host side (``after_replay`` of the head, its sampler and its optimizer, with the runner's
  preparation) advances exactly what an eager step advances on the host.
* What cannot be captured is refused naming ``extreme_classification.cuda_graphs``; XCEngine with the
  key on (one process) trains as with it off.
* On a GPU (skipped without CUDA): captured and replayed, equal to eager.
"""
import pytest
import torch

import ds_xc
from ds_xc.head import ClassParallelHead, build_head_optimizer
from ds_xc.head.graphs import KEY, HeadStepGraph
from ds_xc.host_syncs import is_host_side
from ds_xc.replay_check import ReplayRecorder, first_difference

C, D, B = 300, 8, 24
SAMPLERS = {
    "uniform": {"type": "uniform", "sample_rate": 0.1},
    "knn": {"type": "knn", "sample_rate": 0.1, "neighbors": 4, "rebuild_interval": 5},
    "ann": {"type": "ann", "sample_rate": 0.1, "code_bits": 64, "nlist": 8, "nprobe": 2, "top_k": 8, "rerank": 16,
            "rebuild_interval": 5, "backend": "auto"},
}
OPTIMIZERS = {"sgd": {"type": "sgd", "lr": 0.3, "momentum": 0.9, "weight_decay": 1e-3},
              "adamw": {"type": "adamw", "lr": 0.02, "weight_decay": 1e-2}}


def _head(sampler, update="auto", optimizer="sgd", dtype=torch.float64, device=None, check_interval=3, **sampler_kw):
    spec = dict(SAMPLERS[sampler], **sampler_kw)
    head = ClassParallelHead(D, C, loss={"type": "cosface", "scale": 8.0, "margin": 0.2}, sampler=spec,
                             dtype=dtype, init_std=0.5, seed=5, update=update, check_interval=check_interval,
                             device=device)
    return head, build_head_optimizer(head, dict(OPTIMIZERS[optimizer], update="auto"))


def _batch(step, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(B, D, generator=g, dtype=torch.float64).to(device, dtype),
            torch.randint(0, C, (B,), generator=g).to(device))


def _eager_step(head, opt, step):
    x, y = _batch(step, head.weight.dtype, head.weight.device)
    x.requires_grad_()
    loss = head(x, y, batch_sizes=[B])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), x.grad


CASES = [(s, "auto", "sgd") for s in SAMPLERS] + [(s, "auto", "adamw") for s in SAMPLERS]
CASES += [("uniform", "lazy", "sgd"), ("knn", "dense", "sgd"), ("ann", "lazy", "adamw"), ("ann", "dense", "sgd")]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_bf16_heads_take_the_graphed_path_alike(optimizer):
    """bfloat16 weights (update lazy, stochastic rounding): the same rounding stream, the same steps."""
    plain, plain_opt = _head("uniform", "lazy", optimizer, dtype=torch.bfloat16)
    head, opt = _head("uniform", "lazy", optimizer, dtype=torch.bfloat16)
    graph = HeadStepGraph(head, opt, rows=B)
    for step in range(6):
        loss, _ = _eager_step(plain, plain_opt, step)
        got, _ = graph.step(*_batch(step, torch.bfloat16))
        torch.testing.assert_close(got, loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(head.weight.float(), plain.weight.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("sampler,update,optimizer", CASES)
def test_the_graphed_path_trains_as_the_eager_head(sampler, update, optimizer):
    plain, plain_opt = _head(sampler, update, optimizer)
    head, opt = _head(sampler, update, optimizer)
    graph = HeadStepGraph(head, opt, rows=B)
    for step in range(12):  # checks, an index / graph rebuild (interval 5) and plain steps
        loss, grad = _eager_step(plain, plain_opt, step)
        got_loss, got_grad = graph.step(*_batch(step))
        torch.testing.assert_close(got_loss, loss, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got_grad, grad, rtol=1e-10, atol=1e-12)
    opt.catch_up()
    plain_opt.catch_up()
    torch.testing.assert_close(head.weight, plain.weight, rtol=1e-10, atol=1e-12)
    assert graph.eager_steps == 12 and graph.replays == 0  # on a CPU every step runs eagerly


def _record(head, opt, graph, step) -> list:
    """The ops of one plain step as a capture would see them (the runner's preparation outside)."""
    x, y = _batch(step)
    assert not head.host_work_due() and not opt.exact_host_work_due()
    with torch.no_grad():
        graph.x.copy_(x)
        graph.y.copy_(y)
    opt.prepare_graphed_step()
    head.sampler.fill.prepare()
    graph.x.grad = None
    recorder = ReplayRecorder()
    with recorder:
        head(graph.x, graph.y, [B]).backward()
        opt.step()
    head.weight.grad = None
    return recorder.ops


@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_two_plain_steps_replay_one_graph(sampler, optimizer):
    rebuild = {} if sampler == "uniform" else {"rebuild_interval": 100}  # no rebuild in the recorded steps
    head, opt = _head(sampler, optimizer=optimizer, check_interval=4, **rebuild)
    graph = HeadStepGraph(head, opt, rows=B)
    for step in range(5):  # warm-up: builds, the first check
        graph.step(*_batch(step))
    first = _record(head, opt, graph, 5)
    second = _record(head, opt, graph, 6)
    assert len(first) > 50
    assert first_difference(first, second) is None, first_difference(first, second)


def test_the_replay_check_finds_what_a_graph_would_bake_in():
    head, opt = _head("uniform", check_interval=4)
    for step in range(5):
        _eager_step(head, opt, step)
    records = []
    x, y = torch.zeros(B, D, dtype=torch.float64, requires_grad=True), torch.zeros(B, dtype=torch.int64)
    for step in (5, 6):  # the plain path: lazy_exact's products swap buffers, its step count is a Python number
        with torch.no_grad():
            for static, value in zip((x, y), _batch(step)):
                static.copy_(value)
        x.grad = None
        recorder = ReplayRecorder()
        with recorder:
            head(x, y, batch_sizes=[B]).backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        records.append(recorder.ops)
    diff = first_difference(*records)
    assert diff is not None and ("(1025, 2, 2)" in diff or "index_fill_" in diff), diff


def _host_state(head, opt) -> dict:
    """What a step changes on the host: the head's, sampler's and fill stream's counters, the optimizer's
    counters and host-side tensors (a replay runs no Python: after_replay must advance these alike)."""
    out = {"calls": head._calls, "sampler_steps": getattr(head.sampler, "steps", None),
           "draws": head.sampler.fill.draws, "dirty": len(getattr(head.sampler, "dirty", []) or [])}
    for i, state in enumerate(opt.state.values()):
        for k, v in state.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{i}.{k}"] = v
            elif torch.is_tensor(v) and is_host_side(v):
                out[f"{i}.{k}"] = v.item()
    out["counts"] = sorted(opt._step_counts.values())
    return out


@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_after_replay_advances_what_an_eager_step_advances(sampler, optimizer):
    rebuild = {} if sampler == "uniform" else {"rebuild_interval": 100}
    heads = [_head(sampler, optimizer=optimizer, check_interval=4, **rebuild) for _ in range(2)]
    graphs = [HeadStepGraph(h, o, rows=B) for h, o in heads]
    for step in range(5):
        for g in graphs:
            g.step(*_batch(step))
    (head, opt), (twin, twin_opt) = heads
    assert _host_state(head, opt) == _host_state(twin, twin_opt)
    _record(head, opt, graphs[0], 5)  # a plain step, eagerly: Python runs
    twin_opt.prepare_graphed_step()  # a replay: the runner's preparation and after_replay only
    twin.sampler.fill.prepare()
    twin.after_replay()
    twin_opt.after_replay()
    assert _host_state(head, opt) == _host_state(twin, twin_opt)


def test_what_cannot_be_captured_is_refused():
    head, opt = _head("uniform", check_interval=1)
    with pytest.raises(ds_xc.ConfigError, match=f"{KEY}.*check_interval"):
        HeadStepGraph(head, opt, rows=B)
    triton = ClassParallelHead(D, C, sampler=SAMPLERS["uniform"], check_interval=3, softmax_backend="triton")
    with pytest.raises(ds_xc.ConfigError, match=f"{KEY}.*triton"):
        HeadStepGraph(triton, build_head_optimizer(triton, OPTIMIZERS["sgd"]), rows=B)


def test_more_refusals_name_the_key():
    head, opt = _head("uniform")
    with pytest.raises(ds_xc.ConfigError, match=f"{KEY}.*HeadSGD"):
        HeadStepGraph(head, torch.optim.SGD([head.weight], lr=0.1), rows=B)
    for change, why in [({"groups": 2}, "groups"), ({"backend": "torch"}, "data-dependent")]:
        ann = ClassParallelHead(D, C, sampler=dict(SAMPLERS["ann"], **change), check_interval=3)
        with pytest.raises(ds_xc.ConfigError, match=f"{KEY}.*{why}"):
            HeadStepGraph(ann, build_head_optimizer(ann, OPTIMIZERS["sgd"]), rows=B)
    head.world_size = 2  # as on a rank of a 2-rank group
    with pytest.raises(ds_xc.ConfigError, match=f"{KEY}.*one rank"):
        HeadStepGraph(head, opt, rows=B)


def _engine_config(graphs: bool, **overrides) -> dict:
    section = {"num_classes": C, "embedding_dim": D, "loss": {"type": "cosface", "scale": 8.0, "margin": 0.2},
               "sampler": SAMPLERS["uniform"], "init_std": 0.5, "seed": 5, "check_interval": 3,
               "nonfinite": "raise", "cuda_graphs": graphs, "optimizer": OPTIMIZERS["sgd"]}
    section.update(overrides)
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True,
            "extreme_classification": section}


def _engine_run(rank, world, graphs: bool) -> tuple:
    """Six steps of XCEngine (one rank of a pool: ds_xc.initialize joins its group), and the refusals."""
    torch.manual_seed(3)
    body = torch.nn.Linear(5, D, bias=False)
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1),
                          config=_engine_config(graphs))
    assert (xc.head_graph is not None) == graphs
    losses = []
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        loss = xc.forward_backward(torch.randn(B, 5, generator=g), torch.randint(0, C, (B,), generator=g))
        xc.step()
        losses.append(float(loss))
    refusals = []
    if graphs:
        for change in ({"nonfinite": "skip"}, {"check_interval": 1}):
            try:
                ds_xc.initialize(model=torch.nn.Linear(5, D, bias=False), config=_engine_config(True, **change))
            except ds_xc.ConfigError as exc:
                refusals.append(str(exc))
    return losses, body.weight.detach().clone(), xc.head.weight.detach().clone(), refusals


def test_xc_engine_with_cuda_graphs_trains_as_without(pools):
    (plain,), (graphed,) = pools(1).run(_engine_run, False), pools(1).run(_engine_run, True)
    assert plain[0] == pytest.approx(graphed[0], rel=1e-5)
    torch.testing.assert_close(graphed[1], plain[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(graphed[2], plain[2], rtol=1e-5, atol=1e-6)
    assert len(graphed[3]) == 2 and all(KEY in r for r in graphed[3])
    assert "nonfinite" in graphed[3][0] and "check_interval" in graphed[3][1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_captured_and_replayed_on_a_gpu_equals_eager(sampler):
    plain, plain_opt = _head(sampler, dtype=torch.float32, device="cuda")
    head, opt = _head(sampler, dtype=torch.float32, device="cuda")
    graph = HeadStepGraph(head, opt, rows=B)
    for step in range(14):
        loss, _ = _eager_step(plain, plain_opt, step)
        got, _ = graph.step(*_batch(step, torch.float32, "cuda"))
        torch.testing.assert_close(got, loss, rtol=1e-4, atol=1e-5)
    assert graph.replays > 0 and graph.captures >= 1
    opt.catch_up()
    plain_opt.catch_up()
    torch.testing.assert_close(head.weight, plain.weight, rtol=1e-4, atol=1e-5)
