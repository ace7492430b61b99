"""Timing on the device (ds_xc/cost/timing.py) and the link calibration's all-gathers: an NCCL
collective (and any CUDA kernel) returns when it is queued, so the clock must stop after the device
is synchronised. On the CPU a fake "GPU" stands in: its work runs on a thread (the stream) and
``torch.cuda.synchronize`` joins it; the all-gather of the calibration must take the stream's time,
not the launch's."""
import threading
import time

import pytest
import torch

import ds_xc.cost.calibrate as cal
from ds_xc.cost.timing import best_time, timed

WORK_S = 0.05


class _Stream:
    """Kernels queued on a thread; synchronize waits for them (torch.cuda.synchronize's contract)."""

    def __init__(self, monkeypatch):
        self.pending, self.syncs = [], 0
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def launch(self, seconds=WORK_S):
        t = threading.Thread(target=time.sleep, args=(seconds,))
        t.start()
        self.pending.append(t)

    def synchronize(self, device=None):
        self.syncs += 1
        while self.pending:
            self.pending.pop().join()


def test_timed_waits_for_the_device(monkeypatch):
    stream = _Stream(monkeypatch)
    gpu = torch.device("cuda", 0)
    assert timed(stream.launch, gpu) >= WORK_S
    assert stream.syncs == 2  # before the clock starts and before it stops
    assert best_time(stream.launch, gpu, repeats=2) >= WORK_S
    assert timed(lambda: None, torch.device("cpu")) < WORK_S and stream.syncs == 2 + 2 * 2  # the CPU: no sync


def test_link_all_gathers_are_timed_to_the_end_of_the_transfer(monkeypatch):
    stream = _Stream(monkeypatch)
    monkeypatch.setattr(cal, "gather_flat", lambda out, block, group=None: stream.launch())  # queued, returns
    monkeypatch.setattr(cal.dist, "barrier", lambda group=None: None)
    out, block = torch.zeros(8), torch.zeros(4)
    times = cal.all_gather_seconds(out, block, None, repeats=3, device=torch.device("cuda", 0))
    assert len(times) == 3 and min(times) >= WORK_S, times  # the transfer, not its launch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_timed_kernel_on_a_gpu_is_not_its_launch():
    x = torch.randn(4096, 4096, device="cuda")
    launch = time.perf_counter()
    for _ in range(20):
        x @ x
    launch = time.perf_counter() - launch
    torch.cuda.synchronize()
    assert timed(lambda: [x @ x for _ in range(20)], x.device) > launch
