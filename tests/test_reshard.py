"""Resharding, exporting and damaged checkpoint files.

Train on 2 gloo ranks with XCEngine (23 classes: uneven shards at 2 and 3 ranks; lazy
AdamW with a uniform sampler, so optimizer rows differ), save, reshard 2 -> 3 -> 2 and
2 -> 1, resume: every class's weight and optimizer rows equal the saved ones exactly,
held-out top-1/top-5 equal, and training goes on. Exports equal the merged shards, and
truncated, tampered or malicious files fail with errors that name the file.
"""
import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ds_xc
from ds_xc.checkpoint import (CheckpointError, ShardRows, load_exported_head, load_exported_into_head,
                              load_file, load_head_state, load_shard, save_head_state, shard_file)
from ds_xc.evaluate import evaluate_topk
from ds_xc.head import ClassParallelHead, build_head_optimizer, shard_range

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C, D, IN, B, SEED, N_EVAL = 23, 6, 5, 4, 11, 24


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"ds_xc_launch_{name}", os.path.join(ROOT, "launch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reshard_tool, export_tool = _tool("reshard"), _tool("export")


def _config():
    return {
        "train_micro_batch_size_per_gpu": B, "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "extreme_classification": {
            "num_classes": C, "embedding_dim": D, "loss": {"type": "arcface", "scale": 8.0, "margin": 0.2},
            "sampler": {"type": "uniform", "sample_rate": 0.5}, "init_std": 0.5, "seed": SEED,
            "optimizer": {"type": "adamw", "lr": 0.05, "weight_decay": 0.01, "update": "lazy"}},
    }


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, IN, generator=g), torch.randint(0, C, (B,), generator=g)


def _held_out():
    g = torch.Generator().manual_seed(4242)
    return torch.randn(N_EVAL, IN, generator=g), torch.randint(0, C, (N_EVAL,), generator=g)


def _eval(embed, head, rank, world):
    x, y = _held_out()
    per = N_EVAL // world  # the same 24 samples, split over the ranks
    return evaluate_topk(embed, head, [(x[rank * per: (rank + 1) * per], y[rank * per: (rank + 1) * per])])


def _snapshot(xc, rank, world):
    opt = xc.head_optimizer.state_dict()["state"].get(0, {})
    return {"weight": xc.head.weight.detach().clone(), "opt": {k: v.clone() for k, v in opt.items()},
            "backbone": xc.engine.module.weight.detach().clone(), "eval": _eval(xc.engine, xc.head, rank, world)}


def _run(rank, world, load_dir, save_dir, steps, refused_dir=None):
    """Optionally try a checkpoint that must be refused, resume from ``load_dir``, train, save."""
    torch.manual_seed(SEED)
    body = torch.nn.Linear(IN, D, bias=False)
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9),
                          config=_config())
    out = {"refusal": None}
    if refused_dir:
        before = (xc.head.weight.detach().clone(), xc.engine.module.weight.detach().clone())
        try:
            xc.load_checkpoint(refused_dir)
        except RuntimeError as exc:
            out["refusal"] = str(exc)
        out["untouched"] = (torch.equal(before[0], xc.head.weight) and torch.equal(before[1], xc.engine.module.weight))
    start = xc.load_checkpoint(load_dir)["step"] if load_dir else 0
    out.update(loaded=_snapshot(xc, rank, world), start=start, losses=[])
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        loss = xc(x, y)
        xc.backward(loss)
        xc.step()
        out["losses"].append(loss.item())
    if save_dir:
        xc.save_checkpoint(save_dir, tag=f"step{start + steps}", client_state={"step": start + steps})
    out["final"] = _snapshot(xc, rank, world)
    return out


def _merged(results, part, key=None):
    """Concatenate per-rank tensors of a run in rank order (all classes in class order)."""
    return torch.cat([r[part]["weight"] if key is None else r[part]["opt"][key] for r in results])


def _tree_digest(folder):
    digest = hashlib.sha256()
    for d, _, files in sorted(os.walk(folder)):
        for f in sorted(files):
            digest.update(f.encode())
            with open(os.path.join(d, f), "rb") as fh:
                digest.update(fh.read())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def trained(pools, tmp_path_factory):
    """A 2-rank checkpoint after 3 steps, with each rank's state at save time."""
    path = str(tmp_path_factory.mktemp("reshard") / "p2")
    return path, pools(2).run(_run, None, path, 3)


def _check_resumed(new, old, world):
    for rank, r in enumerate(new):
        start, n = shard_range(C, world, rank)
        assert r["start"] == old[0]["start"] + len(old[0]["losses"])
        assert torch.equal(r["loaded"]["weight"], _merged(old, "final")[start: start + n])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(r["loaded"]["opt"][key], _merged(old, "final", key)[start: start + n])
        assert torch.equal(r["loaded"]["opt"]["step"], old[0]["final"]["opt"]["step"])
        assert torch.equal(r["loaded"]["backbone"], old[0]["final"]["backbone"])
        assert r["loaded"]["eval"] == old[0]["final"]["eval"]  # top-1, top-5, samples: same held-out set
        assert r["losses"] and all(math.isfinite(v) for v in r["losses"])
        assert not torch.equal(r["final"]["weight"], r["loaded"]["weight"])  # training went on


