"""Run a launch/ script on N local ranks without the ``deepspeed`` launcher.

One python process per rank, with the environment a launcher sets (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as torchrun and
``deepspeed --num_gpus N`` do on one host. The launcher itself costs about 11 s per job
on a 2-core machine (its runner and its per-node launch.py each import deepspeed before
the ranks start); tests/test_launch.py and tests/test_multinode.py keep testing it, the
tests that only need a script to run on some ranks start the ranks here.

Each rank writes to its own file (a pipe that fills would block a rank inside a
collective and hang the others); the returned text is rank 0's output, then the others'.
When a rank fails, the others get a few seconds to fail on their own and are then killed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from tests.dist_pool import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
_GRACE_S = 20.0


def run_ranks(args: list, world: int = 1, script: str = TRAIN, timeout: float = 600.0, ok: bool = True,
              env: dict | None = None) -> str:
    """``script args`` on ``world`` ranks; asserts that all exit 0 (``ok``) or that one fails; returns the output."""
    port = free_port()
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), **(env or {}))
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, script] + list(args), cwd=ROOT, stdout=logs[r],
                                  stderr=subprocess.STDOUT, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
                 for r in range(world)]
        rcs = _wait(procs, timeout)
        out = ""
        for r, fh in enumerate(logs):
            fh.seek(0)
            out += (f"\n----- rank {r} -----\n" if r else "") + fh.read()
            fh.close()
    failed = any(rc != 0 for rc in rcs)
    assert failed != ok, f"exit codes {rcs}:\n{out[-5000:]}"
    return out


def _wait(procs: list, timeout: float) -> list:
    """Exit codes of ``procs``; kills them all past ``timeout`` or ``_GRACE_S`` after a first failure."""
    deadline, fail_at = time.monotonic() + timeout, None
    while True:
        rcs = [p.poll() for p in procs]
        if all(rc is not None for rc in rcs):
            return rcs
        now = time.monotonic()
        if fail_at is None and any(rc not in (None, 0) for rc in rcs):
            fail_at = now
        if now > deadline or (fail_at is not None and now - fail_at > _GRACE_S):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return [p.wait() if p.returncode is None else p.returncode for p in procs]
        time.sleep(0.05)
