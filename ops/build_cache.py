"""Where a native op is built in the torch extensions cache, and who may build it there.

torch's JIT build (``torch.utils.cpp_extension.load``, reached through DeepSpeed's
``OpBuilder.jit_load``) compiles an op into ``<extensions root>/<name>/`` under a lock
file ``lock`` that it creates before the build and removes after. A build that is killed
(Ctrl-C, a timeout, the OOM killer) leaves that file behind, and every later process waits
for it to go away, forever and without a word. Two checkouts of ds_xc on one machine also
used the same names with different sources, so each rebuilt the other's ops on every run.

This module fixes both:

* :func:`op_name`: the op's name carries a short hash of its sources, the headers of
  ops/csrc/, its flags, the folder the sources live in (the install) and torch's version
  and place, so two installs or two versions of the sources never share a build folder;
* :func:`exclusive_build`: ds_xc's processes take an exclusive ``flock`` on a file of
  their own in the build folder (``ds_xc_build.lock``, holding the builder's pid and
  host) before they enter torch's build. The kernel drops that lock when its process
  dies however it dies, so it is never stale; whoever holds it is the only ds_xc process
  that can be inside torch's build of that folder, so a torch ``lock`` file it finds there
  was left by a killed build: it is removed, with a warning naming it. A process that
  waits for a live builder logs what it waits for (the pid, host and folder) at once and
  every 30 s, and gives up after ``DS_XC_OPS_BUILD_WAIT_S`` seconds (default 1200) with a
  TimeoutError that says how to fix it. Where the file system offers no flock, torch's
  lock is waited for at most ``STALE_LOCK_S`` seconds, then reported (an error naming the
  file and the command that removes it).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import socket
import sys
import time

import torch

__all__ = ["op_name", "extensions_root", "build_folder", "is_built", "exclusive_build", "BuildWaitTimeout",
           "OWN_LOCK", "TORCH_LOCK", "STALE_LOCK_S", "SCHEME"]

logger = logging.getLogger(__name__)

SCHEME = "1"  # bump when the naming below changes meaning
OWN_LOCK = "ds_xc_build.lock"  # ours: flock'ed by the one ds_xc process building this folder
TORCH_LOCK = "lock"  # torch's FileBaton in the build folder (torch.utils.cpp_extension._jit_compile)
STALE_LOCK_S = 60.0  # without flock: how long torch's lock may stay before it is reported as stale
REPORT_EVERY_S = 30.0  # how often a waiting process says again what it waits for
POLL_S = 0.25


class BuildWaitTimeout(TimeoutError):
    """A ds_xc op's build folder stayed busy longer than allowed; the message names the folder and the holder."""


def op_name(base: str, files, flags, root: str) -> str:
    """``<base>_<10 hex digits>``: the digits hash the contents of ``files`` (sources and headers),
    ``flags``, the folder ``root`` the sources live in, and torch's version and install folder.

    Two installs (another checkout, another venv), or edited sources, get different names and so
    different build folders: neither rebuilds the other's op, and no two of them share a lock."""
    digest = hashlib.sha1(f"scheme {SCHEME}\0root {os.path.abspath(root)}\0torch {torch.__version__} "
                          f"{os.path.dirname(os.path.abspath(torch.__file__))}\0".encode())
    for path in sorted(os.path.abspath(p) for p in files):
        with open(path, "rb") as fh:
            digest.update(f"file {os.path.relpath(path, root)}\0".encode() + fh.read() + b"\0")
    for flag in flags:
        digest.update(f"flag {flag}\0".encode())
    return f"{base}_{digest.hexdigest()[:10]}"


def extensions_root() -> str:
    """The folder torch builds JIT extensions in: ``$TORCH_EXTENSIONS_DIR``, else
    ``~/.cache/torch_extensions/py<ver>_<cpu|cuXYZ|rocmXYZ>`` (torch's rule, restated here with its
    public pieces)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return root
    from torch.utils.cpp_extension import get_default_build_root
    if torch.version.hip is not None:
        accel = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accel = "cu" + torch.version.cuda.replace(".", "")
    else:
        accel = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{py}_{accel}")


def build_folder(name: str) -> str:
    """The build folder torch uses for the op ``name``."""
    return os.path.join(extensions_root(), name)


def is_built(name: str) -> bool:
    """True when the op's library is in its build folder (a later load only imports it)."""
    ext = ".pyd" if sys.platform == "win32" else ".so"
    return os.path.isfile(os.path.join(build_folder(name), name + ext))


