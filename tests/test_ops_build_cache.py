"""The native ops' build folders: names that two installs cannot share, a killed build's lock, waiting.

* Two source trees (another checkout, edited sources) give different op names, so different build
  folders (ds_xc_ops.build_cache.op_name); the same tree gives the same name; the op loads from the
  folder ``build_folder`` names.
* A torch ``lock`` left in an op's build folder by a killed build no longer hangs the next load:
  it is removed with a warning naming it (a subprocess with a timeout, so the test cannot hang);
  the slow test kills a real first build half-way and builds again, with the one-line
  "building ds_xc's C++ ops" message, which a cached load does not print.
* A process waiting for a live builder says for whom (pid, folder) and gives up after
  DS_XC_OPS_BUILD_WAIT_S, and load_op then falls back to PyTorch; without flock, torch's lock is
  reported after the stale limit.
"""
import errno
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from ds_xc_ops import build_cache, builders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIND = "select"  # the smallest op that the test session builds (tests/conftest.py)


def _python(code: str, env: dict, timeout: float = 120.0, **kw):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


LOAD = ("import logging, sys; logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s'); "
        f"from ds_xc_ops.builders import load_op; op = load_op({KIND!r}); print('LOADED', op is not None, "
        "op.__file__ if op is not None else None)")


def test_two_source_trees_give_different_op_names(tmp_path):
    a, b = tmp_path / "a" / "csrc", tmp_path / "b" / "csrc"
    shutil.copytree(builders.CSRC, a)
    shutil.copytree(builders.CSRC, b)
    flags = ["-O3", "-Wall"]

    def name(root, flags=flags):
        return build_cache.op_name("ds_xc_select_cpu", [root / "select_cpu.cpp", root / "cpu_simd.h"], flags, root)

    assert name(a) == name(a) and name(a).startswith("ds_xc_select_cpu_") and len(name(a)) == 27
    assert name(a) != name(b)  # identical sources in two installs: each its own folder, no ping-pong rebuilds
    before = name(b)
    (b / "cpu_simd.h").write_text((b / "cpu_simd.h").read_text() + "\n// edited\n")
    assert name(b) != before  # an edited header: a new name
    assert name(a, flags + ["-DX"]) != name(a)  # other flags: a new name
    builder = builders.BUILDERS[KIND]()
    assert builder.name == builders.BUILDERS[KIND]().name and builder.name.startswith(builder.NAME + "_")
    assert len({cls().name for cls in builders.BUILDERS.values()}) == len(builders.BUILDERS)
    assert os.path.join(builders.CSRC, "cpu_simd.h") in builders.included_headers(builder.sources())


