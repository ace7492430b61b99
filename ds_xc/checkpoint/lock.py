"""One saver per checkpoint tag: a lock file ``SAVE_DIR/.lock_<tag>`` held while a tag is saved.

Two jobs saving the same tag into one folder would each write their staging folder, then each
rename theirs over the tag: both report success and one job's checkpoint is gone (and each
save's cleanup used to delete the other's staging folder). Rank 0 of a save creates the lock
file with ``O_CREAT | O_EXCL`` (atomic on local file systems and NFSv3+), writes who holds it
(host, pid, process start time, when), and removes it once the tag is published or the save
failed. A second saver finds the file and fails with an error naming the holder.

A lock left by a process that was killed (SIGKILL, the OOM killer) is *stale*: when its holder
ran on this host and that process is gone (its pid is free, or now belongs to a process started
at another time), the lock is taken over with a warning. A holder on another host cannot be
looked up from here: the error names it and the file to remove once that job is known dead.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Optional

from ds_xc.checkpoint.files import CheckpointError

log = logging.getLogger(__name__)

__all__ = ["LOCK_PREFIX", "lock_file", "read_lock", "lock_is_stale", "lock_is_held", "acquire_save_lock",
           "release_save_lock", "remove_stale_lock"]

LOCK_PREFIX = ".lock_"


def lock_file(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, LOCK_PREFIX + tag)


def _start_ticks(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (clock ticks since boot, /proc/<pid>/stat field 22); None when
    there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            rest = fh.read().rsplit(")", 1)[1].split()
        return int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def _holder() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_ticks": _start_ticks(pid), "since": time.time(),
            "token": uuid.uuid4().hex}


def read_lock(path: str) -> Optional[dict]:
    """The holder recorded in lock file ``path`` ({} when unreadable, e.g. caught mid-write); None when absent."""
    try:
        with open(path) as fh:
            info = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def lock_is_stale(info: dict) -> bool:
    """Whether the holder ``info`` is a process of this host that no longer runs."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return False
    ticks = _start_ticks(info["pid"])
    if ticks is None:
        return os.path.isdir("/proc/self")  # no /proc at all: cannot tell, assume alive
    return info.get("start_ticks") is not None and ticks != info["start_ticks"]  # the pid was reused


def lock_is_held(save_dir: str, tag: str) -> bool:
    """Whether a live saver (or one this host cannot check) holds the lock of ``tag``."""
    info = read_lock(lock_file(save_dir, tag))
    return info is not None and not (info and lock_is_stale(info))


def remove_stale_lock(save_dir: str, tag: str) -> bool:
    """Remove the lock of ``tag`` if its holder is a process of this host that no longer runs (a killed
    save of that tag); returns whether it did. Moved aside first and checked again, so a lock another
    process took over meanwhile is put back."""
    path = lock_file(save_dir, tag)
    info = read_lock(path)
    if not info or not lock_is_stale(info):
        return False
    aside = f"{path}.stale_{uuid.uuid4().hex}"
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return False
    if read_lock(aside) != info:  # replaced by a live taker between the two reads: give it back
        with contextlib.suppress(OSError):
            os.link(aside, path)
    os.remove(aside)
    log.info("removed the stale save lock of tag %r in %s (%s)", tag, save_dir, _describe(info))
    return True


def _describe(info: dict) -> str:
    if not info:
        return "an unknown process (the lock file is empty or unreadable)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')} since {since}"


def acquire_save_lock(save_dir: str, tag: str) -> dict:
    """Take the lock of ``tag`` in ``save_dir`` (an existing folder); returns the holder record to pass to
    :func:`release_save_lock`. A live holder raises CheckpointError naming it; a stale one is taken over."""
    path = lock_file(save_dir, tag)
    me = _holder()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            info = read_lock(path)
            if info is None:
                continue  # released between the two calls: try again
            if info and lock_is_stale(info):
                log.warning("checkpoint tag %r in %s: taking over the save lock of %s, which no longer runs "
                            "(its save was interrupted; the tag it was writing was never published)", tag,
                            save_dir, _describe(info))
                aside = f"{path}.stale_{me['token']}"
                with contextlib.suppress(FileNotFoundError):
                    os.replace(path, aside)  # one taker wins; the others then find the new holder
                    os.remove(aside)
                continue
            raise CheckpointError(
                f"save_checkpoint: tag {tag!r} in {os.path.abspath(save_dir)!r} is being saved by another job: "
                f"{_describe(info)} (lock file {path!r}). Two saves of one tag would each report success and one "
                "would be lost; nothing was written. Wait for that save, save under another tag or into another "
                "folder, or, if that job is gone, remove the lock file") from None
        with os.fdopen(fd, "w") as fh:
            json.dump(dict(me, tag=tag), fh)
        return me
    raise CheckpointError(f"save_checkpoint: could not take the save lock {path!r} of tag {tag!r} (another "
                          "process keeps replacing it); nothing was written")


def release_save_lock(save_dir: str, tag: str, me: dict) -> None:
    """Remove the lock of ``tag`` if ``me`` still holds it (a lock taken over by another process stays)."""
    path = lock_file(save_dir, tag)
    info = read_lock(path)
    if info and info.get("token") == me.get("token"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
