"""The communication-device audit itself (ds_xc/parallel/device_audit.py): which tensors it marks as
host tensors, that it finds a collective on an unbound device and a host tensor handed to a simulated
NCCL group, that a CPU tensor handed to a (faked) NCCL group is a finding without simulation, that
strict mode raises before the collective runs, and that DeepSpeed's and the tests' own collectives are
counted but not judged. tests/test_device_audit_dist.py runs it over ds_xc's jobs."""
import pytest
import torch
import torch.distributed as dist

from ds_xc.parallel.device_audit import DeviceAudit, DeviceAuditError, is_host, local_rank_from_env

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="simulates GPUs on a CPU machine")


def test_host_marks_follow_where_a_tensor_would_live():
    dev = torch.device("cpu")  # a device object the code was given: the rank's device
    with DeviceAudit(simulate_gpus=8):
        made = {"no device": torch.zeros(3), "list": torch.tensor([1.0, 2.0]),
                "string cpu": torch.ones(2, device="cpu"),
                "given device": torch.zeros(3, device=dev), "numpy": torch.from_numpy(torch.ones(2).numpy())}
        on_dev = made["given device"]
        host = made["no device"]
        derived = {"host.double()": host.double(), "dev.cpu()": on_dev.cpu(), "host.to(dev)": host.to(dev),
                   "dev + host": on_dev + host, "host * 2": host * 2, "zeros(device=host.device)":
                   torch.zeros(2, device=host.device), "zeros(device=dev.device)": torch.zeros(2, device=on_dev.device),
                   "host.view": host.view(3, 1), "dev.new_zeros": on_dev.new_zeros(4),
                   "Parameter(host)": torch.nn.Parameter(host.clone()), "host.data": host.data,
                   "stack(dev, host)": torch.stack([on_dev, host])}
        in_place = on_dev.clone()
        in_place.add_(host)  # a device tensor stays one
        marks = {k: is_host(v) for k, v in {**made, **derived, "dev.add_(host)": in_place}.items()}
    want = {"no device": True, "list": True, "string cpu": True, "given device": False, "numpy": True,
            "host.double()": True, "dev.cpu()": True, "host.to(dev)": False, "dev + host": False, "host * 2": True,
            "zeros(device=host.device)": True, "zeros(device=dev.device)": False, "host.view": True,
            "dev.new_zeros": False, "Parameter(host)": True, "host.data": True, "stack(dev, host)": False,
            "dev.add_(host)": False}
    assert marks == want


def test_simulated_gpus_start_unbound_and_bind():
    with DeviceAudit(simulate_gpus=4):
        assert torch.cuda.device_count() == 4 and torch.cuda.current_device() == 0
        torch.cuda.set_device(3)
        assert torch.cuda.current_device() == 3
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.cuda.set_device(4)
    assert torch.cuda.device_count() == 0  # restored


def test_local_rank_from_the_launchers_environment(monkeypatch):
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                 "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    assert local_rank_from_env() is None
    monkeypatch.setenv("SLURM_LOCALID", "5")
    assert local_rank_from_env() == 5
    monkeypatch.setenv("LOCAL_RANK", "2")  # torchrun's and DeepSpeed's wins
    assert local_rank_from_env() == 2


def _audited_calls(rank, world, strict, bind):
    """A ds_xc collective (agree) with a device tensor, one with a host tensor (all_reduce of a
    tensor made without a device, called from ds_xc code), and a test's own barrier."""
    from ds_xc.parallel.agree import agree
    from ds_xc.parallel.collectives import gather_stacked
    group = dist.group.WORLD
    audit = DeviceAudit(simulate_gpus=8, strict=strict)
    raised = None
    with audit:
        if bind:
            torch.cuda.set_device(rank)
        dist.barrier(group=group)  # the test's own: counted as foreign
        try:
            agree(3, "a value", group)
            gather_stacked(torch.zeros(2), group)  # a host tensor into ds_xc's all-gather
        except DeviceAuditError as exc:
            raised = str(exc)
    return audit.report(), raised


@pytest.mark.parametrize("world", [2, 3])
def test_findings_on_unbound_ranks_and_host_tensors(pools, world):
    res = pools(world).run(_audited_calls, False, False)
    for rank, (rep, raised) in enumerate(res):
        kinds = {(f["kind"], f["site"].split(":")[0]) for f in rep["distinct"]}
        assert raised is None and rep["foreign"] == 1
        assert ("host_tensor", "ds_xc/parallel/collectives.py") in kinds
        # rank 0's device is cuda:0, the current one of a fresh process: bound by accident
        assert (("unbound", "ds_xc/parallel/collectives.py") in kinds) == (rank > 0)
    bound = pools(world).run(_audited_calls, False, True)
    assert all({f["kind"] for f in rep["distinct"]} == {"host_tensor"} for rep, _ in bound)


@pytest.mark.parametrize("world", [2, 3])
def test_strict_mode_raises_before_the_collective(pools, world):
    res = pools(world).run(_audited_calls, True, True)
    for rep, raised in res:
        assert raised is not None and "host_tensor" in raised and "collectives.py" in raised
        assert rep["findings"] == 1  # the agreement passed; the host tensor stopped the gather


def _fake_nccl(rank, world):
    """Without simulation: a group whose backend says NCCL and a CPU tensor is a wrong-device finding."""
    from ds_xc.parallel.collectives import gather_stacked
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        with DeviceAudit() as audit:
            try:
                gather_stacked(torch.zeros(2), dist.group.WORLD)
            except Exception:  # gloo runs it; only the finding matters
                pass
    finally:
        dist.get_backend = real
    return audit.report()


def test_cpu_tensor_to_an_nccl_group_is_a_finding(pools):
    for rep in pools(2).run(_fake_nccl):
        assert [f["kind"] for f in rep["distinct"]] == ["wrong_device"]
