"""Devices and dtypes of the head on the devices a CPU torch offers (cpu, meta; float64,
float32, bfloat16), the checkpoint loader's placement, and the overlap timeline's lazy GPU
event resolution (with fake CUDA events, counting synchronisations).

* head.to(dtype) round trips (float32 -> float64 -> float32) take the next step bit for bit
  like a head that never moved, for every sampler; float64 and bfloat16 heads step with the
  optimizer state they had, and make the sampling decisions of the head that never moved.
* head.to("meta") moves weight, graph and index; to_empty + load_state_dict continues exactly.
* Optimizer state follows the weight's device at the next step.
* Checkpoints are read to the CPU and then placed: a float64 save loads into a float32 head;
  the generator state of an older checkpoint (a CPU or a CUDA one) derives a fill stream deterministically.
* Reshard gives every new rank a fill stream of its own.
* The RNG file is read to the CPU; CUDA states of more devices than present restore the first.
* GPU: CUDA heads are deterministic and their checkpoints cross over to the CPU and back, the fill
  stream continuing from its counter (skipped without CUDA; CPU and CUDA draw differently: fill.py).
"""
import copy
import importlib.util
import logging
import os
import types

import pytest
import torch

from ds_xc import checkpoint as ckpt
from ds_xc.engine import rng as xc_rng
from ds_xc.head import ClassParallelHead
from ds_xc.head.optim import HeadAdamW, HeadSGD, build_head_optimizer
from ds_xc.overlap import Timeline
from ds_xc.overlap.run import end_micro_step

C, D, B = 40, 8, 12
SAMPLERS = {
    "full": {"type": "full"},
    "uniform": {"type": "uniform", "sample_rate": 0.3},
    "knn": {"type": "knn", "sample_rate": 0.3, "neighbors": 4, "rebuild_interval": 2},
    "ann": {"type": "ann", "sample_rate": 0.3, "code_bits": 32, "nlist": 3, "nprobe": 2, "top_k": 3,
            "rerank": 0, "rebuild_interval": 2},
}
OPTIMIZER = {"type": "adamw", "lr": 0.05, "weight_decay": 0.01}


def _head(name, dtype=torch.float32, device=None, loss="softmax"):
    update = "dense" if name == "full" else "lazy"
    head = ClassParallelHead(D, C, loss=loss, sampler=SAMPLERS[name], dtype=dtype, seed=3, update=update,
                             device=device)
    return head, build_head_optimizer(head, dict(OPTIMIZER, update=update))


def _batch(step, device="cpu"):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(B, D, generator=gen, dtype=torch.float64).to(device),
            torch.randint(0, C, (B,), generator=gen).to(device))


