"""Processes killed with SIGKILL: during a checkpoint save, and one rank of a training job.

* A one-rank job saves ``step1``, trains on, and is killed in the middle of its next save
  (a hook blocks after writing half of a file): of DeepSpeed's model file into a new tag,
  or of a head shard while re-saving the very tag ``latest`` names. A new process then
  finds ``latest`` still naming ``step1`` and loads exactly the weights saved there; the
  next save clears the staging folder the killed one left.
* ``launch/train.py`` on 2 ranks with ``xc_train.comm_timeout_s=5``: rank 1 kills itself
  mid-training; rank 0 exits within the timeout with status 3 and a message naming rank 1,
  and the last checkpoint is complete and loads.
"""
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.dist_pool import free_port

pytestmark = pytest.mark.serial  # timing: a dead rank must stop the others within a timeout; run alone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engine():
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import ds_xc
    from tests.test_reliability import CASES, SEED, Body, _config
    torch.manual_seed(SEED)
    body = Body()
    return ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9),
                            config=_config(**CASES["uniform_lazy_adamw_compressed_overlap"]))


def _weights(xc):
    return {"head": xc.head.weight.detach().clone(), "body": xc.engine.module.lin.weight.detach().clone(),
            "head_opt": xc.head_optimizer.state_dict()["state"][0]["exp_avg"].clone()}


def _saver(save_dir, where, ready):
    from tests.test_reliability import _train
    xc = _engine()
    _train(xc, 0, 1, 0, 1)
    xc.save_checkpoint(save_dir, tag="step1", client_state={"step": 1})
    torch.save(_weights(xc), os.path.join(save_dir, "..", "expected.pt"))
    _train(xc, 0, 1, 1, 2)

    def stall(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(b"PK\x03\x04 half a file")
        open(ready, "w").close()
        time.sleep(600)  # killed here

    if where == "engine_file":
        xc.engine.checkpoint_engine.save = lambda state_dict, path: stall(path)
        xc.save_checkpoint(save_dir, tag="step2", client_state={"step": 2})
    else:  # re-save the tag `latest` names, killed while writing the head shard
        import ds_xc.engine.checkpointing as eng
        eng.save_head_state = lambda tag_dir, head, opt, **kw: stall(os.path.join(tag_dir, "ds_xc_head", "x.pt"))
        xc.save_checkpoint(save_dir, tag="step1", client_state={"step": 1})


def _loader(save_dir, out):
    xc = _engine()
    state = xc.load_checkpoint(save_dir)
    result = {"step": state["step"], "weights": _weights(xc), "left": sorted(os.listdir(save_dir))}
    xc.save_checkpoint(save_dir, tag="step2", client_state={"step": 2})
    result["after_save"] = sorted(os.listdir(save_dir))
    torch.save(result, out)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["engine_file", "head_shard_of_latest_tag"])
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, where):
    ctx = mp.get_context("spawn")
    save_dir, ready = str(tmp_path / "ckpt"), str(tmp_path / "ready")
    proc = ctx.Process(target=_saver, args=(save_dir, where, ready))
    proc.start()
    deadline = time.time() + 120
    while not os.path.exists(ready) and proc.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(ready), f"the saver never reached the hook (exit code {proc.exitcode})"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    assert open(os.path.join(save_dir, "latest")).read() == "step1"
    assert os.path.isdir(os.path.join(save_dir, ".staging_" + ("step2" if where == "engine_file" else "step1")))

    out = str(tmp_path / "loaded.pt")
    loader = ctx.Process(target=_loader, args=(save_dir, out))
    loader.start()
    loader.join(120)
    assert loader.exitcode == 0
    got, expected = torch.load(out, weights_only=False), torch.load(tmp_path / "expected.pt")
    assert got["step"] == 1
    for key, value in expected.items():
        assert torch.equal(got["weights"][key], value), key
    assert got["after_save"] == ["latest", "step1", "step2"]  # the next save removed the leftovers (and stale lock)


# ---------------------------------------------------------------------- a rank that dies
_DRIVER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import ds_xc.engine
if os.environ["RANK"] == "1":  # die (SIGKILL) in the middle of optimizer step 5
    step = ds_xc.engine.XCEngine.step
    def dying_step(self):
        if self.global_steps == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self)
    ds_xc.engine.XCEngine.step = dying_step
sys.argv = ["train.py"] + {argv!r}
import runpy
runpy.run_path({train!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_a_dead_rank_stops_the_others_within_the_timeout(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "torch_adam": True}},
           "extreme_classification": {"num_classes": 101, "embedding_dim": 16},
           "xc_train": {"data": "synthetic", "max_steps": 200, "eval_every": 0, "eval_samples": 16,
                        "log_every": 1000, "hidden_dim": 16, "save_every": 2, "comm_timeout_s": 5}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    save_dir = tmp_path / "ckpt"
    argv = ["--deepspeed_config", str(tmp_path / "cfg.json"), "--save_dir", str(save_dir)]
    script = _DRIVER.format(root=ROOT, argv=argv, train=os.path.join(ROOT, "launch", "train.py"))
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        procs[1].wait(timeout=180)
        died = time.time()
        out, _ = procs[0].communicate(timeout=60)
        waited = time.time() - died
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 3, out[-3000:]
    assert waited < 5 + 10, waited  # comm_timeout_s plus slack for the exit
    assert "rank 0 of 2: a collective failed" in out and "rank 1 (pid" in out, out[-3000:]
    assert (save_dir / "latest").read_text() == "step4"
    from ds_xc.checkpoint import ShardRows
    rows = ShardRows(str(save_dir / "step4"))
    assert rows.world_size == 2 and rows.rows(0, 101).shape == (101, 16)
    state = torch.load(save_dir / "step4" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["step"] == 4
