"""The communication-device audit: every collective ds_xc issues gets its tensors on its group's
communication device, on a rank whose device was bound before its first collective.

Why: on a host with several GPUs each rank must make its GPU current (``torch.cuda.set_device``)
before its first NCCL collective (NCCL opens its communicator on the current device: every
rank on cuda:0 is NCCL's duplicate-GPU error or a hang), and an NCCL group moves CUDA tensors
only (a CPU tensor fails, "No backend type associated with device type cpu"). CI has neither
GPUs nor NCCL, so :class:`DeviceAudit` checks both rules on the CPU:

* a recording wrapper around the ``torch.distributed`` collectives (module attributes, looked up
  at call time by the library, ``ds_xc.parallel.collectives``' flat ones included). A call is
  audited when the nearest caller outside torch is a file of ds_xc/,
  ops/ (``ds_xc_ops``), launch/, examples/ or benchmarks/: DeepSpeed's and the tests' own
  collectives are counted apart and not judged;
* **bound**: when the host has GPUs (or simulates them), ``torch.cuda.current_device()`` equals
  the rank's local device (``LOCAL_RANK``, or the launcher's equivalent) at every audited
  collective, object collectives and barriers included (they run on the current device with NCCL);
* **device**: every tensor of the call is on the group's communication device. On a real GPU
  with NCCL that is ``cuda:<local rank>``; a gloo group takes CPU tensors or the rank's own GPU's
  (never another GPU's);
* with ``simulate_gpus=N`` (CPU only): ``torch.cuda.device_count/current_device/set_device`` are
  patched to a host of N GPUs whose current device starts at 0 (as in a fresh process; ``cuda:i``
  devices the code is given stand for the CPU, counted as the rank's device), DeepSpeed's
  CPU accelerator binds through the patched ``set_device`` (as its CUDA accelerator does in the
  engine's constructor), and every group is judged as the NCCL group it would be on that host,
  except groups created with ``backend="gloo"`` explicitly. The tensors stay on the CPU; a
  ``TorchFunctionMode`` marks the tensors that would be on the *host* on a GPU machine: made by a
  factory without a device (``torch.zeros(3)``, ``torch.tensor([...])``, numpy), with the string
  ``"cpu"``, by ``.cpu()``, or with the ``device`` of such a tensor (``t.device`` of a host tensor
  returns a marked ``torch.device``); a result is a host tensor when all its tensor inputs are. A
  host tensor handed to a simulated NCCL group is a finding. Tensors made on a ``torch.device``
  the code was given (``comm_device(group)``, ``x.device`` of a device tensor, the engine's device)
  count as on the rank's device.

``strict=True`` raises :class:`DeviceAuditError` at the first finding, before the collective runs
(benchmarks/gpu_check_multi.py turns it on around a 2-process job on a real GPU); otherwise
findings are recorded (``findings``, ``report()``). ``python -m ds_xc.parallel.device_audit
[--simulate-gpus N] [--strict] [--report PATH] SCRIPT ARGS...`` runs a script under the audit.

Limitations: provenance is by tag, so a tensor made where the audit was not yet running counts
as on the device; the ``torch.device`` objects of marked tensors are kept alive while the audit
runs (a bounded number).
"""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ds_xc.parallel.device import local_rank_from_env, reset_binding

__all__ = ["DeviceAudit", "DeviceAuditError", "Finding", "COLLECTIVES", "local_rank_from_env"]

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
)
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                       "barrier", "monitored_barrier")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OURS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("ds_xc", "ops", "launch", "examples", "benchmarks"))
_SKIP = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, os.path.abspath(__file__))
_HOST = "_ds_xc_audit_host"  # the attribute marking a tensor that would live on the host
_DEVICE_ATTR = torch.Tensor.device  # its getter reaches __torch_function__ as Tensor.device.__get__


class DeviceAuditError(RuntimeError):
    """A collective would run on a device that is not its group's (strict mode)."""


