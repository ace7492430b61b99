"""A pool of spawned gloo processes that runs test functions on every rank.

Spawning a rank and importing torch costs seconds, so one pool per world size serves
the whole test session. ``pool.run(fn, *args)`` calls the importable function ``fn`` on
every rank as ``fn(rank, world_size, *args)`` and returns the results in rank order;
an exception on any rank fails the call with that rank's traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta

_TIMEOUT_S = 240


from benchmarks.harness import free_port  # noqa: E402  one rule for every launch (ports below the ephemeral range)


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    while True:
        item = tasks.get()
        if item is None:
            results.close()
            results.join_thread()  # every result put is flushed to the parent
            os._exit(0)  # no barrier nor teardown of the groups: seconds for a pool that made many
        fn, args = item
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException:  # report, keep serving
            results.put((rank, False, traceback.format_exc()))


class DistPool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = _TIMEOUT_S) -> list:
        for q in self.tasks:
            q.put((fn, args))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(f"{fn.__name__} did not finish on all ranks within {timeout} s") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return out

    def close(self, force: bool = False) -> None:
        close_all([self], force=force)

    def threads(self) -> int:
        """The most OS threads any live worker has (0 where /proc cannot tell): why that number grows and
        what it costs is told at tests/conftest.py's POOL_THREAD_LIMIT."""
        most = 0
        for p in self.procs:
            try:
                with open(f"/proc/{p.pid}/status") as fh:
                    most = max(most, next(int(ln.split()[1]) for ln in fh if ln.startswith("Threads:")))
            except (OSError, StopIteration, ValueError):
                pass
        return most


def close_all(pools: list, force: bool = False, timeout: float = 10.0) -> None:
    """Stop every pool's workers together: all are told to stop first, then all are joined
    against one deadline and the stragglers killed (a worker left inside a collective by a
    test that failed a rank on purpose would otherwise hold each pool's join in turn)."""
    if not force:
        for pool in pools:
            for q in pool.tasks:
                q.put(None)
        deadline = time.monotonic() + timeout
        for pool in pools:
            for p in pool.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
    for pool in pools:
        for p in pool.procs:
            if p.is_alive():
                p.kill()


def catch(fn):
    """(exception class name, message) of what ``fn()`` raises, or None: for tests that compare
    the errors every rank saw."""
    try:
        fn()
    except Exception as exc:  # the test inspects type and message
        return type(exc).__name__, str(exc)
    return None
