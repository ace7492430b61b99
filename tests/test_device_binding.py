"""Binding each rank to its GPU before the first collective (ds_xc/parallel/device.py), on the CPU with
torch.cuda's device functions patched to a host of 8 GPUs:

* ``bind_device`` makes cuda:LOCAL_RANK current (the launcher's equivalents too), logs it, refuses a
  local rank the host has no GPU for (naming the variable, its value and the allowed range), and does
  nothing without GPUs;
* ``check_bound`` / ``comm_device`` raise DeviceBindingError on a rank whose current device is not its
  own where the group is NCCL (a library user's own process group), and pass once it is bound
  (also to a GPU of the user's choosing);
* ``init_distributed`` binds before torch.distributed starts, ``initialize`` before its agreement;
* the head's input check on an NCCL group raises on every rank at once (unbound ranks: the binding
  error; a head built on another device than the group's: naming both) instead of hanging;
* the file tools (reshard, export) say they bind nothing.
"""
import logging

import pytest
import torch
import torch.distributed as dist

import ds_xc
from ds_xc.parallel import device as dev
from ds_xc.parallel.device import DeviceBindingError, bind_device, check_bound, local_rank_from_env

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="patches torch.cuda on a CPU machine")


class _Host:
    """torch.cuda's device functions for a host of ``count`` GPUs (current device 0, as a fresh process)."""

    def __init__(self, monkeypatch, count=8):
        self.current, self.count = 0, count
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(dev, "_BOUND", [None])
        for name in dev.LOCAL_RANK_VARIABLES:
            monkeypatch.delenv(name, raising=False)

    def set_device(self, index):
        assert 0 <= int(index) < self.count
        self.current = int(index)


def test_bind_device_makes_the_local_rank_current_and_logs_it(monkeypatch, caplog):
    host = _Host(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with caplog.at_level(logging.INFO, logger="ds_xc.parallel.device"):
        assert bind_device() == torch.device("cuda", 3)
    assert host.current == 3 and ds_xc.bind_device is bind_device
    assert "bound cuda:3 (LOCAL_RANK=3, 8 GPU(s) on this host) before the first collective" in caplog.text
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "5")  # mpirun's name for it
    assert bind_device() == torch.device("cuda", 5) and host.current == 5


def test_bind_device_refuses_a_local_rank_without_a_gpu(monkeypatch):
    _Host(monkeypatch, count=4)
    monkeypatch.setenv("LOCAL_RANK", "6")
    with pytest.raises(DeviceBindingError, match=r"LOCAL_RANK=6: GPU 6 does not exist on this host, which shows "
                                                 r"4 GPU\(s\).*allowed: 0\.\.3"):
        bind_device()
    one = _Host(monkeypatch, count=1)  # a scheduler that shows each rank its own GPU only
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert bind_device() == torch.device("cuda", 0) and one.current == 0
    monkeypatch.setenv("LOCAL_RANK", "two")
    with pytest.raises(DeviceBindingError, match="LOCAL_RANK='two'"):
        local_rank_from_env()


