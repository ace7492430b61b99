"""Shared helpers of the benchmarks: spawned gloo ranks, memory probes, machine facts.

* Memory: VmRSS / VmHWM of the calling process from /proc/self/status, and a reset of
  VmHWM to the current RSS through /proc/self/clear_refs (Linux), so that the peak of a
  phase can be measured inside one process (``release_free_memory()``, ``reset_peak()`` ...
  ``hwm_bytes()``).
* Ranks: :func:`spawn_ranks` starts ``spec['world']`` fresh processes (spawn context) in a
  new gloo group on 127.0.0.1 (a free port each time), runs ``fn(rank, world, port, spec)``
  in each with ``spec['threads']`` torch/OMP threads, and returns the per-rank results
  (or raises with every failing rank's traceback). ``fn`` must be a module-level function
  of an importable module (the spawned children import it by name; a script's own
  functions work too, multiprocessing re-imports the script as ``__mp_main__``).
* Timing: user + sys CPU seconds of the process (:func:`cpu_seconds`); one timed build of a
  head's sampler index (:func:`timed_index_build`: wall, CPU, memory peak).
* Report facts: CPU model, usable cores, the 1/5/15-minute load, git revision (with the
  uncommitted files of ds_xc/, or of the paths given, as other people edit them concurrently).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import random
import resource
import socket
import subprocess
import time
import traceback

MIB = 1024 * 1024
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------- memory probes
def _status_kib() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])  # kB
    return out


def rss_bytes() -> int:
    return _status_kib()["VmRSS"] * 1024


def hwm_bytes() -> int:
    return _status_kib()["VmHWM"] * 1024


def reset_peak() -> None:
    """Reset VmHWM to the current VmRSS (Linux: write 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def release_free_memory() -> None:
    """Collect garbage and hand the allocator's free pages back to the kernel (glibc ``malloc_trim``;
    a no-op elsewhere), so that the RSS before the next phase of one process is a clean baseline."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_reset_works() -> bool:
    """True when clear_refs really resets VmHWM here (checked once, in the parent)."""
    try:
        buf = bytearray(64 * MIB)  # touched: RSS and HWM grow by 64 MiB
        del buf
        before = hwm_bytes()
        reset_peak()
        return hwm_bytes() < before - 32 * MIB
    except OSError:
        return False


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free now, drawn at random below the ephemeral range. A port from bind(0) lies
    inside that range, where any outgoing connection (gloo opens many, in parallel tests too) may
    take it between this call and the rendezvous listening on it (EADDRINUSE)."""
    low = _ephemeral_low()
    draw = random.Random()
    for _ in range(200):
        port = draw.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the low range is full: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- ranks
def _rank_main(rank: int, world: int, port: int, spec: dict, results, fn) -> None:
    try:
        results.put((rank, True, fn(rank, world, port, spec)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def init_rank(rank: int, world: int, port: int, spec: dict):
    """In a spawned rank: set the launcher variables and thread count, start gloo; returns torch."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=spec["timeout"]))
    return torch


def close_rank() -> None:
    import torch.distributed as dist

    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass


def spawn_ranks(spec: dict, fn) -> list:
    """Spawn ``spec['world']`` fresh ranks in a new gloo group, run ``fn``, return per-rank results.

    ``spec`` needs ``world``, ``threads`` (torch/OMP threads per rank, set in the children's
    environment before torch loads) and ``timeout`` (seconds for the whole configuration).
    """
    ctx = mp.get_context("spawn")
    world = spec["world"]
    # children inherit the environment at start(): thread counts are set before torch loads
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(spec["threads"])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, spec, results, fn), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out, errors = [None] * world, []
    deadline = time.monotonic() + spec["timeout"]
    try:
        for _ in range(world):
            while True:
                try:
                    rank, ok, value = results.get(timeout=5)
                    break
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"a rank died (exit codes {[p.exitcode for p in procs]}; "
                                           f"-9 is usually the OOM killer)") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"configuration {spec} did not finish within {spec['timeout']} s") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("benchmark rank failed:\n" + "\n".join(errors))
        for p in procs:
            p.join(timeout=30)
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


# ---------------------------------------------------------------------------- timing
def cpu_seconds() -> float:
    """User + sys CPU seconds of this process so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed_index_build(head) -> tuple:
    """Build the sampler index of ``head`` (ANN, kNN) now, on every rank of its group together:
    (wall s, CPU s, peak bytes above the RSS before it); (0.0, 0.0, 0) for samplers without one.
    Benchmarks call it once before the warm-up and amortise it over ``rebuild_interval``."""
    if not hasattr(head.sampler, "rebuild"):
        return 0.0, 0.0, 0
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    before = rss_bytes()
    reset_peak()
    c, t = cpu_seconds(), time.perf_counter()
    head.rebuild_index()
    return time.perf_counter() - t, cpu_seconds() - c, hwm_bytes() - before


# ---------------------------------------------------------------------------- report facts
def git_rev(paths=("ds_xc",)) -> str:
    """Commit of the checkout, and which files under ``paths`` (git pathspecs) differ from it
    (others edit them concurrently)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = [line[3:] for line in dirty.splitlines() if line.strip()]
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    return f"{rev or 'unknown'}" + (f" (uncommitted: {', '.join(changed[:4])}{more})" if changed else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def load_average() -> str:
    """The 1/5/15-minute load average (what ``uptime`` prints), e.g. '2.10 1.95 1.40'."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def mib(b: float) -> str:
    return f"{b / MIB:,.0f}"


def parse_key_json(items: list, flag: str, error) -> dict:
    """Repeated ``KEY=JSON`` arguments -> {KEY: value} (a value that is not JSON stays a string);
    ``error`` (argparse's ``parser.error``) is called on an item without '='."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            error(f"{flag} expects KEY=JSON, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def write_report(path: str, text: str) -> None:
    """Write ``text`` to ``path`` ('-': nowhere), creating the folder."""
    if path == "-":
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", flush=True)


def finish_worker(result: dict, out: str, indent=1) -> dict:
    """End a benchmark worker rank: rank 0 writes ``result`` as JSON to ``out`` ('-': stdout),
    then every rank waits for the others and leaves the process group."""
    import json

    import torch.distributed as dist

    if dist.get_rank() == 0:
        text = json.dumps(result, indent=indent)
        if out == "-":
            print(text, flush=True)
        else:
            with open(out, "w") as fh:
                fh.write(text)
    dist.barrier()
    dist.destroy_process_group()
    return result
