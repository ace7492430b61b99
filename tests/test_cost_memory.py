"""ds_xc.cost.memory: the persistent components of the model equal the nbytes of the tensors a real
head, head optimizer and sampler hold after training steps, on 1 and 3 ranks (uneven shards:
num_classes % 3 != 0, every rank checked), for full / uniform / ann / knn samplers, sgd / adamw,
dense / lazy / lazy_exact updates; bad arguments raise ValueError naming the argument."""
from __future__ import annotations

import pytest
import torch

from ds_xc.config import ConfigError
from ds_xc.cost import estimate_memory

C, D, B = 1001, 24, 7  # classes (1001 % 3 = 2: ranks 0 and 1 hold one more), dim, rows per rank
STEPS = 3

CONFIGS = {
    "full-sgd-dense": ({"type": "full"}, {"type": "sgd", "update": "dense"}, "softmax", "float32"),
    "uniform-adamw-lazy_exact": ({"type": "uniform", "sample_rate": 0.1}, {"type": "adamw", "update": "lazy_exact"},
                                 "cosface", "float32"),
    "uniform-sgd-lazy-f64": ({"type": "uniform", "sample_rate": 0.2}, {"type": "sgd", "update": "lazy"}, "softmax",
                             "float64"),
    "ann-sgd-lazy_exact": ({"type": "ann", "sample_rate": 0.05, "code_bits": 64, "top_k": 8, "rerank": 16,
                            "scan_rows": 64}, {"type": "sgd", "update": "lazy_exact"}, "softmax", "float32"),
    "ann-adamw-dense": ({"type": "ann", "sample_rate": 0.1, "code_bits": 128, "nlist": 7, "top_k": 4},
                        {"type": "adamw", "update": "dense"}, "arcface", "float32"),
    "ann-sgd-bf16-lazy": ({"type": "ann", "sample_rate": 0.1, "code_bits": 32, "top_k": 4},
                          {"type": "sgd", "update": "lazy", "bf16_update": "master_fp32"}, "cosface", "bfloat16"),
    "knn-adamw-lazy_exact": ({"type": "knn", "sample_rate": 0.1, "neighbors": 5},
                             {"type": "adamw", "update": "lazy_exact"}, "cosface", "float32"),
}