def _step(head, opt, step, x_dtype=None):
    """One forward + backward + optimizer step (embeddings in ``x_dtype``, default the
    weight's); (loss, active ids or None)."""
    x, y = _batch(step, head.weight.device)
    loss = head(x.to(x_dtype or head.weight.dtype), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    index = head.last_active.union()
    return float(loss.detach()), None if index is None else index.cpu()


def _same(a, b) -> bool:
    """Two _step results are equal: the same loss and the same active ids."""
    (la, ia), (lb, ib) = a, b
    return la == lb and ((ia is None and ib is None) or (ia is not None and ib is not None and torch.equal(ia, ib)))


def _sampler_tensors(sampler) -> dict:
    """Every device-bound tensor of a sampler (graph, index, dirty rows)."""
    out = {}
    if getattr(sampler, "graph", None) is not None:
        out["graph"] = sampler.graph
    index = getattr(sampler, "index", None)
    if index is not None:
        out.update({k: v for k, v in index.state_dict().items() if torch.is_tensor(v)})
        out["position"] = index.position
    for i, rows in enumerate(getattr(sampler, "dirty", None) or []):
        out[f"dirty{i}"] = rows
    return out


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_dtype_round_trip_takes_the_same_step(name):
    ref, ref_opt = _head(name)
    moved, moved_opt = _head(name)
    for s in range(3):
        assert _same(_step(ref, ref_opt, s), _step(moved, moved_opt, s))
    before = {k: v.clone() for k, v in _sampler_tensors(moved.sampler).items()}
    assert (name in ("full", "uniform")) == (not before)  # knn has a graph, ann an index
    moved.to(torch.float64)
    assert moved.weight.dtype == torch.float64
    moved.to(torch.float32)
    assert moved.weight.dtype == torch.float32 and torch.equal(moved.weight, ref.weight)
    for key, value in _sampler_tensors(moved.sampler).items():  # index dtypes do not follow the weight
        assert value.dtype == before[key].dtype and torch.equal(value, before[key]), key
    assert moved.sampler.fill.state_dict() == ref.sampler.fill.state_dict()
    for s in range(3, 6):  # includes index / graph rebuilds (rebuild_interval 2)
        assert _same(_step(ref, ref_opt, s), _step(moved, moved_opt, s))
    assert torch.equal(moved.weight, ref.weight)


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.bfloat16, 3e-2)])
def test_other_dtype_steps_with_the_same_sampling_decisions(name, dtype, tol):
    ref, ref_opt = _head(name)
    moved, moved_opt = _head(name)
    for s in range(2):
        assert _same(_step(ref, ref_opt, s), _step(moved, moved_opt, s))
    moved.to(dtype)
    state = moved_opt.state[moved.weight]
    assert state["exp_avg"].dtype == torch.float32  # the optimizer state keeps its dtype
    for key, value in _sampler_tensors(moved.sampler).items():
        assert value.device == moved.weight.device, key
    # one step: no rebuild is due (knn/ann were built at step 0, rebuild_interval 2)
    loss_ref, active_ref = _step(ref, ref_opt, 2)
    loss, active = _step(moved, moved_opt, 2, torch.float32)  # the same queries: decisions are the head's
    assert (active is None and active_ref is None) or torch.equal(active, active_ref)
    assert loss == pytest.approx(loss_ref, rel=tol, abs=tol)
    assert moved.weight.dtype == dtype
    torch.testing.assert_close(moved.weight.float(), ref.weight, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_meta_move_then_to_empty_and_load_continues(name):
    ref, ref_opt = _head(name)
    for s in range(2):
        _step(ref, ref_opt, s)
    head_state, opt_state = copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict())  # no aliasing
    fill_state = ref.sampler.fill.state_dict()
    head, _ = _head(name)
    head.load_state_dict(head_state)
    head.to("meta")
    assert head.weight.device.type == "meta" and head.sampler.device.type == "meta"
    for key, value in _sampler_tensors(head.sampler).items():
        assert value.device.type == "meta", key
    assert head.sampler.fill.device.type == "meta" and head.sampler.fill.state_dict() == fill_state
    head.to_empty(device="cpu")  # meta tensors held no values: the index / graph are dropped
    assert head.sampler.device.type == "cpu" and not _sampler_tensors(head.sampler)
    head.load_state_dict(head_state)  # deferred init: the saved weights, index and optimizer come back
    opt = build_head_optimizer(head, dict(OPTIMIZER, update=head.update))  # to_empty made a new Parameter
    opt.load_state_dict(opt_state)
    for s in range(2, 4):
        assert _same(_step(head, opt, s), _step(ref, ref_opt, s))


