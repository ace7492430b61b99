"""The rank's device on a host with several GPUs: bound from the launcher's local rank before any
collective, and checked where a collective is about to run.

NCCL opens a rank's communicator on the *current* CUDA device, and every process starts on cuda:0:
unless each rank makes its own GPU current first (``torch.cuda.set_device(LOCAL_RANK)``), the first
NCCL collective of every rank of a host lands on cuda:0 (NCCL's "Duplicate GPU detected" error, or
a hang). DeepSpeed binds the device only inside its engine's constructor, after ``ds_xc.initialize``
has already run its agreement collectives, and launch/grow.py and the tuner build no engine at all.
So ds_xc binds first, in one place (:func:`bind_device`), where users start: ``ds_xc.initialize``,
``ds_xc.engine.init_distributed`` (launch/train.py, grow.py, tune.py) and the examples. A library
user who starts torch.distributed on their own binds with :func:`bind_device` (or
``torch.cuda.set_device``); a collective that would run on a device that is not the rank's raises
:class:`DeviceBindingError` (:func:`check_bound`, called by ``comm_device`` and the head's input
check) instead of hanging.

The rank's device is the one ds_xc bound (or was told to bind: ``bind_device(index)`` for a layout
other than "local rank i uses GPU i"), else ``cuda:<local rank>`` from the launcher's environment
(:func:`local_rank_from_env`). Without GPUs (a CPU machine, a CPU build of torch) nothing is bound
and nothing is checked.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

log = logging.getLogger(__name__)

__all__ = ["bind_device", "check_bound", "local_rank_from_env", "rank_device", "gpu_count", "reset_binding",
           "DeviceBindingError", "LOCAL_RANK_VARIABLES"]

# the launchers' names for a process's rank on its host: torchrun / DeepSpeed, OpenMPI, MPICH, MVAPICH, Slurm
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                        "SLURM_LOCALID")
_BOUND: list = [None]  # the device index ds_xc bound in this process (None: none yet)


class DeviceBindingError(RuntimeError):
    """This rank's GPU is not (or cannot be) the current device where a collective needs it."""


def local_rank_from_env() -> Optional[int]:
    """This process's rank on its host from the launcher's environment (:data:`LOCAL_RANK_VARIABLES`,
    the first set), or None when no launcher said."""
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise DeviceBindingError(f"{name}={value!r}: expected the process's rank on its host, an integer >= 0")
            return int(value)
    return None


def gpu_count() -> int:
    """CUDA devices visible to this process (0 on a CPU machine or with a CPU build of torch)."""
    return torch.cuda.device_count()


def _source() -> str:
    for name in LOCAL_RANK_VARIABLES:
        if os.environ.get(name, "").strip():
            return f"{name}={os.environ[name].strip()}"
    return "no local rank in the environment"


def bind_device(local_rank: Optional[int] = None) -> torch.device:
    """Make this rank's GPU the current device and return it (the CPU device without GPUs).

    ``local_rank``: the GPU index (default: the launcher's local rank, else 0; cuda:0 when the process
    sees one GPU, as under a scheduler that gives each rank its own ``CUDA_VISIBLE_DEVICES``). Call it before the
    first collective; ``ds_xc.initialize``, ``ds_xc.engine.init_distributed`` and launch/ do. Binding
    again to the same device is a no-op; logged once per binding."""
    count = gpu_count()
    if count == 0:
        log.info("rank device: no GPU visible, the CPU (nothing to bind)")
        return torch.device("cpu")
    env = local_rank_from_env()
    index = int(local_rank) if local_rank is not None else (0 if env is None else env)
    if local_rank is None and count == 1:  # one GPU visible to this process (CUDA_VISIBLE_DEVICES per rank)
        index = 0
    if not 0 <= index < count:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceBindingError(
            f"{'local_rank' if local_rank is not None else _source()}: GPU {index} does not exist on this host, "
            f"which shows {count} GPU(s) (CUDA_VISIBLE_DEVICES={shown!r}); allowed: 0..{count - 1}. Start at most "
            f"{count} rank(s) per host (deepspeed --num_gpus {count}, torchrun --nproc_per_node {count})")
    if _BOUND[0] == index and torch.cuda.current_device() == index:
        return torch.device("cuda", index)
    if env is None and local_rank is None and count > 1:
        log.warning("rank device: %d GPUs on this host and no local rank in the environment (%s): binding cuda:0; "
                    "pass the launcher's local rank (ds_xc.bind_device(i))",
                    count, ", ".join(LOCAL_RANK_VARIABLES))
    torch.cuda.set_device(index)
    _BOUND[0] = index
    log.info("rank device: bound cuda:%d (%s, %d GPU(s) on this host) before the first collective", index,
             f"local_rank={index}" if local_rank is not None else _source(), count)
    return torch.device("cuda", index)


def reset_binding() -> None:
    """Forget ds_xc's binding (tests, and the device audit's simulation of a fresh process)."""
    _BOUND[0] = None


def rank_device() -> Optional[int]:
    """The GPU index this rank must use: the one ds_xc bound, else its local rank's (when the host has
    that GPU); None without GPUs, on a one-GPU host, or when neither is known."""
    count = gpu_count()
    if count == 0:
        return None
    if _BOUND[0] is not None:
        return _BOUND[0]
    env = local_rank_from_env()
    return env if env is not None and count > 1 and env < count else None


def check_bound(what: str = "a collective") -> None:
    """Raise :class:`DeviceBindingError` when the current CUDA device is not this rank's (see
    :func:`rank_device`); ``what`` names the collective about to run. A no-op without GPUs."""
    want = rank_device()
    if want is None:
        return
    current = torch.cuda.current_device()
    if current != want:
        raise DeviceBindingError(
            f"{what} would run on cuda:{current}, but this rank's device is cuda:{want} "
            f"({'bound by ds_xc' if _BOUND[0] is not None else _source()}): NCCL would open this rank's communicator "
            f"on another rank's GPU. Bind the device before the first collective: ds_xc.bind_device() (or "
            f"torch.cuda.set_device({want})); ds_xc.initialize and launch/ do it")