def _ds_config(name: str) -> dict:
    sampler, opt, loss, dtype = CONFIGS[name]
    return {"train_micro_batch_size_per_gpu": B,
            "extreme_classification": {"num_classes": C, "embedding_dim": D, "sampler": sampler, "loss": {"type": loss},
                                       "optimizer": opt, "dtype": dtype, "chunk_size": 5}}


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _measure(rank: int, world: int, name: str) -> dict:
    """Train STEPS steps of a real head on this rank, then the bytes each component holds."""
    from ds_xc.head import ClassParallelHead, build_head_optimizer
    from ds_xc.head.lazy_exact import LAST, SUFFIX
    raw = _ds_config(name)
    head = ClassParallelHead.from_config(raw["extreme_classification"])
    opt = build_head_optimizer(head, raw["extreme_classification"]["optimizer"])
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(B, D, generator=gen, requires_grad=True)
        y = torch.randint(0, C, (B,), generator=gen)
        head(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = opt.state[head.weight]
    out = {"head_weight": _nbytes(head.weight),
           "head_optimizer": _nbytes(*(v for k, v in state.items() if k not in (LAST, SUFFIX, "_spare"))),
           "lazy_exact": _nbytes(state.get(LAST), state.get(SUFFIX), state.get("_spare")),
           "num_local": head.num_local,
           "head_workspace": head.workspace.kept_bytes()}
    index = getattr(head.sampler, "index", None)
    if index is not None:
        out["ann_index"] = _nbytes(index.projection, index.centroids, index.list_offsets, index.list_ids,
                                   index.list_codes, index.position, index.encoded_from, index.radius)
        out["last_retrieved"] = _nbytes(head.sampler.last_retrieved)
        out["dirty"] = _nbytes(*head.sampler.dirty)
    if getattr(head.sampler, "graph", None) is not None:
        out["knn_graph"] = _nbytes(head.sampler.graph)
    return out


def _check(name: str, world: int, measured: list) -> None:
    raw = _ds_config(name)
    for rank, got in enumerate(measured):
        est = estimate_memory(raw, world_size=world, rank=rank, steps=STEPS)
        p = est.persistent
        assert got["num_local"] == C // world + (rank < C % world)
        assert p["head_weight"] == got["head_weight"], (name, rank)
        assert p["head_optimizer"] == got["head_optimizer"], (name, rank)
        assert p.get("lazy_exact", 0) == got["lazy_exact"], (name, rank)
        assert p.get("ann_index", 0) == got.get("ann_index", 0), (name, rank)
        assert p.get("knn_graph", 0) == got.get("knn_graph", 0), (name, rank)
        assert p["head_workspace"] == got["head_workspace"], (name, rank)
        if "last_retrieved" in got:  # the last retrieval exactly; the rows to re-encode at most the bound
            top_k = raw["extreme_classification"]["sampler"]["top_k"]
            assert got["last_retrieved"] == 8 * B * world * min(top_k, got["num_local"])
            assert got["last_retrieved"] + got["dirty"] <= p["sampler_buffers"]
        assert est.peak_bytes > est.persistent_bytes


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_persistent_components_match_tensors_one_rank(name):
    import torch.distributed as dist
    assert not dist.is_initialized()
    _check(name, 1, [_measure(0, 1, name)])


@pytest.mark.parametrize("name", ["ann-sgd-lazy_exact", "uniform-adamw-lazy_exact", "full-sgd-dense",
                                  "knn-adamw-lazy_exact", "ann-adamw-dense"])
def test_persistent_components_match_tensors_three_ranks(pools, name):
    _check(name, 3, pools(3).run(_measure, name))


def test_backbone_adamw_zero0_matches_torch_tensors():
    """fp32 ZeRO 0 with a torch AdamW (what DeepSpeed steps at stage 0): params + grads + 2 moments."""
    model = torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.GELU(), torch.nn.Linear(17, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 13)).sum().backward()
    opt.step()
    params = sum(p.numel() for p in model.parameters())
    tensors = _nbytes(*model.parameters()) + _nbytes(*(p.grad for p in model.parameters()))
    tensors += sum(_nbytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")
    raw = dict(_ds_config("full-sgd-dense"), optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    p = estimate_memory(raw, world_size=1, backbone_params=params).persistent
    assert p["backbone_params"] + p["backbone_grads"] + p["backbone_optimizer"] == tensors


def test_phases_scale_with_the_config():
    raw = _ds_config("ann-sgd-lazy_exact")
    small = estimate_memory(raw, world_size=4, num_classes=10**6, baseline_bytes=123)
    big = estimate_memory(raw, world_size=4, num_classes=10**7)
    assert small.persistent["baseline"] == 123
    assert 9.5 < big.persistent["head_weight"] / small.persistent["head_weight"] <= 10.0
    assert set(big.phases) >= {"train_forward", "optimizer_step", "ann_search", "index_rebuild", "catch_up",
                               "evaluation"}
    assert big.peak_bytes == big.persistent_bytes + max(big.phases.values())
    # rank 0 of an uneven split holds one more class
    r0 = estimate_memory(raw, world_size=3, rank=0, num_classes=10**4 + 1)
    r2 = estimate_memory(raw, world_size=3, rank=2, num_classes=10**4 + 1)
    assert r0.persistent["head_weight"] - r2.persistent["head_weight"] == D * 4


@pytest.mark.parametrize("kwargs, field", [
    (dict(world_size=0), "world_size"), (dict(world_size=2, rank=2), "rank"), (dict(world_size=2, rank=-1), "rank"),
    (dict(world_size=1, num_classes=1), "num_classes"), (dict(world_size=1, global_batch=-3), "global_batch"),
    (dict(world_size=1, backbone_params=-1), "backbone_params"), (dict(world_size=1, baseline_bytes=1.5),
                                                                   "baseline_bytes"),
    (dict(world_size=2000), "num_classes"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        estimate_memory(_ds_config("full-sgd-dense"), **kwargs)


def test_global_batch_defaults_to_the_micro_batch_times_the_ranks():
    raw = _ds_config("ann-sgd-lazy_exact")
    given = estimate_memory(raw, world_size=3, global_batch=3 * B)
    assert estimate_memory(raw, world_size=3) == given
    del raw["train_micro_batch_size_per_gpu"]
    raw.update(train_batch_size=6 * B, gradient_accumulation_steps=2)  # micro = 6 B / (2 x 3) = B
    assert estimate_memory(raw, world_size=3) == given
    bigger = estimate_memory(raw, world_size=3, global_batch=6 * B)
    assert bigger.phases["train_forward"] > given.phases["train_forward"]


def test_bad_config_names_the_key():
    raw = _ds_config("full-sgd-dense")
    raw["extreme_classification"]["sampler"] = {"type": "ann", "code_bits": 33}
    with pytest.raises(ConfigError, match="code_bits"):
        estimate_memory(raw, world_size=1)
    with pytest.raises(ValueError, match="extreme_classification"):
        estimate_memory({"train_micro_batch_size_per_gpu": 4}, world_size=1)