@pytest.mark.parametrize("make", [lambda p: HeadAdamW([p], lr=0.1),
                                  lambda p: HeadSGD([p], lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_optimizer_state_follows_the_weight_device(make):
    """State made on the CPU, weight now on meta (what head.to(device) does to a CUDA weight):
    the next step moves the state to the weight's device; step stays a CPU scalar."""
    p = torch.nn.Parameter(torch.zeros(5, 3))
    opt = make(p)
    p.grad = torch.ones(5, 3)
    opt.step()
    p_meta = torch.nn.Parameter(torch.zeros(5, 3, device="meta"))
    opt.param_groups[0]["params"] = [p_meta]
    opt.state[p_meta] = opt.state.pop(p)
    p_meta.grad = torch.ones(5, 3, device="meta")
    opt.step()
    for key, value in opt.state[p_meta].items():
        assert value.device.type == ("cpu" if key == "step" else "meta"), key


@pytest.mark.parametrize("name", ["uniform", "knn", "ann"])
def test_float64_checkpoint_loads_into_float32_head(name, tmp_path, monkeypatch):
    src, src_opt = _head(name, torch.float64)
    for s in range(3):
        _step(src, src_opt, s)
    ckpt.save_head_state(str(tmp_path / "t"), src, src_opt)
    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    dst, dst_opt = _head(name, torch.float32)
    ckpt.load_head_state(str(tmp_path / "t"), dst, dst_opt)
    assert seen == ["cpu"]  # read to the CPU whatever the head's device
    assert dst.weight.dtype == torch.float32 and torch.equal(dst.weight, src.weight.float())
    state = dst_opt.state[dst.weight]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].device == dst.weight.device
    assert torch.equal(state["exp_avg"], src_opt.state[src.weight]["exp_avg"].float())
    assert state["step"].device.type == "cpu"
    assert dst.sampler.fill.state_dict() == src.sampler.fill.state_dict()
    if name != "uniform":  # float32 weights differ from the float64 ones the index describes
        assert dst.sampler.built_at is None
        src.rebuild_index()
        dst.rebuild_index()
        assert _sampler_tensors(dst.sampler)
    loss_src, active_src = _step(src, src_opt, 3)
    loss_dst, active_dst = _step(dst, dst_opt, 3)
    assert torch.equal(active_src, active_dst)
    assert loss_dst == pytest.approx(loss_src, rel=1e-5)


@pytest.mark.parametrize("size", [16, 5056], ids=["cuda", "cpu"])
def test_generator_state_of_an_older_checkpoint_derives_a_fill_stream(size, tmp_path, caplog):
    """A checkpoint of a revision whose samplers kept a generator (a CPU mt19937 state, 5,056 bytes, or a
    CUDA one, 16): the fill stream is derived from its bytes, the same on every load, and said so."""
    src, src_opt = _head("uniform")
    _step(src, src_opt, 0)
    ckpt.save_head_state(str(tmp_path / "t"), src, src_opt)
    path = ckpt.shard_file(str(tmp_path / "t"), 0, 1)
    state = torch.load(path, weights_only=True)
    state["head"]["_extra_state"]["sampler"] = {"generator": torch.arange(size).to(torch.uint8)}
    torch.save(state, path)
    draws, streams = [], []
    for _ in range(2):
        dst, dst_opt = _head("uniform")
        with caplog.at_level(logging.INFO, logger="ds_xc.sampling.fill"):
            ckpt.load_head_state(str(tmp_path / "t"), dst, dst_opt)
        streams.append(dst.sampler.fill.state_dict())
        draws.append(_step(dst, dst_opt, 1))
    assert "derived from it" in caplog.text
    assert streams[0] == streams[1] and streams[0]["draws"] == 0 and streams[0] != src.sampler.fill.state_dict()
    assert _same(draws[0], draws[1])


def test_reshard_gives_every_rank_a_fill_stream_of_its_own(tmp_path):
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "reshard.py")
    spec = importlib.util.spec_from_file_location("ds_xc_launch_reshard_device", path)
    reshard_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reshard_tool)
    src, src_opt = _head("uniform")
    _step(src, src_opt, 0)
    ckpt.save_head_state(str(tmp_path / "p1" / "t"), src, src_opt)
    (tmp_path / "p1" / "latest").write_text("t")
    reshard_tool.reshard(str(tmp_path / "p1"), str(tmp_path / "p2"), 2)
    fills = [ckpt.load_shard(str(tmp_path / "p2" / "t"), r)["head"]["_extra_state"]["sampler"]["fill"]
             for r in range(2)]
    assert fills[0]["stream"] != fills[1]["stream"] and fills[0]["seed"] == src.sampler.fill.seed
    heads = [_head("uniform")[0] for _ in range(2)]
    for r, head in enumerate(heads):
        head.sampler.load_state_dict({"fill": fills[r]})
    draws = [h.sampler.sample(torch.tensor([0]), None, h.weight).index for h in heads]
    assert not torch.equal(draws[0], draws[1])


def test_rng_file_is_read_to_cpu_and_extra_cuda_states_are_left(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(xc_rng, "world_rank_and_size", lambda: (0, 1))
    state = xc_rng.rng_state()
    state["cuda"] = [torch.full((16,), i, dtype=torch.uint8) for i in range(2)]  # saved on 2 GPUs
    path = xc_rng.rng_file(str(tmp_path))
    ckpt.atomic_save(state, path)
    seen, restored = [], []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append((i, s.device.type, int(s[0]))))
    with caplog.at_level(logging.WARNING, logger="ds_xc.engine"):
        xc_rng.apply_rng_state(xc_rng.read_rng_state(str(tmp_path)), str(tmp_path))
    assert seen == ["cpu"] and restored == [(0, "cpu", 0)]
    assert "CUDA RNG states of 2 device(s), this process sees 1" in caplog.text


# ---------------------------------------------------------------------- timeline with fake CUDA events
class _FakeEvent:
    """Stands in for torch.cuda.Event: done when ``_FakeEvent.done`` says so or once synchronised."""
    done = False
    syncs = 0

    def __init__(self, enable_timing=False):
        self._done = False

    def record(self):
        pass

    def query(self):
        return self._done or _FakeEvent.done

    def synchronize(self):
        _FakeEvent.syncs += int(not self.query())  # a wait that had to block
        self._done = True

    def elapsed_time(self, end):
        assert end.query(), "elapsed_time before the end event is done"  # end done: start done (one stream)
        return 2.0  # ms


class _Work:
    def wait(self):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    _FakeEvent.done, _FakeEvent.syncs = False, 0
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    device_syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: device_syncs.append(a))
    yield device_syncs
    assert not device_syncs, "the timeline synchronised the whole device"


