"""Agreement before collectives (ds_xc.parallel.agree) on 2 and 3 gloo ranks, without DeepSpeed.

* ``agree``: equal values pass; a value that differs on one rank raises DisagreementError on
  every rank listing rank -> value (for dicts: the keys that differ); on a subgroup the
  ranks are named by their global rank. ``all_or_none``: a rank that raises makes every rank
  raise, the same class, naming that rank and its message.
* ``evaluate_topk``: another ``ks``, one more held-out batch, or a data error on one rank is an
  error on every rank (names the ranks and values), not a hang; the agreed path still gives
  the top-k of a float64 reference.
* ``load_exported_into_head``: a missing export on one rank, or an export of another class
  count, raises on every rank and leaves every rank's head unchanged.
* Compression state: a corrupt residual file on one rank raises CheckpointError naming the
  file on that rank and naming that rank on the others; a file of another step on one rank
  is a disagreement; in both nothing (residuals, step) changes on any rank.

After each provoked error the group runs one more all-reduce: nobody is left in a collective.
"""
import os

import pytest
import torch
import torch.distributed as dist

from ds_xc.checkpoint import CheckpointError, load_exported_into_head
from ds_xc.evaluate import evaluate_topk
from ds_xc.head import ClassParallelHead
from ds_xc.parallel.agree import agree, all_or_none
from tests.dist_pool import catch

C, D = 23, 6


def _usable(group=None) -> float:
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


_catch = catch


# ---------------------------------------------------------------------- the helper
def _agree_cases(rank, world):
    out = {"same": agree(("step3", 4), "the tag", None)}
    out["scalar"] = _catch(lambda: agree("step4" if rank == 1 else "step3", "the checkpoint tag", None))
    cfg = {"a": {"lr": 0.1 * (2 if rank == world - 1 else 1), "k": 5}, "b": [1, 2]}
    out["dict"] = _catch(lambda: agree(cfg, "the config", None))
    out["reordered"] = agree({"x": 1, "y": 2} if rank else {"y": 2, "x": 1}, "a dict", None) == {"x": 1, "y": 2}

    def fail_on_last():
        with all_or_none("reading my file", None):
            if rank == world - 1:
                raise CheckpointError(f"cannot read file_{rank}.pt")
    out["outcome"] = _catch(fail_on_last)
    sub = dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        out["sub"] = _catch(lambda: agree(rank, "the rank", sub))
        out["sub_ok"] = _usable(sub)
    out["usable"] = _usable()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_agree_and_all_or_none_raise_on_every_rank(pools, world):
    res = pools(world).run(_agree_cases)
    last = world - 1
    for rank, r in enumerate(res):
        assert r["same"] == ("step3", 4) and r["reordered"] and r["usable"] == world
        kind, msg = r["scalar"]
        assert kind == "DisagreementError"
        assert "ranks disagree on the checkpoint tag: rank 0: 'step3', rank 1: 'step4'" in msg
        assert f"(this is rank {rank}; nothing was run)" in msg
        kind, msg = r["dict"]
        assert kind == "DisagreementError" and "a.lr (rank 0: 0.1" in msg and f"rank {last}: 0.2" in msg
        assert "a.k" not in msg and "b (" not in msg  # only the keys that differ
        kind, msg = r["outcome"]
        assert kind == "CheckpointError"  # the same class on every rank
        if rank == last:
            assert msg == f"cannot read file_{last}.pt"
        else:
            assert f"reading my file failed on rank(s) [{last}]: rank {last}: CheckpointError: cannot read " \
                   f"file_{last}.pt (this is rank {rank}" in msg
        if rank in (0, last):
            kind, msg = r["sub"]
            assert f"rank 0: 0, rank {last}: {last}" in msg  # global ranks
            assert r["sub_ok"] == 2


# ---------------------------------------------------------------------- evaluation
def _eval_data(world):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(world * 4 * 3, D, generator=g)
    y = torch.randint(0, C, (x.shape[0],), generator=g)
    return x, y


def _batches(x, y, rank, world, n):
    per = 4
    return [(x[(b * world + rank) * per: (b * world + rank + 1) * per],
             y[(b * world + rank) * per: (b * world + rank + 1) * per]) for b in range(n)]