@dataclass
class Finding:
    """One breach: ``kind`` "unbound" (the rank's device not current), "host_tensor" (a host tensor
    handed to an NCCL group) or "wrong_device" (a tensor on another device than the group's);
    ``op`` the collective, ``site`` the ds_xc caller ("path:line function"), ``detail`` the values."""
    kind: str
    op: str
    site: str
    detail: str


class _SimulatedGpus:
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


class _HostTags(TorchFunctionMode):
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
            _mark(args[0], is_host(args[1]))
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
            _mark(t, host)
        return out


def _mark(t: torch.Tensor, host: bool) -> None:
    if host:
        setattr(t, _HOST, True)
    elif getattr(t, _HOST, False):
        delattr(t, _HOST)


def is_host(t: torch.Tensor) -> bool:
    """True when the audit marked ``t`` as a tensor that would live on the host."""
    return bool(getattr(t, _HOST, False))


def _tensors(op: str, args, kwargs) -> list:
    if op in _OBJECT_COLLECTIVES:
        return []
    out = []
    for a in list(args) + [v for k, v in kwargs.items() if k != "group"]:
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


class DeviceAudit:
    """Audit every collective issued inside the ``with`` block (module docstring).

    ``simulate_gpus``: simulate that many GPUs per host on a CPU machine (0: the real devices).
    ``local_rank``: the rank's local device index (default: from the launcher's environment).
    ``strict``: raise at the first finding instead of recording it."""

    def __init__(self, simulate_gpus: int = 0, strict: bool = False, local_rank: Optional[int] = None):
        if simulate_gpus and torch.cuda.is_available():
            raise ValueError(f"DeviceAudit: simulate_gpus={simulate_gpus} on a machine with CUDA; simulate on a "
                             "CPU machine only (0: audit the real devices)")
        self.simulate, self.strict = int(simulate_gpus), bool(strict)
        self.local_rank = local_rank_from_env() if local_rank is None else int(local_rank)
        self.findings: list = []
        self.audited = self.foreign = 0  # collectives judged; DeepSpeed's and the tests' own (not judged)
        self.sites: collections.Counter = collections.Counter()  # audited call sites
        self._saved: list = []
        self._gloo: set = set()  # ids of groups created with backend="gloo" explicitly (simulation)
        self._groups: list = []  # keeps those groups alive while their ids are used
        self._mode: Optional[_HostTags] = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- install / remove
    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> "DeviceAudit":
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                self._patch(dist, name, self._wrap(name, original))
        if self.simulate:
            self._start_simulation()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)

    def _start_simulation(self) -> None:
        gpus = _SimulatedGpus(self.simulate)
        for name in ("device_count", "current_device", "set_device", "synchronize"):
            self._patch(torch.cuda, name, getattr(gpus, name))
        self._patch(dist, "new_group", self._wrap_new_group(dist.new_group))
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
        self._mode = _HostTags()
        self._mode.__enter__()

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

    def _wrap_new_group(self, original):
        def new_group(*args, **kwargs):
            group = original(*args, **kwargs)
            backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
            if group is not None and str(backend or "").lower() == "gloo" and not _inside_copy_group():
                self._gloo.add(id(group))
                self._groups.append(group)
            return group
        return new_group

    def _wrap(self, op: str, original):
        def audited(*args, **kwargs):
            site = _caller()
            if site is None:
                self.foreign += 1
            else:
                self._check(op, site, args, kwargs)
            return original(*args, **kwargs)
        audited.__wrapped__ = original
        return audited

    # ---------------------------------------------------------------- the checks
    def _expected_index(self) -> Optional[int]:
        count = torch.cuda.device_count()
        if count == 0 or self.local_rank is None or self.local_rank >= count:
            return None
        return self.local_rank

    def _check(self, op: str, site: str, args, kwargs) -> None:
        with self._lock:
            self.audited += 1
            self.sites[site] += 1
        want = self._expected_index()
        if want is not None and torch.cuda.current_device() != want:
            self._found("unbound", op, site, f"the current device is cuda:{torch.cuda.current_device()}, this rank's "
                        f"is cuda:{want} (local rank {self.local_rank}): torch.cuda.set_device was not called "
                        "before this collective")
        group = kwargs.get("group")
        for t in _tensors(op, args, kwargs):
            problem = self._device_problem(t, group, want)
            if problem:
                self._found(problem[0], op, site, problem[1])

    def _device_problem(self, t: torch.Tensor, group, want: Optional[int]):
        if self.simulate:
            if id(group) not in self._gloo and is_host(t):
                return ("host_tensor", f"a {tuple(t.shape)} {t.dtype} tensor on the host handed to a group that is "
                        f"NCCL on a GPU host (its device would be cuda:{want})")
            return None
        backend = str(dist.get_backend(group)).lower() if dist.is_initialized() else ""
        if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
            if t.device.type != "cuda" or (want is not None and t.device.index != want):
                return ("wrong_device", f"a {tuple(t.shape)} {t.dtype} tensor on {t.device} handed to an NCCL group "
                        f"(its device is {_current()})")
        elif t.device.type == "cuda" and want is not None and t.device.index != want:
            return ("wrong_device", f"a tensor on {t.device} handed to a {backend or 'gloo'} group on the rank of "
                    f"cuda:{want}")
        return None

    def _found(self, kind: str, op: str, site: str, detail: str) -> None:
        finding = Finding(kind, op, site, detail)
        with self._lock:
            self.findings.append(finding)
        if self.strict:
            raise DeviceAuditError(f"{op} at {site}: {kind}: {detail}")

    # ---------------------------------------------------------------- results
    def distinct(self) -> list:
        """The findings once per (kind, op, site), in the order first seen."""
        seen, out = set(), []
        for f in self.findings:
            key = (f.kind, f.op, f.site)
            if key not in seen:
                seen.add(key)
                out.append(f)
        return out

    def report(self) -> dict:
        """Plain data: counts, every distinct finding, the audited call sites."""
        return {"audited": self.audited, "foreign": self.foreign, "findings": len(self.findings),
                "distinct": [asdict(f) for f in self.distinct()], "sites": dict(self.sites),
                "simulated_gpus": self.simulate, "local_rank": self.local_rank}


