"""XCEngine.forward_backward with the overlap pipeline inside a DeepSpeed engine (2 and 3 gloo
ranks): after one optimizer step (with gradient accumulation) every head shard and the
backbone moved exactly as the float64 single-process reference says; refused settings
name their keys."""
import pytest
import torch

import ds_xc
from ds_xc.engine import check_supported
from ds_xc.head import shard_range
from tests.test_engine import LR_BODY, LR_HEAD, _backbone, _batch, _config, check_one_step_against_reference

C, D = 23, 6


def _overlap_config(stage, gas, num_chunks, chunk_backbone, reduce, bf16=False):
    cfg = _config(stage, gas, bf16=bf16)
    cfg["extreme_classification"]["overlap"] = {"enabled": True, "num_chunks": num_chunks,
                                                "chunk_backbone": chunk_backbone, "overlap_grad_reduce": reduce,
                                                "bucket_size_mb": 1e-5}
    return cfg


def _one_step(rank, world, gas, num_chunks, chunk_backbone, reduce, stage=0):
    body = _backbone()
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=LR_BODY),
                          config=_overlap_config(stage, gas, num_chunks, chunk_backbone, reduce))
    losses = []
    for micro in range(gas):
        x, y = _batch(micro, rank)
        losses.append(xc.forward_backward(x, y).item())
        xc.step()
    stats = xc.overlap_stats()
    return {"w1": xc.head.weight.detach().clone(), "a1": xc.engine.module.weight.detach().clone(),
            "losses": losses, "steps": xc.global_steps, "timeline": stats["mean"],
            "allreduce_on": xc.engine.enable_backward_allreduce}


@pytest.mark.parametrize("world,gas,num_chunks,chunk_backbone,reduce,stage", [
    (2, 1, 2, True, True, 0), (2, 2, 4, True, True, 0), (3, 2, 2, False, True, 0), (3, 1, 3, True, False, 0),
    (2, 2, 2, False, False, 0), (2, 2, 2, False, False, 2)])
def test_overlapped_engine_step_matches_reference(pools, world, gas, num_chunks, chunk_backbone, reduce, stage):
    """ZeRO 2 (the engine reduces): only the head's communication is overlapped."""
    res = pools(world).run(_one_step, gas, num_chunks, chunk_backbone, reduce, stage)
    a0, w0 = check_one_step_against_reference(res, world, gas)
    for rank, r in enumerate(res):
        start, n = shard_range(C, world, rank)
        expected = w0.detach()[start: start + n] - LR_HEAD * w0.grad[start: start + n]
        torch.testing.assert_close(r["w1"].double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["a1"].double(), a0.detach() - LR_BODY * a0.grad, rtol=1e-5, atol=1e-6)
        assert r["timeline"]["steps"] == gas and r["timeline"]["issued"] > 0
        assert r["allreduce_on"] == (not reduce)  # the bucketed reducer replaced the engine's all-reduce


@pytest.mark.parametrize("key,value,stage,bf16", [("chunk_backbone", True, 0, True),
                                                  ("overlap_grad_reduce", True, 1, False)])
def test_refused_settings_name_their_keys(key, value, stage, bf16):
    cfg = _overlap_config(stage, 1, 2, chunk_backbone=key == "chunk_backbone", reduce=key != "chunk_backbone",
                          bf16=bf16)
    with pytest.raises(ds_xc.ConfigError, match=f"overlap.{key}=true"):
        check_supported(cfg)


def _compressed_steps(rank, world, overlap):
    body = _backbone()
    cfg = _config(0, 2)
    cfg["gradient_compression"] = {"method": "topk", "density": 0.3, "min_numel": 1, "warmup_steps": 1}
    if overlap:
        cfg["extreme_classification"]["overlap"] = {"enabled": True, "num_chunks": 2, "bucket_size_mb": 1e-5}
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=LR_BODY), config=cfg)
    losses = []
    for micro in range(6):  # 3 optimizer steps: one dense warm-up, two compressed
        x, y = _batch(micro, rank)
        losses.append(xc.forward_backward(x, y).item())
        xc.step()
    return {"a": xc.engine.module.weight.detach().clone(), "w": xc.head.weight.detach().clone(), "losses": losses,
            "compressed": xc.compression.stats()["compressed_steps"],
            "residual": xc.compression._buffers["residual"].clone()}


@pytest.mark.parametrize("world", [2, 3])
def test_overlap_with_gradient_compression_equals_serial(pools, world):
    """The compressed reduction from hooks inside the engine == the wrapper's step() reduction."""
    serial = pools(world).run(_compressed_steps, False)
    overlapped = pools(world).run(_compressed_steps, True)
    for s, o in zip(serial, overlapped):
        assert s["compressed"] == o["compressed"] == 2
        assert s["losses"] == pytest.approx(o["losses"], rel=1e-6)
        torch.testing.assert_close(o["a"], s["a"], rtol=1e-5, atol=1e-6)  # float32, other summation order
        torch.testing.assert_close(o["w"], s["w"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o["residual"], s["residual"], rtol=1e-4, atol=1e-5)
        assert s["residual"].abs().sum() > 0