def _eval_cases(rank, world):
    head = ClassParallelHead(D, C, loss={"type": "cosface", "scale": 8.0, "margin": 0.2}, init_std=0.5, seed=3)
    w0 = head.weight.detach().clone()
    x, y = _eval_data(world)
    ident = torch.nn.Identity()
    out = {"ok": evaluate_topk(ident, head, _batches(x, y, rank, world, 3), ks=(1, 3))}
    out["ks"] = _catch(lambda: evaluate_topk(ident, head, _batches(x, y, rank, world, 3),
                                             ks=(1, 5) if rank == 1 else (1, 3)))
    out["count"] = _catch(lambda: evaluate_topk(ident, head, _batches(x, y, rank, world, 2 + (rank == 1))))

    def bad_data():
        for b, item in enumerate(_batches(x, y, rank, world, 3)):
            if b == 1 and rank == 0:
                raise OSError("held-out shard 1 unreadable")
            yield item
    out["data"] = _catch(lambda: evaluate_topk(ident, head, bad_data()))
    out["bad_ks"] = _catch(lambda: evaluate_topk(ident, head, [], ks=(0,) if rank == 1 else (1,)))
    out["unchanged"] = torch.equal(w0, head.weight.detach())
    out["usable"] = _usable()
    return out


def test_evaluate_topk_agrees_on_ks_batches_and_errors(pools):
    world = 2
    res = pools(world).run(_eval_cases)
    x, y = _eval_data(world)
    from ds_xc.head import init_shard
    w = torch.nn.functional.normalize(init_shard(C, D, 0, C, 0.5, 3, torch.float64), dim=1)
    top = (torch.nn.functional.normalize(x.double(), dim=1) @ w.t()).topk(3, dim=1).indices
    ref1 = (top[:, 0] == y).double().mean().item()
    ref3 = (top == y[:, None]).any(1).double().mean().item()
    for rank, r in enumerate(res):
        assert r["ok"]["samples"] == x.shape[0]
        assert r["ok"]["top1"] == pytest.approx(ref1) and r["ok"]["top3"] == pytest.approx(ref3)
        assert r["ks"][0] == "DisagreementError" and "evaluate_topk ks: rank 0: (1, 3), rank 1: (1, 5)" in r["ks"][1]
        assert r["count"][0] == "DisagreementError"
        assert "rank 0: 'end after 2 batches', rank 1: 'batch 2'" in r["count"][1]
        assert "every rank must iterate the same number" in r["count"][1]
        assert r["data"][0] == "OSError"
        assert ("held-out shard 1 unreadable" if rank == 0 else "reading and embedding held-out batch 1 failed on "
                "rank(s) [0]: rank 0: OSError: held-out shard 1 unreadable") in r["data"][1]
        assert r["bad_ks"][0] == "ValueError" and "ks=(0,)" in r["bad_ks"][1]
        assert r["unchanged"] and r["usable"] == world


# ---------------------------------------------------------------------- exported heads
def _export_cases(rank, world, folder):
    from ds_xc.checkpoint import save_head_state
    from launch.export import export
    src = ClassParallelHead(D, C, init_std=0.5, seed=7)
    save_head_state(os.path.join(folder, "ckpt"), src)  # every rank its shard of one checkpoint
    dist.barrier()
    if rank == 0:
        export(os.path.join(folder, "ckpt"), os.path.join(folder, "head.pt"), fmt="pt")
    out = {}
    dist.barrier()
    head = ClassParallelHead(D, C, init_std=0.1, seed=9)
    w0 = head.weight.detach().clone()
    missing = os.path.join(folder, "head.pt" if rank == 0 else "nowhere.pt")
    out["missing"] = _catch(lambda: load_exported_into_head(head, missing))
    out["missing_unchanged"] = torch.equal(w0, head.weight.detach())
    other = ClassParallelHead(D, C + 1, init_std=0.1, seed=9)
    w1 = other.weight.detach().clone()
    out["classes"] = _catch(lambda: load_exported_into_head(other, os.path.join(folder, "head.pt")))
    out["classes_unchanged"] = torch.equal(w1, other.weight.detach())
    load_exported_into_head(head, os.path.join(folder, "head.pt"))
    out["loaded"] = torch.equal(head.weight.detach(), src.weight.detach())
    out["usable"] = _usable()
    return out


def test_load_exported_into_head_agrees(pools, tmp_path):
    world = 3
    res = pools(world).run(_export_cases, str(tmp_path))
    for rank, r in enumerate(res):
        assert r["missing"][0] == "FileNotFoundError" and r["missing_unchanged"]
        if rank == 0:
            assert "failed on rank(s) [1, 2]" in r["missing"][1] and "nowhere.pt" in r["missing"][1]
        else:
            assert "nowhere.pt" in r["missing"][1] and "does not exist" in r["missing"][1]
        assert r["classes"][0] == "CheckpointError" and r["classes_unchanged"]
        assert f"holds {C} classes x {D}; this head has num_classes={C + 1}, embedding_dim={D}" in r["classes"][1]
        assert r["loaded"] and r["usable"] == world


