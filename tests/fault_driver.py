"""Test hook: run launch/train.py with one fault injected from inside a rank (tests/test_faults.py).

    DS_XC_FAULT='{"rank": 1, "at": "phase:backward", "step": 5, "action": "kill"}' \
        python tests/fault_driver.py --deepspeed_config cfg.json --save_dir ckpt

This is test code, never imported by ds_xc. The fault fires on rank ``rank`` the first time
(or the ``nth`` time, counting from 1) the point ``at`` is reached at global step ``step``:

* ``phase:<name>``: entering ``XCEngine.in_phase(name)`` (ds_xc.engine.PHASES: forward,
  backward, gradient reduction, optimizer step, checkpoint save, index rebuild, evaluation);
* ``call:<module>:<attr>[.<attr>]``: a call of that function or method, e.g.
  ``call:ds_xc.engine.checkpointing:save_head_state`` (writing the head shard of a checkpoint),
  ``call:ds_xc.checkpoint.files:write_latest`` (rank 0 publishing ``latest``).

Actions: ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself: alive, never answering; the
test kills it), ``fill`` (fill the file system of ``fill`` up to its last bytes and go on, so
that the checkpoint being saved meets a full disk), ``enospc`` (the next ``torch.save`` writes
half its bytes, then raises ENOSPC: the fallback where no small file system can be mounted),
``trace`` (append every phase entry as ``rank step phase`` to the file ``trace``; no fault),
``pause`` (wait there until the file ``release`` exists, at most 120 s: a save held open while
a second job tries the same tag), ``none`` (no fault: a job that must stop on its own).
Before acting it writes ``time.time()`` to the file ``stamp`` when given.
"""
import errno
import importlib
import json
import os
import runpy
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ds_xc.engine  # noqa: E402

SPEC: dict = {}
RANK = [0]
CURRENT = {"xc": None, "hits": 0}


def _fill(folder: str) -> None:
    """Write zeros into ``folder`` until the file system is full (ENOSPC), keeping what was written."""
    fd = os.open(os.path.join(folder, "filler.bin"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    block = b"\0" * 4096
    try:
        while True:
            os.write(fd, block)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


def _enospc_once() -> None:
    import torch
    real = torch.save

    def failing_save(obj, f, *args, **kwargs):
        torch.save = real
        data = __import__("io").BytesIO()
        real(obj, data, *args, **kwargs)
        with open(f, "wb") if isinstance(f, (str, os.PathLike)) else _nullcontext(f) as fh:
            fh.write(data.getvalue()[: len(data.getvalue()) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    torch.save = failing_save


class _nullcontext:
    def __init__(self, value):
        self.value = value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return False


def _act() -> None:
    if SPEC.get("stamp"):
        with open(SPEC["stamp"], "w") as fh:
            fh.write(repr(time.time()))
    action = SPEC["action"]
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "fill":
        _fill(SPEC["fill"])
    elif action == "enospc":
        _enospc_once()
    elif action == "pause":
        deadline = time.time() + 120
        while not os.path.exists(SPEC["release"]) and time.time() < deadline:
            time.sleep(0.05)


def _maybe_fire(point: str) -> None:
    xc = CURRENT["xc"]
    if RANK[0] != SPEC.get("rank") or point != SPEC.get("at") or xc is None or xc.global_steps != SPEC.get("step"):
        return
    CURRENT["hits"] += 1
    if CURRENT["hits"] == SPEC.get("nth", 1):
        _act()


def _install(spec: dict, rank: int) -> None:
    SPEC.clear()
    SPEC.update(spec)
    RANK[0] = rank
    real_in_phase = ds_xc.engine.XCEngine.in_phase

    def in_phase(self, name):
        CURRENT["xc"] = self
        if SPEC.get("action") == "trace":
            with open(SPEC["trace"], "a") as fh:
                fh.write(f"{RANK[0]} {self.global_steps} {name}\n")
        else:
            _maybe_fire("phase:" + name)
        return real_in_phase(self, name)
    ds_xc.engine.XCEngine.in_phase = in_phase

    at = SPEC.get("at", "")
    if at.startswith("call:") and RANK[0] == SPEC.get("rank"):
        _, module, attrs = at.split(":")
        owner = importlib.import_module(module)
        *path, name = attrs.split(".")
        for part in path:
            owner = getattr(owner, part)
        real = getattr(owner, name)

        def hooked(*args, **kwargs):
            _maybe_fire(at)
            return real(*args, **kwargs)
        setattr(owner, name, hooked)


def _run_train(argv: list) -> None:
    sys.argv = [os.path.join(ROOT, "launch", "train.py")] + list(argv)
    runpy.run_path(sys.argv[0], run_name="__main__")


PRELOAD = ["torch", "deepspeed", "ds_xc.engine", "ds_xc.data", "ds_xc.models", "ds_xc.evaluate", "tqdm", "torch._dynamo",
           "tests.fault_driver"]


def run_rank(rank: int, world: int, port: int, spec: dict, argv: list, log_path: str) -> None:
    """One rank of a job, forked from a server that imported PRELOAD already (tests/test_faults.py)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    _install(spec, rank)
    _run_train(argv)


if __name__ == "__main__":
    _install(json.loads(os.environ.get("DS_XC_FAULT", "{}")), int(os.environ.get("RANK", "0")))
    _run_train(sys.argv[1:])