def _gpu_step(tl, waits=2, read=False):
    tl.begin_step()
    tl.issued("gather", 1024)
    for _ in range(waits):
        tl.wait(_Work(), "gather")
    return tl.end_step(read=read)


def test_timeline_keeps_unread_gpu_steps_pending_and_resolves_on_read(fake_cuda):
    tl = Timeline(torch.device("cuda"))
    assert all(_gpu_step(tl) is None for _ in range(5))
    assert _FakeEvent.syncs == 0 and tl.steps == 5
    mean = tl.summary()  # the read: waits on the pending events
    assert _FakeEvent.syncs == 10 and mean["steps"] == 5
    assert mean["exposed_s"] == pytest.approx(0.004) and mean["exposed_gather_s"] == pytest.approx(0.004)
    assert mean["issued"] == 1 and tl.last["exposed_s"] == pytest.approx(0.004)
    assert _FakeEvent.syncs == 10


def test_timeline_resolves_finished_events_without_waiting(fake_cuda):
    tl = Timeline(torch.device("cuda"))
    _FakeEvent.done = True
    rec = _gpu_step(tl, waits=3)
    assert rec["exposed_s"] == pytest.approx(0.006) and rec["compute_s"] >= 0.0
    assert _FakeEvent.syncs == 0


def test_timeline_backlog_is_bounded_and_read_waits_for_one_step(fake_cuda):
    tl = Timeline(torch.device("cuda"), max_pending=3)
    for _ in range(5):
        _gpu_step(tl)
    assert _FakeEvent.syncs == 4  # the two oldest steps, two waits each
    rec = _gpu_step(tl, read=True)
    assert rec["exposed_s"] == pytest.approx(0.004) and _FakeEvent.syncs == 12  # everything resolved
    assert tl.summary()["steps"] == 6 and _FakeEvent.syncs == 12


def test_end_micro_step_waits_only_on_logged_steps(fake_cuda):
    tl = Timeline(torch.device("cuda"), max_pending=100)
    overlap = types.SimpleNamespace(log_every=2)
    xc = types.SimpleNamespace(schedule=types.SimpleNamespace(timeline=tl),
                               config=types.SimpleNamespace(extreme_classification=types.SimpleNamespace(overlap=overlap)))
    per_step = []
    for _ in range(4):
        tl.begin_step()
        tl.wait(_Work(), "reduce")
        before = _FakeEvent.syncs
        end_micro_step(xc)
        per_step.append(_FakeEvent.syncs - before)
    assert per_step == [0, 2, 0, 2]  # step 2 resolves steps 1-2, step 4 resolves 3-4


# ---------------------------------------------------------------------- on a GPU only
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["uniform", "knn", "ann"])
def test_cuda_head_moves_steps_and_checkpoints_cross(name, tmp_path):
    """Two CUDA heads agree (deterministic on the GPU); CPU and CUDA heads draw their fill from other
    generators (fill.py), so only the sizes are compared across them. A CUDA checkpoint resumes on
    the CPU and on CUDA, every tensor placed, the fill stream continuing from its counter."""
    cpu, cpu_opt = _head(name)
    gpu, gpu_opt = _head(name)
    gpu.cuda()
    twin, twin_opt = _head(name, device="cuda")
    for s in range(2):
        loss_c, act_c = _step(cpu, cpu_opt, s)
        loss_g, act_g = _step(gpu, gpu_opt, s)
        assert _same((loss_g, act_g), _step(twin, twin_opt, s))  # deterministic on the GPU
        assert act_c.numel() == act_g.numel()
    for key, value in _sampler_tensors(gpu.sampler).items():
        assert value.device.type == "cuda", key
    assert gpu.sampler.fill.device.type == "cuda"
    assert gpu_opt.state[gpu.weight]["exp_avg"].device.type == "cuda"
    ckpt.save_head_state(str(tmp_path / "g"), gpu, gpu_opt)
    _, expected = _step(twin, twin_opt, 2)  # uniform: what a resumed CUDA head must draw next
    for device in ("cpu", "cuda"):
        back, back_opt = _head(name, device=device)
        ckpt.load_head_state(str(tmp_path / "g"), back, back_opt)
        assert back_opt.state[back.weight]["exp_avg"].device.type == device
        assert all(v.device.type == device for v in _sampler_tensors(back.sampler).values())
        assert back.sampler.fill.state_dict() == gpu.sampler.fill.state_dict()
        _, act = _step(back, back_opt, 2)
        assert name != "uniform" or device == "cpu" or torch.equal(act, expected)
    back.cpu()  # and back again
    assert back.sampler.device.type == "cpu" and back.weight.device.type == "cpu"