def test_a_second_checkout_builds_in_its_own_folder(tmp_path):
    """A copy of the package elsewhere (a second checkout) names its ops differently from this one."""
    shutil.copytree(os.path.join(ROOT, "ops"), tmp_path / "ds_xc_ops", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("from ds_xc_ops.builders import BUILDERS; import ds_xc_ops; "
            f"print(ds_xc_ops.__file__); print(BUILDERS[{KIND!r}]().build_folder())")
    out = _python(code, dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    path, folder = out.stdout.split()[-2:]
    assert path.startswith(str(tmp_path))
    ours = builders.BUILDERS[KIND]().build_folder()
    assert os.path.dirname(folder) == os.path.dirname(ours) and folder != ours


def test_the_op_loads_from_its_build_folder():
    op = builders.load_op(KIND)
    assert op is not None
    assert os.path.dirname(op.__file__) == builders.BUILDERS[KIND]().build_folder()


def test_a_stale_lock_no_longer_hangs_the_load():
    """The file a killed build leaves (torch's ``lock``): the next process removes it, says so, and loads."""
    assert builders.load_op(KIND) is not None  # built (cached) in this session's extensions folder
    folder = builders.BUILDERS[KIND]().build_folder()
    lock = os.path.join(folder, build_cache.TORCH_LOCK)
    open(lock, "w").close()
    try:
        out = _python(LOAD, dict(os.environ), timeout=120)  # torch waited on this file forever before
    finally:
        leftover = os.path.exists(lock)
        if leftover:
            os.remove(lock)
    assert out.returncode == 0, out.stderr
    assert "LOADED True" in out.stdout, out.stdout + out.stderr
    assert f"removing the stale build lock {lock}" in out.stderr
    assert "building ds_xc's C++ ops" not in out.stderr  # built already: nothing compiles
    assert not leftover


@pytest.mark.slow
def test_a_killed_first_build_is_built_again_by_the_next_run(tmp_path):
    """Kill a first build half-way (the whole process group: python, ninja, the compiler), then load:
    the next run removes the lock, announces the build in one line and builds; a third run only loads."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    folder = os.path.join(env["TORCH_EXTENSIONS_DIR"], builders.BUILDERS[KIND]().name)
    lock = os.path.join(folder, build_cache.TORCH_LOCK)
    first = subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(lock) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(lock), "the first build never took torch's lock"
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert os.path.exists(lock)  # what the killed build left
    out = _python(LOAD, env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "LOADED True" in out.stdout, out.stdout + out.stderr
    assert f"removing the stale build lock {lock}" in out.stderr
    lines = [line for line in out.stderr.splitlines() if "building ds_xc's C++ ops" in line]
    assert len(lines) == 1, out.stderr
    assert f"building ds_xc's C++ ops (once, about 30 s): {builders.BUILDERS[KIND].NAME} into {folder}" in lines[0]
    assert "python -m ds_xc_ops.build" in lines[0]
    again = _python(LOAD, env, timeout=120)
    assert "LOADED True" in again.stdout and "building" not in again.stderr, again.stderr


def _hold(path: str):
    """Hold ``path``'s flock from another open file, as a live builder in another process does."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"pid 4242 on host builder since now\n")
    return fd


def test_waiting_for_a_live_builder_says_for_whom_and_gives_up(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = build_cache.build_folder("op_x")
    fd = _hold(os.path.join(folder, build_cache.OWN_LOCK))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, "ds_xc_ops.build_cache"):
        with pytest.raises(build_cache.BuildWaitTimeout, match=r"waited \d+ s for pid 4242 on host builder"):
            with build_cache.exclusive_build("op_x", "C++ op x", wait_s=1.0):
                pass
    assert time.monotonic() - start < 10
    assert any("waiting for pid 4242 on host builder since now, which is building ds_xc's C++ op x in " + folder
               in r.getMessage() for r in caplog.records)
    # the holder finishes while we wait: we get the folder then
    threading.Timer(0.5, os.close, (fd,)).start()
    with build_cache.exclusive_build("op_x", "C++ op x", wait_s=30.0) as got:
        assert got == folder
        assert open(os.path.join(folder, build_cache.OWN_LOCK)).read().startswith(f"pid {os.getpid()} on host ")


def test_load_op_falls_back_when_the_build_folder_stays_busy(monkeypatch, caplog):
    monkeypatch.setenv("DS_XC_OPS_BUILD_WAIT_S", "1")
    from deepspeed.ops.op_builder.builder import OpBuilder
    monkeypatch.setattr(builders, "_OPS", {})
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})  # DeepSpeed's per-process cache: as in a fresh process
    fd = _hold(os.path.join(builders.BUILDERS[KIND]().build_folder(), build_cache.OWN_LOCK))
    try:
        with caplog.at_level(logging.WARNING):
            assert builders.load_op(KIND) is None
    finally:
        os.close(fd)
    msg = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert msg and "BuildWaitTimeout" in msg[0] and "pid 4242" in msg[0] and "DS_XC_OPS_BUILD_WAIT_S" in msg[0]


def test_a_lock_left_in_a_folder_is_removed_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = os.path.join(build_cache.build_folder("op_y"), build_cache.TORCH_LOCK)
    os.makedirs(os.path.dirname(lock))
    open(lock, "w").close()
    with caplog.at_level(logging.WARNING, "ds_xc_ops.build_cache"):
        with build_cache.exclusive_build("op_y", "C++ op y", wait_s=1.0):
            assert not os.path.exists(lock)
    assert any(f"removing the stale build lock {lock}" in r.getMessage() for r in caplog.records)


def test_without_flock_a_lingering_lock_is_reported(tmp_path, monkeypatch):
    """A file system without flock: torch's lock is waited for at most the stale limit, then named."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock = os.path.join(build_cache.build_folder("op_z"), build_cache.TORCH_LOCK)
    os.makedirs(os.path.dirname(lock))
    open(lock, "w").close()
    with pytest.raises(build_cache.BuildWaitTimeout, match=f"rm {lock}"):
        with build_cache.exclusive_build("op_z", "C++ op z", stale_s=0.5):
            pass
    os.remove(lock)
    with build_cache.exclusive_build("op_z", "C++ op z", stale_s=0.5):  # no lock: nothing to wait for
        pass
