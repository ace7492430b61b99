"""A host of N GPUs simulated on a CPU machine, for the communication-device audit
(ds_xc/parallel/device_audit.py; the rules it checks are explained there).

:class:`GpuHostSimulation` (a ``with`` block):

* ``torch.cuda.device_count/current_device/set_device/synchronize`` answer for N GPUs whose current
  device starts at 0, as in a fresh process (:class:`SimulatedGpus`); ds_xc's record of a binding is
  reset; DeepSpeed's CPU accelerator binds through the patched ``set_device``, as its CUDA accelerator
  does in the engine's constructor;
* the ``cuda:i`` devices the code is given stand for the CPU (factories and ``.to``/``.cuda()`` are
  redirected), counted as the rank's device;
* :class:`HostTags`, a ``TorchFunctionMode``, marks the tensors that would live on the *host* on a GPU
  machine: made by a factory without a device (``torch.zeros(3)``, ``torch.tensor([...])``, numpy),
  with the string ``"cpu"``, by ``.cpu()``, or with the ``device`` of such a tensor (``t.device`` of a
  host tensor returns a marked ``torch.device``); a result is a host tensor when all its tensor inputs
  are; ``nn.Parameter(t)`` and ``t.data = u`` keep the marks. Tensors made on a ``torch.device`` the code
  was given (``comm_device(group)``, ``x.device`` of a device tensor, the engine's device) count as on
  the rank's device;
* groups (and a world) created with ``backend="gloo"`` explicitly are recorded (:meth:`is_gloo`): on a
  GPU host they stay gloo, and CPU tensors are theirs; every other group would be NCCL there.

Limitations: provenance is by tag, so a tensor made before the simulation started counts as on the
device; the marked ``torch.device`` objects are kept alive while it runs (a bounded number).
"""
from __future__ import annotations

import collections
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ds_xc.parallel.device import reset_binding

__all__ = ["GpuHostSimulation", "SimulatedGpus", "HostTags", "is_host", "mark"]

_HOST = "_ds_xc_audit_host"  # the attribute marking a tensor that would live on the host
_DEVICE_ATTR = torch.Tensor.device  # its getter reaches __torch_function__ as Tensor.device.__get__


class SimulatedGpus:
    """torch.cuda's device functions for a host of ``count`` GPUs; the current device starts at 0."""

    def __init__(self, count: int):
        self.count, self.current = int(count), 0

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def synchronize(self, device=None) -> None:
        """Nothing queued: the simulated GPUs' work ran on the CPU already."""

    def set_device(self, device) -> None:
        index = device.index if isinstance(device, torch.device) else int(str(device).split(":")[-1])
        if index is None or not 0 <= index < self.count:
            raise RuntimeError(f"simulated CUDA: invalid device ordinal {device!r} (this host has {self.count})")
        self.current = index


class HostTags(TorchFunctionMode):
    """Marks the tensors that would be on the host on a GPU machine (module docstring)."""

    def __init__(self, keep: int = 100_000):
        super().__init__()
        self.devices: collections.deque = collections.deque(maxlen=keep)  # marked torch.device objects
        self.ids: set = set()

    _rank_cpu = torch.device("cpu")  # stands for the simulated GPU: a device object the code was given

    def _on_cpu_one(self, value):
        """A simulated GPU (cuda:i) becomes the CPU, as a device object that counts as the rank's."""
        if isinstance(value, torch.device) and value.type == "cuda" or isinstance(value, str) and \
                value.split(":")[0] == "cuda":
            return self._rank_cpu
        return value

    def _host_device(self) -> torch.device:
        d = torch.device("cpu")
        if len(self.devices) == self.devices.maxlen:
            self.ids.discard(id(self.devices[0]))
        self.devices.append(d)
        self.ids.add(id(d))
        return d

    def _is_host_target(self, device) -> bool:
        if isinstance(device, str):
            return device.split(":")[0] == "cpu"
        return isinstance(device, torch.device) and id(device) in self.ids

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_ATTR:  # t.device
            dev = func(*args, **kwargs)
            return self._host_device() if dev.type == "cpu" and is_host(args[0]) else dev
        if getattr(func, "__name__", "") == "__set__" and len(args) == 2 and isinstance(args[1], torch.Tensor):
            out = func(*args, **kwargs)  # t.data = new: t now lives where new does
            mark(args[0], is_host(args[1]))
            return out
        if getattr(func, "__name__", "") == "cuda" and args and isinstance(args[0], torch.Tensor):
            func, args, kwargs = torch.Tensor.to, (args[0], self._rank_cpu), {}  # t.cuda(): to the rank's device
        if "device" in kwargs:
            kwargs = dict(kwargs, device=self._on_cpu_one(kwargs["device"]))
        if getattr(func, "__name__", "") == "to":
            args = tuple(self._on_cpu_one(a) for a in args)
        out = func(*args, **kwargs)
        try:
            return self._tag(func, args, kwargs, out)
        except Exception:  # the audit never breaks the code it watches
            return out

    def _target(self, name: str, args, kwargs):
        """(has a device target, that target) of a factory or a ``.to``."""
        if "device" in kwargs:
            return True, kwargs["device"]
        if name == "to":
            for a in args[1:]:
                if isinstance(a, (str, torch.device)):
                    return True, a
                if isinstance(a, torch.Tensor):
                    return True, ("cpu" if is_host(a) else a.device)
        return False, None

    def _tag(self, func, args, kwargs, out):
        """Mark ``out`` (returned, or an alias of it: see below)."""
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if not outs:
            return out
        name = getattr(func, "__name__", "")
        inputs = [t for a in list(args) + list(kwargs.values())
                  for t in (a if isinstance(a, (tuple, list)) else (a,)) if isinstance(t, torch.Tensor)]
        has_target, target = self._target(name, args, kwargs)
        if name == "cpu":
            host = True
        elif has_target:
            host = target is None or self._is_host_target(target)
        elif name.endswith("_") and not name.endswith("__") or "out" in kwargs:
            return out  # in place: the tensor keeps its place
        elif inputs:
            host = all(is_host(t) for t in inputs)
        else:
            host = True  # a factory on the default device: the host
        if isinstance(out, torch.Tensor) and is_host(out) != host and any(out is t for t in inputs):
            out = out.view_as(out)  # .to(device) / .cpu() returned its input: on a GPU host it is a copy
            outs = [out]
        for t in outs:
            mark(t, host)
        return out