def test_reshard_2_to_3_to_2_resumes_exactly(pools, trained, tmp_path):
    src, res2 = trained
    assert res2[0]["final"]["opt"]["step"].item() == 3 and len(set(res2[0]["losses"])) == 3
    digest = _tree_digest(src)
    report = reshard_tool.reshard(src, str(tmp_path / "p3"), 3)
    assert _tree_digest(src) == digest  # the input is never modified
    assert report["old_world_size"] == 2 and any("exp_avg" in n for n in report["notes"])
    res3 = pools(3).run(_run, str(tmp_path / "p3"), str(tmp_path / "p3_more"), 2, src)
    for r in res3:  # the unresharded 2-rank checkpoint is refused through the engine, before any load
        assert "2 ranks" in r["refusal"] and "3 ranks" in r["refusal"] and "reshard" in r["refusal"]
        assert r["untouched"]
    _check_resumed(res3, res2, 3)

    env = dict(os.environ, OMP_NUM_THREADS="1")  # 3 -> 2 through the command line
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "reshard.py"), "--load_dir",
                           str(tmp_path / "p3_more"), "--world_size", "2", "--out_dir", str(tmp_path / "p2b")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "from 3 to 2 ranks" in proc.stdout and "--resume" in proc.stdout
    res2b = pools(2).run(_run, str(tmp_path / "p2b"), None, 1)
    _check_resumed(res2b, res3, 2)


def test_reshard_to_one_rank_and_export(trained, tmp_path):
    src, res2 = trained
    reshard_tool.reshard(src, str(tmp_path / "p1"), 1)
    rows = ShardRows(os.path.join(str(tmp_path / "p1"), "step3"))
    assert torch.equal(rows.rows(0, C), _merged(res2, "final"))
    state = load_shard(rows.tag_dir, 0)
    sampler = state["head"]["_extra_state"]["sampler"]
    assert state["head"]["_extra_state"]["weight_checksum"] is None and set(sampler) <= {"fill"}

    head = ClassParallelHead.from_config(_config()["extreme_classification"])  # one process, no group
    opt = build_head_optimizer(head, _config()["extreme_classification"]["optimizer"])
    load_head_state(rows.tag_dir, head, opt)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[head.weight][key], _merged(res2, "final", key))
    body = torch.nn.Linear(IN, D, bias=False)
    with torch.no_grad():
        body.weight.copy_(res2[0]["final"]["backbone"])
    assert _eval(body, head, 0, 1) == res2[0]["final"]["eval"]
    x, y = _batch(3, 0)
    loss = head(body(x), y)
    loss.backward()
    opt.step()
    assert math.isfinite(loss.item()) and opt.state[head.weight]["step"].item() == 4

    export_tool.export(os.path.join(src, "step3"), str(tmp_path / "head.pt"))
    export_tool.export(os.path.join(src, "step3"), str(tmp_path / "blocks"), max_shard_rows=5, fmt="pt")
    index = json.loads((tmp_path / "blocks" / "head.index.json").read_text())
    assert [(e["class_start"], e["num_rows"]) for e in index["files"]] == [(0, 5), (5, 5), (10, 5), (15, 5), (20, 3)]
    merged = _merged(res2, "final")
    assert torch.equal(load_exported_head(str(tmp_path / "head.pt")), merged)
    assert torch.equal(load_exported_head(str(tmp_path / "blocks")), merged)
    assert torch.equal(load_exported_head(str(tmp_path / "blocks"), 4, 13), merged[4:17])  # across blocks
    fresh = ClassParallelHead.from_config(_config()["extreme_classification"])
    load_exported_into_head(fresh, str(tmp_path / "blocks"))
    assert torch.equal(fresh.weight.detach(), merged)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return os.path.join(dst, "step3")