def _holder(path: str) -> str:
    """Who the lock file says holds it ("pid 123 on host h since 12:00:00"), or "another process"."""
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        text = ""
    return text or "another process"


def _remove_stale_torch_lock(folder: str, what: str) -> None:
    lock = os.path.join(folder, TORCH_LOCK)
    if not os.path.exists(lock):
        return
    age = time.time() - os.path.getmtime(lock)
    logger.warning("removing the stale build lock %s of ds_xc's %s (%.0f s old): no process is building that op, "
                   "so it was left by a build that was killed (Ctrl-C, a timeout, out of memory); building again",
                   lock, what, age)
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)


def _wait_for_torch_lock(folder: str, what: str, stale_s: float) -> None:
    """Without flock: wait for torch's lock at most ``stale_s`` seconds, saying so, then report it as stale."""
    lock = os.path.join(folder, TORCH_LOCK)
    start = time.monotonic()
    told = False
    while os.path.exists(lock):
        if not told:
            logger.warning("waiting for the build lock %s of ds_xc's %s (another process is building it, or a "
                           "killed build left it; reported as stale after %.0f s)", lock, what, stale_s)
            told = True
        if time.monotonic() - start > stale_s:
            raise BuildWaitTimeout(
                f"the build lock {lock} of ds_xc's {what} stayed for more than {stale_s:.0f} s; this file system "
                f"offers no flock, so whether a build is still running cannot be told. If none is (a killed build "
                f"left it), remove it: rm {lock}; then run python -m ds_xc_ops.build")
        time.sleep(POLL_S)


@contextlib.contextmanager
def exclusive_build(name: str, what: str, wait_s: float | None = None, stale_s: float = STALE_LOCK_S):
    """Hold the op's build folder for this process while it builds or loads the op ``name``.

    Waits (logging what for: the holder's pid, host and folder) while another live process holds
    it, at most ``wait_s`` seconds (default ``$DS_XC_OPS_BUILD_WAIT_S`` or 1200), then raises
    :class:`BuildWaitTimeout`; once held, removes a torch lock that a killed build left. Yields the
    folder."""
    if wait_s is None:
        wait_s = float(os.environ.get("DS_XC_OPS_BUILD_WAIT_S", "1200"))
    folder = build_folder(name)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, OWN_LOCK)
    try:
        fd, writable = os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
    except PermissionError:  # another user's file in a shared cache: a read-only descriptor locks as well
        fd, writable = os.open(path, os.O_RDONLY), False
    try:
        held = _acquire(fd, path, folder, what, wait_s)
        if held:
            if writable:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} since "
                              f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
            _remove_stale_torch_lock(folder, what)
        else:
            _wait_for_torch_lock(folder, what, stale_s)
        yield folder
    finally:
        os.close(fd)  # drops the flock


def _acquire(fd: int, path: str, folder: str, what: str, wait_s: float) -> bool:
    """flock ``fd`` exclusively, waiting for a live holder with messages; False where flock is unsupported."""
    import fcntl
    start = time.monotonic()
    last_report = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if last_report is not None:
                logger.info("ds_xc's %s: the other build finished after %.0f s; loading it",
                               what, time.monotonic() - start)
            return True
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                logger.info("no flock on the file system of %s (%s): falling back to torch's lock file", path, exc)
                return False
            raise
        waited = time.monotonic() - start
        if waited > wait_s:
            raise BuildWaitTimeout(
                f"waited {waited:.0f} s for {_holder(path)}, which is building ds_xc's {what} in {folder} "
                f"(DS_XC_OPS_BUILD_WAIT_S={wait_s:g}); if that process hangs, stop it, or build ahead of the job: "
                "python -m ds_xc_ops.build")
        if last_report is None or time.monotonic() - last_report >= REPORT_EVERY_S:
            logger.warning("waiting for %s, which is building ds_xc's %s in %s (%.0f s so far; at most %g s, "
                           "DS_XC_OPS_BUILD_WAIT_S)", _holder(path), what, folder, waited, wait_s)
            last_report = time.monotonic()
        time.sleep(POLL_S)
