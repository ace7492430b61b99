"""Saves and resumes that used to lose data, half-load or change a setting silently (issue 59), on 2 gloo ranks.

* A resume with an edited head config: a sampler type whose saved state has another layout
  (full -> ann) or another head optimizer (sgd -> adamw) is refused on every rank, listing what
  differs, before DeepSpeed loads anything (backbone, step, head unchanged); changed momentum,
  weight decay and lr load and are *used* (one step equals a float64 SGD step with the new
  values), and the log names each change; changed ANN options drop the saved index.
* Saving: a tag another job is saving (its lock held by a live process) is refused naming the
  holder, nothing written; a lock whose process is gone is taken over; a live job's staging
  folder of another tag survives the cleanup. A save inside a gradient-accumulation window is
  refused; a tag over 200 characters (or with a '/' or a space) is refused naming the limit.
* Loading a checkpoint on a read-only folder (a read-only bind mount where the test may mount,
  else chmod) works on 2 ranks and writes nothing (the folder's mtime and listing unchanged).
* launch/export.py checks the checksum manifest (a bit-flipped shard is refused, nothing
  written) and says to ``pip install safetensors`` before any work when the package is missing.
"""
import importlib.util
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import ds_xc
from tests.dist_pool import catch
from tests.test_reliability import ANN, Body, _batch, _config, _state, _assert_same, SEED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGD = {"type": "sgd", "lr": 0.5, "momentum": 0.9, "update": "dense", "lr_schedule": "constant"}


def _cfg(sampler=None, opt=None, weight_decay=0.01, gas=1):
    cfg = _config(sampler=sampler or {"type": "full"}, opt=dict(opt or SGD), gas=gas)
    cfg["extreme_classification"]["optimizer"]["weight_decay"] = weight_decay
    return cfg


def _engine(rank, cfg):
    torch.manual_seed(SEED)
    body = Body()
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9), config=cfg)
    torch.manual_seed(SEED + 100 * rank)
    return xc


def _steps(xc, rank, start, stop, gas=1):
    for step in range(start, stop):
        for m in range(gas):
            x, y = _batch(step * gas + m, rank)
            xc.forward_backward(x, y)
            xc.step()


def _save(rank, world, folder, sampler=None):
    xc = _engine(rank, _cfg(sampler))
    _steps(xc, rank, 0, 2)
    xc.save_checkpoint(folder, tag="step2", client_state={"step": 2})