def test_damaged_and_malicious_files_name_the_file(trained, tmp_path):
    src, _ = trained
    tag = _copy(src, str(tmp_path / "trunc"))
    victim = shard_file(tag, 1, 2)
    data = open(victim, "rb").read()
    open(victim, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        reshard_tool.reshard(str(tmp_path / "trunc"), str(tmp_path / "out_trunc"), 3)
    assert not os.path.exists(tmp_path / "out_trunc" / "latest")  # nothing half-written is picked up

    tag = _copy(src, str(tmp_path / "shape"))
    victim = shard_file(tag, 0, 2)
    state = torch.load(victim, weights_only=True)
    state["head"]["weight"] = state["head"]["weight"][:10]
    torch.save(state, victim)
    with pytest.raises(CheckpointError, match=r"shard_00000_of_00002\.pt.*expected a tensor of shape \(12, 6\)"):
        load_shard(tag, 0)
    state["head"]["weight"], state["class_start"] = torch.zeros(12, D), 1
    torch.save(state, victim)
    with pytest.raises(CheckpointError, match=r"shard_00000_of_00002\.pt.*holds classes \[1, 13\)"):
        load_shard(tag, 0)

    marker = tmp_path / "code_ran"
    evil = str(tmp_path / "evil.pt")
    torch.save({"head": _Evil(str(marker))}, evil)
    with pytest.raises(CheckpointError, match="evil.pt"):
        load_file(evil, "head shard")
    assert not marker.exists()

    export_tool.export(os.path.join(src, "step3"), str(tmp_path / "blocks"), max_shard_rows=10, fmt="pt")
    block = str(tmp_path / "blocks" / "head-00001-of-00003.pt")
    data = open(block, "rb").read()
    open(block, "wb").write(data[:-40])
    with pytest.raises(CheckpointError, match="head-00001-of-00003.pt.*sha256"):
        load_exported_head(str(tmp_path / "blocks"))
    with pytest.raises(CheckpointError, match="head-00001-of-00003.pt"):
        load_exported_head(str(tmp_path / "blocks"), verify=False)
    (tmp_path / "meta").mkdir()
    tag = _copy(src, str(tmp_path / "meta" / "c"))
    open(os.path.join(tag, "ds_xc_head", "meta.json"), "w").write("{not json")
    with pytest.raises(CheckpointError, match="meta.json"):
        ShardRows(tag)


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_reshard_refusals_and_compression_reset(trained, tmp_path):
    src, _ = trained
    with pytest.raises(reshard_tool.ReshardError, match="input folder"):
        reshard_tool.reshard(src, src, 3)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(reshard_tool.ReshardError, match="not empty"):
        reshard_tool.reshard(src, str(tmp_path / "busy"), 3)

    tag = _copy(src, str(tmp_path / "comp"))
    for rank in range(2):  # per-rank residuals as ds_xc.compression.checkpoint writes them
        path = os.path.join(tag, "ds_xc_compression", f"rank_{rank:05d}_of_00002.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"format": 1, "world_size": 2, "rank": rank, "step": 7, "numels": [30],
                    "state": {0: {"residual": torch.full((30,), float(rank + 1))}}}, path)
    report = reshard_tool.reshard(str(tmp_path / "comp"), str(tmp_path / "comp3"), 3)
    assert any("residuals reset" in n for n in report["notes"])
    for rank in range(3):
        state = torch.load(os.path.join(str(tmp_path / "comp3"), "step3", "ds_xc_compression",
                                        f"rank_{rank:05d}_of_00003.pt"), weights_only=True)
        assert state["step"] == 7 and state["world_size"] == 2 and "state" not in state

    tag = _copy(src, str(tmp_path / "zero"))
    torch.save({}, os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    with pytest.raises(reshard_tool.ReshardError, match="ZeRO stage 1/2"):
        reshard_tool.reshard(str(tmp_path / "zero"), str(tmp_path / "zero3"), 3)
    assert not os.path.exists(tmp_path / "zero3" / "latest")


def test_one_rank_round_trip_continues_exactly(tmp_path):
    """1 -> 3 -> 1 in one process (exact head, SGD with momentum, dense): the resharded head
    and its momentum take the next step bit for bit like the head that never left."""
    section = dict(_config()["extreme_classification"], sampler={"type": "full"},
                   optimizer={"type": "sgd", "lr": 0.3, "momentum": 0.9, "update": "dense"})
    head = ClassParallelHead.from_config(section)
    opt = build_head_optimizer(head, section["optimizer"])
    body = torch.nn.Linear(IN, D, bias=False)

    def step(h, o, s):
        x, y = _batch(s, 0)
        loss = h(body(x), y)
        loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)
        return loss.item()

    for s in range(2):
        step(head, opt, s)
    save_head_state(str(tmp_path / "p1" / "t"), head, opt)
    (tmp_path / "p1" / "latest").write_text("t")
    reshard_tool.reshard(str(tmp_path / "p1"), str(tmp_path / "p3"), 3)
    sizes = [load_shard(str(tmp_path / "p3" / "t"), r)["num_local"] for r in range(3)]
    assert sizes == [8, 8, 7]
    reshard_tool.reshard(str(tmp_path / "p3"), str(tmp_path / "back"), 1)
    again = ClassParallelHead.from_config(section)
    opt2 = build_head_optimizer(again, section["optimizer"])
    load_head_state(str(tmp_path / "back" / "t"), again, opt2)
    assert torch.equal(opt2.state[again.weight]["momentum_buffer"], opt.state[head.weight]["momentum_buffer"])
    assert step(again, opt2, 2) == step(head, opt, 2)
    assert torch.equal(again.weight, head.weight)
