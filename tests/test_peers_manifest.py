"""The small pieces the fault-injection suite (tests/test_faults.py) relies on, in one process:

* ``XCEngine.in_phase``: sets ``phase``, restores it on a normal exit, leaves it on an error;
* ``stopped_peers`` / ``lost_peers`` find a SIGSTOPped and a killed process by pid, and
  ``describe_comm_failure`` names the phase, the step and the lost rank;
* the checksum manifest: a clean tag passes, a truncated or flipped file is named, a damaged
  manifest raises CheckpointError; ``raise_if_disk_full`` turns a failed save on a full file
  system into ENOSPC naming the folder.
"""
import errno
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from ds_xc.checkpoint import CheckpointError
from ds_xc.engine import XCEngine
from ds_xc.manifest import (MANIFEST_FILE, check_files, hash_files, list_files, raise_if_disk_full, read_manifest,
                            write_manifest)
from ds_xc.peers import describe_comm_failure, lost_peers, stopped_peers


def test_in_phase_marks_the_block_and_keeps_the_phase_of_an_error():
    xc = types.SimpleNamespace(phase="setup")
    with XCEngine.in_phase(xc, "forward"):
        assert xc.phase == "forward"
        with XCEngine.in_phase(xc, "index rebuild"):
            assert xc.phase == "index rebuild"
        assert xc.phase == "forward"
    assert xc.phase == "setup"
    with pytest.raises(RuntimeError):
        with XCEngine.in_phase(xc, "backward"):
            raise RuntimeError("a collective failed")
    assert xc.phase == "backward"  # the failure handler reads it


def _wait_state(pid, letters, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] in letters:
                return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never reached state {letters}")


def test_a_stopped_and_a_killed_peer_are_named():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    peers = [(socket.gethostname(), os.getpid()), (socket.gethostname(), proc.pid), ("elsewhere", 1)]
    try:
        assert stopped_peers(peers) == [] and lost_peers(peers) == []
        os.kill(proc.pid, signal.SIGSTOP)
        _wait_state(proc.pid, "Tt")
        assert stopped_peers(peers) == [1] and lost_peers(peers) == []
        msg = describe_comm_failure(RuntimeError("gloo: Timed out"), peers, 5, "during backward at global step 3")
        assert msg.startswith("rank 0 of 1: a collective failed during backward at global step 3; peer process "
                              f"stopped (not answering): rank 1 (pid {proc.pid} on {socket.gethostname()})"), msg
        os.kill(proc.pid, signal.SIGKILL)
        _wait_state(proc.pid, "ZX")  # a zombie until reaped: gone all the same
        assert lost_peers(peers) == [1] and stopped_peers(peers) == []
        assert "peer process gone: rank 1" in describe_comm_failure(RuntimeError("reset"), peers, 5, None)
    finally:
        proc.kill()
        proc.wait()


def _tag(tmp_path):
    tag = tmp_path / "step1"
    (tag / "ds_xc_head").mkdir(parents=True)
    (tag / "ds_xc_head" / "meta.json").write_text('{"num_classes": 3}')
    (tag / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 4)
    write_manifest(str(tag), hash_files(str(tag), list_files(str(tag))))
    return tag


def test_the_manifest_names_a_truncated_or_flipped_file(tmp_path):
    tag = _tag(tmp_path)
    files = read_manifest(str(tag))
    assert sorted(files) == list_files(str(tag)) == ["ds_xc_head/meta.json", "mp_rank_00_model_states.pt"]
    assert check_files(str(tag), files, sorted(files)) == []
    model = tag / "mp_rank_00_model_states.pt"
    data = bytearray(model.read_bytes())
    data[700] ^= 0x10
    model.write_bytes(bytes(data))
    problems = check_files(str(tag), files, sorted(files))
    assert len(problems) == 1 and str(model) in problems[0] and "sha256" in problems[0]
    os.truncate(model, 100)
    assert "has 100 bytes, the manifest says 1024" in check_files(str(tag), files, sorted(files))[0]
    os.remove(model)
    assert "cannot be read" in check_files(str(tag), files, sorted(files))[0]


@pytest.mark.parametrize("text", ["", "{", '{"format": 1}', '{"format": 1, "files": {"a": {"bytes": 1}}}',
                                  '{"format": 2, "files": {}}', "\xff\xfe"])
def test_a_damaged_manifest_raises_naming_it(tmp_path, text):
    tag = _tag(tmp_path)
    (tag / MANIFEST_FILE).write_bytes(text.encode("latin-1"))
    with pytest.raises(CheckpointError, match=MANIFEST_FILE):
        read_manifest(str(tag))


def test_no_manifest_reads_as_none(tmp_path):
    assert read_manifest(str(tmp_path)) is None


def test_a_save_on_a_full_disk_is_reported_as_enospc(tmp_path, monkeypatch):
    exc = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0")
    raise_if_disk_full(exc, str(tmp_path))  # room left: nothing to add, the caller re-raises exc
    full = types.SimpleNamespace(f_bavail=3, f_frsize=4096)
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    with pytest.raises(OSError) as info:
        raise_if_disk_full(exc, str(tmp_path))
    assert info.value.errno == errno.ENOSPC and "12288 bytes free" in str(info.value)
    assert str(tmp_path) in str(info.value) and "unexpected pos" in str(info.value)