# ---------------------------------------------------------------------- compression state
def _compression_cases(rank, world, folder):
    from ds_xc.compression import CompressedOptimizer
    from ds_xc.compression.checkpoint import compression_file, load_compression_state, save_compression_state
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4, bias=False)
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              {"method": "topk", "density": 0.25, "min_numel": 8}, group=None)

    def step(seed):
        g = torch.Generator().manual_seed(seed * 10 + rank)
        model(torch.randn(3, 16, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    step(0)
    save_compression_state(folder, opt)  # step 1
    step(1)
    os.makedirs(os.path.join(folder, "later"), exist_ok=True)
    save_compression_state(os.path.join(folder, "later"), opt)  # step 2
    snapshot = {k: v.clone() for k, v in opt._buffers.items()}
    out = {"step": opt._step}
    path = compression_file(folder, rank, world)
    dist.barrier()
    if rank == 1:
        with open(path, "r+b") as fh:  # cut it in half
            fh.truncate(os.path.getsize(path) // 2)
    dist.barrier()
    out["corrupt"] = _catch(lambda: load_compression_state(folder, opt))
    if rank == 1:  # rank 1 gets a file of another step
        os.replace(compression_file(os.path.join(folder, "later"), rank, world), path)
    dist.barrier()
    out["stale"] = _catch(lambda: load_compression_state(folder, opt))
    out["unchanged"] = opt._step == 2 and all(torch.equal(snapshot[k], opt._buffers[k]) for k in snapshot)
    out["path"] = compression_file(folder, 1, world)
    out["usable"] = _usable()
    return out


def test_compression_state_load_agrees(pools, tmp_path):
    res = pools(2).run(_compression_cases, str(tmp_path))
    bad = res[0]["path"]
    for rank, r in enumerate(res):
        assert r["step"] == 2 and r["unchanged"] and r["usable"] == 2
        kind, msg = r["corrupt"]
        assert kind == "CheckpointError" and f"cannot read compression state file {bad!r}" in msg
        if rank == 0:
            assert "failed on rank(s) [1]" in msg
        kind, msg = r["stale"]
        assert kind == "DisagreementError"
        assert "rank 0: ('own', 1), rank 1: ('own', 2)" in msg


# ---------------------------------------------------------------------- single-process tools
@pytest.mark.parametrize("tool", ["export", "reshard"])
def test_file_tools_refuse_to_run_on_several_ranks(monkeypatch, tmp_path, tool):
    """launch/export.py and launch/reshard.py run no collectives; under a launcher every rank would
    write the same files, so they stop before reading anything."""
    import importlib
    module = importlib.import_module(f"launch.{tool}")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--load_dir", str(tmp_path / "none"), "--out" if tool == "export" else "--out_dir", str(tmp_path / "o")]
    argv += ["--world_size", "3"] if tool == "reshard" else []
    with pytest.raises(SystemExit, match=f"{tool}: WORLD_SIZE=2: this is a single-process tool"):
        module.main(argv)
    assert not (tmp_path / "o").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="does not exist"):  # one process: it runs (and finds no checkpoint)
        module.main(argv)


def test_fingerprint_ignores_dict_order_and_addresses_but_not_values():
    from ds_xc.parallel.agree import fingerprint
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"f": object()}) == fingerprint({"f": object()})  # no address in the fingerprint
    assert fingerprint(("step3", 4)) != fingerprint(("step3", 5)) != fingerprint(["step3", 4])
    assert fingerprint(torch.zeros(2, 3)) == fingerprint(torch.ones(2, 3))  # tensors: shape and dtype only
    assert fingerprint(torch.zeros(2, 3)) != fingerprint(torch.zeros(3, 2))
    assert agree({"x": 1}, "a value", None) == {"x": 1}  # one process: returns at once


def test_comm_device_follows_the_groups_backend(monkeypatch):
    """Bookkeeping tensors of a collective go where the backend takes them: NCCL alone -> the current
    GPU (a CPU tensor there fails: "No backend type associated with device type cpu", seen on the
    H200 in the main job's summary), gloo or a mixed cpu:gloo,cuda:nccl group -> the CPU."""
    from ds_xc.parallel import groups
    assert groups.comm_device(None) == torch.device("cpu")  # no process group: one process
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, want in (("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu")),
                          ("cpu:gloo,cuda:nccl", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        monkeypatch.setattr(groups, "resolve_group", lambda group=None: group)
        assert groups.comm_device("a group") == want, backend