def _current() -> str:
    """The current CUDA device, for messages ("no CUDA device" without one)."""
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.device_count() else "no CUDA device"


def _caller() -> Optional[str]:
    """"path:line function" of the nearest caller outside torch and this module, when it is a file of
    ds_xc/, ops/, launch/, examples/ or benchmarks/; None for anyone else's (DeepSpeed's, the tests')."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIP[0]) and path != _SKIP[1]:
            if path.startswith(_OURS):
                return f"{os.path.relpath(path, _ROOT)}:{frame.f_lineno} {frame.f_code.co_name}"
            return None
        frame = frame.f_back
    return None


def _inside_copy_group() -> bool:
    """True inside ds_xc.parallel.groups.copy_group, whose explicit backend is the copied group's."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "copy_group" and frame.f_code.co_filename.endswith(
                os.path.join("parallel", "groups.py")):
            return True
        frame = frame.f_back
    return False


def main(argv=None) -> int:
    """Run a script under the audit (``python -m ds_xc.parallel.device_audit --help``)."""
    import argparse
    import runpy
    p = argparse.ArgumentParser(description="run SCRIPT under the communication-device audit")
    p.add_argument("--simulate-gpus", type=int, default=0, help="GPUs per host to simulate on a CPU machine")
    p.add_argument("--strict", action="store_true", help="raise at the first finding")
    p.add_argument("--report", help="write the audit's report (JSON) here at the end ({rank}: the RANK variable)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    sys.argv = [a.script] + list(a.args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(a.script)))
    audit = DeviceAudit(simulate_gpus=a.simulate_gpus, strict=a.strict)
    code = 0
    try:
        with audit:
            runpy.run_path(a.script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        if a.report:
            with open(a.report.format(rank=os.environ.get("RANK", "0")), "w") as fh:
                json.dump(audit.report(), fh, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
