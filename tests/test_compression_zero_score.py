"""select_by update under ZeRO stage 1 (ds_xc/compression/zero_score.py): the score reads Adam's second
moment from snapshots of ZeRO-1's partitions.

On 2 and 3 gloo ranks (uneven batches, uneven partitions, gradient accumulation 2): with a snapshot
every step ZeRO-1 ranks exactly as ZeRO-0 (parameters and residuals equal) and not as |v|; with one
every 4 steps the snapshots are taken after Adam steps 1, 2 and 4 and equal the partitions' state
all-gathered in rank order; a checkpoint carries the snapshot, so an XCEngine resume between two
refreshes (after step 5, every 8) equals the uninterrupted run bit for bit."""
import pytest
import torch

from ds_xc.compression.zero_score import SNAPSHOT, SNAPSHOT_STEP

from tests.test_compression_zero import GAS, TOPK, _batch, _body, _engine, _loss, _run, _xc_config

UPDATE = dict(TOPK, select_by="update")


def _run_pair(rank, world, interval):
    out = {}
    for stage in (0, 1):
        out[stage] = _run(rank, world, stage, dict(UPDATE, score_sync_interval=interval), 5)
    out["magnitude"] = _run(rank, world, 1, dict(TOPK, select_by="magnitude"), 5)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_zero1_with_a_snapshot_every_step_ranks_as_zero0(pools, world):
    for r in pools(world).run(_run_pair, 1):
        for a, b in zip(r[0]["params"], r[1]["params"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r[1]["residual"], r[0]["residual"], rtol=1e-4, atol=1e-6)
        assert r[1]["zero"] == "DeepSpeedZeroOptimizer" and r[1]["compressed_steps"] == 5
        assert not torch.equal(r["magnitude"]["residual"], r[1]["residual"])  # |v| would have sent others


def _snapshots(rank, world, interval, steps=6):
    """Per optimizer step: the snapshot's Adam step and values (compressed tensors) after it, and this
    rank's partition state (exp_avg_sq per flat group, keyed by the Adam step count after the step)."""
    engine, opt = _engine(1, dict(TOPK, score_sync_interval=interval))  # select_by auto
    zero = engine.optimizer
    compressed = [opt._params[i] for i in opt.layout.sparse]
    offsets = []
    for p in compressed:
        i = next(k for k, g in enumerate(zero.bit16_groups) if any(q is p for q in g))
        offsets.append((i, (p.data_ptr() - zero.bit16_groups_flat[i].data_ptr()) // 4, p.numel()))
    taken, parts = [], {}
    for step in range(steps):
        for micro in range(GAS):
            x, t = _batch(step * GAS + micro, rank)
            engine.backward(_loss(engine(x), t))
            engine.step()
        st = [opt.state[p] for p in compressed]
        taken.append((st[0].get(SNAPSHOT_STEP), [s[SNAPSHOT].reshape(-1).clone() for s in st if SNAPSHOT in s]))
        adam = zero.optimizer.state[zero.single_partition_of_fp32_groups[0]]
        parts[int(adam["step"])] = [zero.optimizer.state[q]["exp_avg_sq"].clone()
                                    for q in zero.single_partition_of_fp32_groups]
    return {"taken": taken, "parts": parts, "offsets": offsets, "score": opt._update_score is not None,
            "bytes": opt.counter.bytes_sent}


@pytest.mark.parametrize("world", [2, 3])
def test_snapshots_follow_the_schedule_and_equal_the_gathered_partitions(pools, world):
    res = pools(world).run(_snapshots, 4)
    for r in res:
        assert r["score"]  # auto ranks by the update score under ZeRO-1 too
        # the reduction of optimizer step j reads the state after j Adam steps: due at 1, 2, 4 (interval 4)
        assert [s for s, _ in r["taken"]] == [None, 1, 2, 2, 4, 4]
        for s, values in r["taken"][1:]:
            full = [torch.cat([other["parts"][s][i] for other in res]) for i in range(len(r["parts"][s]))]
            want = [full[i][o: o + n] for i, o, n in r["offsets"]]
            assert len(values) == len(want)
            for got, ref in zip(values, want):
                assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(res[0]["taken"][-1][1], res[-1]["taken"][-1][1]))


def _xc(rank, world, path, phase, interval=8):
    import ds_xc
    body = _body()
    cfg = _xc_config(1)
    cfg["gradient_compression"] = dict(cfg["gradient_compression"], select_by="update", density=0.05,
                                       score_sync_interval=interval)
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.AdamW(body.parameters(), lr=0.05, weight_decay=0.01),
                          config=cfg)
    start, stop = {"straight": (0, 8), "save": (0, 5), "resume": (5, 8)}[phase]
    if phase == "resume":
        start = xc.load_checkpoint(path)["step"]
    losses, read = [], []
    source = xc.compression._update_score.optimizer  # the ZeroVariance the score divides by
    first = xc.compression._params[xc.compression.layout.sparse[0]]
    for step in range(start, stop):
        for micro in range(GAS):
            x, t = _batch(step * GAS + micro, rank)
            loss = xc.head(xc.engine(x), t.argmax(dim=1) * 4 + rank)
            xc.backward(loss)
            xc.step()
            losses.append(loss.item())
        snap = source.state.get(first, {})
        read.append((snap.get("step"), snap["exp_avg_sq"].clone() if snap else None))  # what this step ranked by
    if phase == "save":
        xc.save_checkpoint(path, client_state={"step": stop})
    return {"losses": losses, "params": [p.detach().clone() for p in xc.engine.module.parameters()],
            "residual": xc.compression._buffers["residual"].clone(), "read": read}


def test_a_resume_between_snapshots_equals_the_uninterrupted_run(pools, tmp_path):
    pool = pools(2)
    straight = pool.run(_xc, str(tmp_path), "straight")
    pool.run(_xc, str(tmp_path), "save")  # after 5 Adam steps: the snapshot of step 4, the next due at 8
    resumed = pool.run(_xc, str(tmp_path), "resume")
    for a, b in zip(straight, resumed):
        assert [s for s, _ in b["read"]] == [s for s, _ in a["read"][5:]] == [4, 4, 4]  # not re-gathered at 5
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a["read"][5:], b["read"]))
        assert b["losses"] == a["losses"][5 * GAS:]
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        assert torch.equal(a["residual"], b["residual"])


def test_the_memory_model_counts_the_snapshot_under_zero1():
    from ds_xc.cost.memory import estimate_memory
    raw = {"train_micro_batch_size_per_gpu": 8, "extreme_classification": {"num_classes": 100, "embedding_dim": 8},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "gradient_compression": {"method": "topk"}}
    got = {}
    for stage, select in ((0, "auto"), (1, "auto"), (1, "magnitude")):
        cfg = dict(raw, zero_optimization={"stage": stage},
                   gradient_compression={"method": "topk", "select_by": select})
        got[stage, select] = estimate_memory(cfg, world_size=2, backbone_params=1000).persistent["compression"]
    assert got[0, "auto"] == got[1, "magnitude"] == 8 * 1000  # residual + velocity
    assert got[1, "auto"] == 12 * 1000  # + the fp32 snapshot of v-hat