class _Logs(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


# ---------------------------------------------------------------------- edited head config
def _resume_edited(rank, world, folder):
    out = {}
    for name, cfg in {"ann": _cfg(ANN), "adamw": _cfg(opt={"type": "adamw", "lr": 0.05}),
                      "both": _cfg(ANN, opt={"type": "adamw", "lr": 0.05})}.items():
        xc = _engine(rank, cfg)
        before = _state(xc)
        out[name] = catch(lambda: xc.load_checkpoint(folder))
        out[name + "_untouched"] = xc.global_steps == 0  # DeepSpeed loaded nothing (step, backbone)
        _assert_same(before, _state(xc))
    logs = _Logs()
    logging.getLogger("ds_xc.engine.checkpointing").addHandler(logs)
    try:
        xc = _engine(rank, _cfg(opt=dict(SGD, lr=0.2, momentum=0.5), weight_decay=0.0))
        out["loaded"] = xc.load_checkpoint(folder)["step"]
    finally:
        logging.getLogger("ds_xc.engine.checkpointing").removeHandler(logs)
    out["logs"] = logs.lines
    group = xc.head_optimizer.param_groups[0]
    out["group"] = {k: group[k] for k in ("lr", "momentum", "weight_decay")}
    w0 = xc.head.weight.detach().double().clone()
    buf0 = xc.head_optimizer.state[xc.head.weight]["momentum_buffer"].double().clone()
    x, y = _batch(2, rank)
    xc.forward_backward(x, y)
    g = xc.head.weight.grad.detach().double().clone()  # (L, d) dense: the full sampler, dense update
    xc.step()
    buf = 0.5 * buf0 + g  # torch.optim.SGD with the new momentum 0.5 and weight decay 0, float64
    out["step_error"] = float((xc.head.weight.detach().double() - (w0 - 0.2 * buf)).abs().max())
    out["old_values_error"] = float((w0 - 0.5 * (0.9 * buf0 + g + 0.01 * w0) - (w0 - 0.2 * buf)).abs().max())
    return out


def test_resume_with_an_edited_head_config_refuses_or_follows_the_new_config(pools, tmp_path):
    folder = str(tmp_path / "ck")
    pools(2).run(_save, folder)
    res = pools(2).run(_resume_edited, folder)
    for r in res:
        kind, msg = r["ann"]
        assert kind == "ValueError" and "sampler.type: checkpoint 'full', this run 'ann'" in msg, msg
        assert "Nothing was loaded" in msg
        kind, msg = r["adamw"]
        assert kind == "ValueError" and "optimizer.type: checkpoint 'sgd', this run 'adamw'" in msg, msg
        kind, msg = r["both"]
        assert "sampler.type" in msg and "optimizer.type" in msg and "optimizer.lr: 0.5 -> 0.05" in msg, msg
        assert r["ann_untouched"] and r["adamw_untouched"] and r["both_untouched"]
        assert r["loaded"] == 2
        assert r["group"] == {"lr": 0.2, "momentum": 0.5, "weight_decay": 0.0}
        assert r["step_error"] < 1e-6 and r["old_values_error"] > 1e-3, r  # the new values, not the saved ones
    log = " ".join(res[0]["logs"])
    for change in ("optimizer.momentum: checkpoint 0.9, this run 0.5", "optimizer.lr: checkpoint 0.5, this run 0.2",
                   "optimizer.weight_decay: checkpoint 0.01, this run 0.0"):
        assert change in log, log
    assert res[1]["logs"] == []  # rank 0 says it


def _resume_other_ann_options(rank, world, folder):
    xc = _engine(rank, _cfg(dict(ANN, nlist=4)))
    xc.load_checkpoint(folder)
    dropped = xc.head.sampler.index is None
    x, y = _batch(5, rank)
    loss = xc.forward_backward(x, y).item()  # rebuilt with nlist=4
    return dropped, xc.head.sampler.index is not None, loss


def test_resume_with_other_ann_options_drops_the_saved_index(pools, tmp_path):
    folder = str(tmp_path / "ck")
    pools(2).run(_save, folder, ANN)
    for dropped, rebuilt, loss in pools(2).run(_resume_other_ann_options, folder):
        assert dropped and rebuilt and loss == loss


# ---------------------------------------------------------------------- save lock, staging, window, tag
def _save_cases(rank, world, folder, stale_pid):
    from ds_xc.checkpoint.lock import lock_file
    xc = _engine(rank, _cfg(gas=2))
    out = {}
    x, y = _batch(0, rank)
    xc.forward_backward(x, y)
    xc.step()  # 1 of 2 micro-steps: inside the window
    out["window"] = catch(lambda: xc.save_checkpoint(folder, tag="half"))
    out["window_wrote"] = os.path.exists(os.path.join(folder, "half"))
    x, y = _batch(1, rank)
    xc.forward_backward(x, y)
    xc.step()  # the window is complete
    out["long"] = catch(lambda: xc.save_checkpoint(folder, tag="t" * 250))
    out["slash"] = catch(lambda: xc.save_checkpoint(folder, tag="a b"))
    out["held"] = catch(lambda: xc.save_checkpoint(folder, tag="step1"))  # the test process holds its lock
    out["held_wrote"] = os.path.exists(os.path.join(folder, "step1"))
    import torch.distributed as dist
    dist.barrier()
    if rank == 0:  # a lock left by a process that is gone
        with open(lock_file(folder, "step1"), "w") as fh:
            json.dump({"host": __import__("socket").gethostname(), "pid": stale_pid, "start_ticks": 1, "since": 0,
                       "token": "x"}, fh)
    dist.barrier()
    out["stale"] = catch(lambda: xc.save_checkpoint(folder, tag="step1"))
    dist.barrier()  # rank 0 has released the lock
    out["listing"] = sorted(os.listdir(folder))
    return out


def test_save_lock_window_and_tag_are_checked_before_anything_is_written(pools, tmp_path):
    from ds_xc.checkpoint.lock import acquire_save_lock, release_save_lock
    folder = tmp_path / "ck"
    folder.mkdir()
    held = acquire_save_lock(str(folder), "step1")  # another job saving step1: this (live) process
    other = acquire_save_lock(str(folder), "other")  # and another saving "other", mid-save
    (folder / ".staging_other").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        res = pools(2).run(_save_cases, str(folder), dead.pid)
    finally:
        release_save_lock(str(folder), "other", other)
    for rank, r in enumerate(res):
        kind, msg = r["window"]
        assert kind == "RuntimeError" and "inside a gradient-accumulation window (1 of gradient_accumulation_steps=2" \
            in msg and "nothing was written" in msg, msg
        assert not r["window_wrote"]
        kind, msg = r["long"]
        assert kind == "ValueError" and "has 250 characters; at most 200 are allowed" in msg, msg
        assert r["slash"][0] == "ValueError" and "plain folder name" in r["slash"][1]
        kind, msg = r["held"]
        assert kind == "CheckpointError" and f"pid {os.getpid()} on host" in msg and "is being saved by another job" \
            in msg and ".lock_step1" in msg, msg
        assert not r["held_wrote"]
        assert r["stale"] is None  # taken over
        assert r["listing"] == [".lock_other", ".staging_other", "latest", "step1"], r["listing"]  # ours released
    assert held["pid"] == os.getpid()


# ---------------------------------------------------------------------- read-only load
def _load_state(rank, world, folder):
    xc = _engine(rank, _cfg())
    state = xc.load_checkpoint(folder)
    return state["step"], xc.head.weight.detach().clone()


def _read_only(path: str, target: str):
    """A read-only view of ``path`` at ``target``: a read-only bind mount (root), else chmod a-w (others)."""
    os.makedirs(target)
    ok = subprocess.run(["mount", "--bind", path, target], capture_output=True).returncode == 0 and \
        subprocess.run(["mount", "-o", "remount,bind,ro", target], capture_output=True).returncode == 0
    if ok:
        return target, True
    subprocess.run(["umount", target], capture_output=True)
    os.rmdir(target)
    for root, dirs, files in os.walk(path):
        for name in dirs + files + ["."]:
            p = os.path.join(root, name)
            os.chmod(p, os.stat(p).st_mode & ~0o222)
    return path, False


def test_a_read_only_checkpoint_loads_on_two_ranks_and_nothing_is_written(pools, tmp_path):
    src = str(tmp_path / "ck")
    pools(2).run(_save, src)
    want = pools(2).run(_load_state, src)
    folder, mounted = _read_only(src, str(tmp_path / "ro"))
    try:
        stamp, listing = os.stat(folder).st_mtime_ns, sorted(os.listdir(folder))
        got = pools(2).run(_load_state, folder)
        assert os.stat(folder).st_mtime_ns == stamp and sorted(os.listdir(folder)) == listing  # nothing written
    finally:
        if mounted:
            subprocess.run(["umount", folder], check=False)
        else:
            subprocess.run(["chmod", "-R", "u+w", src], check=False)
    for (step, w), (step0, w0) in zip(got, want):
        assert step == step0 == 2 and torch.equal(w, w0)


# ---------------------------------------------------------------------- export
def _export_tool():
    spec = importlib.util.spec_from_file_location("ds_xc_launch_export", os.path.join(ROOT, "launch", "export.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_verifies_the_checksum_manifest(pools, tmp_path):
    from ds_xc.checkpoint import CheckpointError, shard_file
    src = str(tmp_path / "ck")
    pools(2).run(_save, src)
    export = _export_tool()
    good = export.export(os.path.join(src, "step2"), str(tmp_path / "good.pt"), fmt="pt")
    assert good["num_classes"] == 23
    bad = str(tmp_path / "bad")
    shutil.copytree(src, bad)
    path = shard_file(os.path.join(bad, "step2"), 1, 2)
    with zipfile.ZipFile(path) as zf:  # the largest tensor record: the weight (or its momentum), stored raw
        rec = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as fh:
        fh.seek(rec.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
        pos = rec.header_offset + 30 + name_len + extra_len + 3  # the exponent byte of its first float32
        fh.seek(pos)
        byte = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([byte ^ 0x40]))  # e.g. 0.3 -> 1e19: loads fine without the manifest
    with pytest.raises(CheckpointError, match="fails its checksums") as err:
        export.export(os.path.join(bad, "step2"), str(tmp_path / "bad.pt"), fmt="pt")
    assert path in str(err.value) and not os.path.exists(tmp_path / "bad.pt")


def test_export_without_safetensors_says_what_to_install_before_any_work(tmp_path):
    code = ("import runpy, sys; sys.modules['safetensors'] = None; sys.argv = ['export.py'] + sys.argv[1:]; "
            f"runpy.run_path({os.path.join(ROOT, 'launch', 'export.py')!r}, run_name='__main__')")
    out = str(tmp_path / "head.safetensors")
    proc = subprocess.run([sys.executable, "-c", code, "--load_dir", str(tmp_path / "no_such_ckpt"), "--out", out],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0 and "pip install safetensors" in proc.stderr, proc.stderr[-2000:]
    assert "--format pt" in proc.stderr and "Traceback" not in proc.stderr and not os.path.exists(out)


def test_data_stream_addressing_from_a_sample_offset():
    from ds_xc.data import build_dataset
    from ds_xc.data.base import train_sample_indices
    assert train_sample_indices(2, 4, 1, 3, sample_offset=10).tolist() == [10 + 28 + i for i in range(4)]
    data = build_dataset("synthetic", 50, seed=0)
    # 2 ranks x 8 for 4 steps = 64 samples; then 3 ranks x 8 from sample 64: the next 24, none seen before
    x, y = data.train_batch(0, 8, 2, 3, sample_offset=64)
    x_ref, y_ref = data.train_batch(10, 8, 0, 1)  # samples 64 + 2 * 8 = 80..87, on one rank
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_samplers_and_head_optimizers_refuse_state_of_another_kind_before_changing_anything():
    """Used directly (head.load_state_dict, optimizer.load_state_dict), not only through a resume."""
    from ds_xc.head import ClassParallelHead
    from ds_xc.head.optim import HeadAdamW, HeadSGD
    uniform = ClassParallelHead(6, 23, sampler={"type": "uniform", "sample_rate": 0.5}, update="lazy")
    for sampler, name in ((dict(ANN), "ANN"), ({"type": "knn", "sample_rate": 0.5, "neighbors": 3}, "kNN")):
        head = ClassParallelHead(6, 23, sampler=sampler, update="lazy", seed=5)
        w, steps = head.weight.detach().clone(), head.sampler.steps
        with pytest.raises(ValueError, match=rf"{name} sampler state without \['steps'"):
            head.load_state_dict(uniform.state_dict())
        assert torch.equal(head.weight, w) and head.sampler.steps == steps
    p_sgd, p_adamw = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(3, 2))
    sgd, adamw = HeadSGD([p_sgd], lr=0.1, momentum=0.9), HeadAdamW([p_adamw], lr=0.1)
    for p, opt in ((p_sgd, sgd), (p_adamw, adamw)):
        p.grad = torch.ones(3, 2)
        opt.step()
    for target, source, missing in ((adamw, sgd, "'betas'"), (sgd, adamw, "'momentum'")):
        before = {k: v.clone() for k, v in target.state[target.param_groups[0]["params"][0]].items()}
        with pytest.raises(ValueError, match=f"saved by another head optimizer .* no {missing}"):
            target.load_state_dict(source.state_dict())
        after = target.state[target.param_groups[0]["params"][0]]
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