def mark(t: torch.Tensor, host: bool) -> None:
    """Mark ``t`` as a tensor that would live on the host (or clear the mark)."""
    if host:
        setattr(t, _HOST, True)
    elif getattr(t, _HOST, False):
        delattr(t, _HOST)


def is_host(t: torch.Tensor) -> bool:
    """True when the audit marked ``t`` as a tensor that would live on the host."""
    return bool(getattr(t, _HOST, False))


class GpuHostSimulation:
    """Simulate a host of ``count`` GPUs on the CPU inside a ``with`` block (module docstring)."""

    def __init__(self, count: int):
        if torch.cuda.is_available():
            raise ValueError(f"simulating {count} GPUs on a machine with CUDA: simulate on a CPU machine only")
        self.count = int(count)
        self._saved: list = []
        self._gloo: set = set()  # ids of groups created with backend="gloo" explicitly
        self._groups: list = []  # keeps those groups alive while their ids are used
        self._mode: Optional[HostTags] = None

    def __enter__(self) -> "GpuHostSimulation":
        gpus = SimulatedGpus(self.count)
        for name in ("device_count", "current_device", "set_device", "synchronize"):
            self._patch(torch.cuda, name, getattr(gpus, name))
        self._patch(dist, "new_group", self._wrap_new_group(dist.new_group))
        self._patch(dist, "init_process_group", self._wrap_init(dist.init_process_group))
        try:  # DeepSpeed's engine binds through its accelerator; the CPU accelerator's does nothing
            from deepspeed.accelerator import get_accelerator
            accel = get_accelerator()
            if accel.device_name() == "cpu":
                self._patch(accel, "set_device", lambda index: torch.cuda.set_device(int(index)))
        except ImportError:
            pass
        reset_binding()  # a fresh process: nothing bound yet
        self._patch_parameter()
        from_numpy = torch.from_numpy

        def host_from_numpy(array):  # not a torch function: the mode does not see it
            t = from_numpy(array)
            setattr(t, _HOST, True)
            return t
        self._patch(torch, "from_numpy", host_from_numpy)
        self._mode = HostTags()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)

    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def is_gloo(self, group) -> bool:
        """True for a group (or world) created with backend="gloo" explicitly: CPU tensors are its own."""
        return id(group) in self._gloo

    def _patch_parameter(self) -> None:
        """nn.Parameter(data) makes a new tensor object outside any torch function: it keeps data's mark."""
        original = torch.nn.Parameter.__dict__["__new__"]
        make = original.__func__ if isinstance(original, staticmethod) else original

        def __new__(cls, data=None, requires_grad=True):
            p = make(cls, data, requires_grad)
            if data is not None and is_host(data):
                setattr(p, _HOST, True)
            return p
        self._saved.append((torch.nn.Parameter, "__new__", original))
        torch.nn.Parameter.__new__ = staticmethod(__new__)

    def _wrap_init(self, original):
        def init_process_group(*args, **kwargs):
            out = original(*args, **kwargs)
            backend = kwargs.get("backend", args[0] if args else None)
            if str(backend or "").lower() == "gloo":  # a world asked for as gloo stays gloo on a GPU host
                self._gloo.add(id(dist.group.WORLD))
                self._groups.append(dist.group.WORLD)
            return out
        return init_process_group

    def _wrap_new_group(self, original):
        def new_group(*args, **kwargs):
            group = original(*args, **kwargs)
            backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
            if group is not None and str(backend or "").lower() == "gloo" and not _inside_copy_group():
                self._gloo.add(id(group))
                self._groups.append(group)
            return group
        return new_group


def _inside_copy_group() -> bool:
    """True inside ds_xc.parallel.groups.copy_group, whose explicit backend is the copied group's."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "copy_group" and frame.f_code.co_filename.endswith(
                os.path.join("parallel", "groups.py")):
            return True
        frame = frame.f_back
    return False