def test_without_gpus_nothing_is_bound_or_checked(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert bind_device() == torch.device("cpu")
    check_bound()  # no GPU: nothing to check


def test_check_bound_names_the_devices(monkeypatch):
    host = _Host(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(DeviceBindingError, match=r"an all-reduce would run on cuda:0, but this rank's device is "
                                                 r"cuda:2 \(LOCAL_RANK=2\).*ds_xc.bind_device\(\)"):
        check_bound("an all-reduce")
    host.set_device(2)
    check_bound()
    bind_device(6)  # a user's own layout: their choice is the rank's device from now on
    check_bound()
    host.set_device(2)
    with pytest.raises(DeviceBindingError, match="cuda:6 \\(bound by ds_xc\\)"):
        check_bound()


def test_comm_device_of_an_nccl_group_checks_the_binding(monkeypatch):
    from ds_xc.parallel.groups import comm_device
    host = _Host(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "4")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    group = object()  # a user's own NCCL group
    with pytest.raises(DeviceBindingError, match="a collective on an NCCL group would run on cuda:0"):
        comm_device(group)
    host.set_device(4)
    assert comm_device(group) == torch.device("cuda", 4)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    host.set_device(0)
    assert comm_device(group) == torch.device("cpu")  # gloo: CPU tensors, nothing to bind


def test_init_distributed_binds_before_torch_distributed_starts(monkeypatch):
    import deepspeed
    from ds_xc.engine import init_distributed
    from ds_xc.parallel import groups
    host = _Host(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "7")
    monkeypatch.setenv("RANK", "7")
    for name, value in (("WORLD_SIZE", "8"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)  # a launcher's whole set (ds_xc refuses RANK without them)
    seen = []
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.append(torch.cuda.current_device()))
    monkeypatch.setattr(groups, "_COMM_TIMEOUT_S", [None])
    assert init_distributed(timeout_s=60.0) == torch.device("cuda", 7)
    assert seen == [7] and host.current == 7


def _initialize_binds_first(rank, world):
    """ds_xc.initialize on a process group the user started, 8 GPUs simulated: the agreement's
    collectives run on the bound device (the audit would find them otherwise)."""
    from ds_xc.parallel.device_audit import DeviceAudit
    with DeviceAudit(simulate_gpus=8) as audit:
        body = torch.nn.Linear(3, 4)
        xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1), config={
            "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,
            "extreme_classification": {"num_classes": 7, "embedding_dim": 4}})
        first = next(iter(audit.sites))
        current = torch.cuda.current_device()  # the simulated host's
    return current, audit.report(), first, str(xc.head.weight.device)


def test_initialize_binds_before_its_agreement(pools):
    for rank, (current, report, first, _) in enumerate(pools(2).run(_initialize_binds_first)):
        assert report["findings"] == 0, report["distinct"]
        assert "agree" in first  # the first collective is the config's agreement, on the bound device
        assert current == rank  # LOCAL_RANK is the rank in the pool


def _head_on_nccl(rank, world, bind):
    """The head's input check on a group whose backend says NCCL (8 GPUs simulated, tensors on the CPU)."""
    from ds_xc.parallel.device_audit import DeviceAudit
    from tests.dist_pool import catch
    real = dist.get_backend
    with DeviceAudit(simulate_gpus=8):
        if bind:
            bind_device()
        head = ds_xc.ClassParallelHead(4, 9, device="cpu")
        dist.get_backend = lambda group=None: "nccl"
        try:
            return catch(lambda: head(torch.randn(3, 4), torch.randint(0, 9, (3,))))
        finally:
            dist.get_backend = real


@pytest.mark.parametrize("world", [2, 3])
def test_head_on_an_unbound_nccl_group_raises_at_once(pools, world):
    for rank, (cls, msg) in enumerate(pools(world).run(_head_on_nccl, False)):
        if rank == 0:  # local rank 0 is on cuda:0 by accident; its head is on the CPU, not the group's device
            assert cls == "ValueError" and "the head's weight is on cpu" in msg and "cuda:0" in msg, msg
        else:
            assert cls == "DeviceBindingError" and f"cuda:0, but this rank's device is cuda:{rank}" in msg, msg
    for rank, (cls, msg) in enumerate(pools(world).run(_head_on_nccl, True)):
        assert cls == "ValueError" and f"run on cuda:{rank}" in msg and "device='cuda:" in msg, msg


def test_file_tools_bind_nothing(caplog, monkeypatch):
    from ds_xc.checkpoint import refuse_under_launcher
    monkeypatch.setenv("WORLD_SIZE", "1")
    with caplog.at_level(logging.INFO, logger="ds_xc.checkpoint.files"):
        refuse_under_launcher("export")
    assert "export: file work in one process on the CPU: no process group, no collective, no GPU bound" in caplog.text
