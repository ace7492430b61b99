"""Naming a lost peer: the ranks' (hostname, pid), and one line for a collective that failed.

A rank killed mid-training makes its peers' next collective fail at once (closed
connection); a rank that hangs or is stopped, after the process-group timeout. The
survivors then say which rank is gone (its pid is gathered at start and looked up in
/proc on this host), or stopped, and where they were (``XCEngine.where()``).
"""
from __future__ import annotations

import os
import socket
import time
from typing import Optional

import torch.distributed as dist

from ds_xc.parallel.groups import group_size, resolve_group, world_rank_and_size

__all__ = ["gather_peers", "lost_peers", "stopped_peers", "is_comm_failure", "describe_comm_failure"]



def gather_peers(group=None) -> list:
    """[(hostname, pid)] of every rank of ``group`` in group-rank order (one all_gather_object over
    ``group``; None: the world), to name a peer that dies. Collective: every rank of ``group`` calls it."""
    me = (socket.gethostname(), os.getpid())
    group = resolve_group(group)
    if group_size(group) == 1:
        return [me]
    out: list = [None] * group_size(group)
    dist.all_gather_object(out, me, group=group)
    return out


def _process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc ("R", "S", "T" stopped, "Z" zombie, ...); "X" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"
    except OSError:
        try:
            os.kill(pid, 0)
            return "?"
        except ProcessLookupError:
            return "X"
        except OSError:
            return "?"


def _process_gone(pid: int) -> bool:
    return _process_state(pid) in ("Z", "X")  # a killed child stays a zombie until its parent reaps it


_EXIT_GRACE_S = 3.0  # how long a failed collective waits for a dying peer to show as gone


def lost_peers(peers: list) -> list:
    """Ranks (positions in ``peers``) on this host whose process is gone (ranks on other hosts cannot be checked)."""
    host = socket.gethostname()
    return [r for r, (h, pid) in enumerate(peers) if h == host and pid != os.getpid() and _process_gone(pid)]


def stopped_peers(peers: list) -> list:
    """Ranks (positions in ``peers``) on this host whose process is stopped (SIGSTOP, a debugger):
    alive but never answering."""
    host = socket.gethostname()
    return [r for r, (h, pid) in enumerate(peers) if h == host and pid != os.getpid() and
            _process_state(pid) in ("T", "t")]


def is_comm_failure(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer died or did not answer in time."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(k in text for k in (
        "gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout", "broken pipe",
        "peer", "socket"))


def describe_comm_failure(exc: BaseException, peers: Optional[list] = None, timeout_s: Optional[float] = None,
                          where: Optional[str] = None) -> str:
    """One line for a failed collective: this rank, where it was (``XCEngine.where()``: the phase and
    step), the peers found dead or stopped, and the original error."""
    rank, world = world_rank_and_size()
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    gone = stopped = []
    deadline = time.monotonic() + _EXIT_GRACE_S
    while peers:  # a killed peer's sockets close before it becomes a zombie: give its exit a moment
        gone = lost_peers(peers)
        stopped = [] if gone else stopped_peers(peers)
        if gone or stopped or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if gone or stopped:
        who = ", ".join(f"rank {r} (pid {peers[r][1]} on {peers[r][0]})" for r in gone or stopped)
        cause = f"peer process gone: {who}" if gone else f"peer process stopped (not answering): {who}"
    else:
        cause = ("a peer rank is gone or stuck" + (f" for more than {timeout_s:g} s" if timeout_s else "")
                 + " (no dead rank found on this host" + (f"; ranks on other hosts: "
                 f"{[r for r, (h, _) in enumerate(peers) if h != socket.gethostname()]}" if peers else "") + ")")
    return (f"rank {rank} of {world}: a collective failed{' ' + where if where else ''}; {cause}. "
            f"Error: {type(exc).__name__}: {first}")
