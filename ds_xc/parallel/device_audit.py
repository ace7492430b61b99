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
* with ``simulate_gpus=N`` (CPU only, ds_xc/parallel/device_simulation.py): torch.cuda's device
  functions answer for a host of N GPUs whose current device starts at 0 (a fresh process), and every
  group is judged as the NCCL group it would be on that host (except groups created with
  ``backend="gloo"``): the tensors stay on the CPU, marked where they would live on the *host* (made
  without a device, on "cpu", by ``.cpu()``, numpy); a host tensor handed to such a group is a finding.

``strict=True`` raises :class:`DeviceAuditError` at the first finding, before the collective runs
(benchmarks/gpu_check_multi.py turns it on around a 2-process job on a real GPU); otherwise
findings are recorded (``findings``, ``report()``). ``python -m ds_xc.parallel.device_audit
[--simulate-gpus N] [--strict] [--report PATH] SCRIPT ARGS...`` runs a script under the audit.

Limitations: see the simulation's (a tensor made before the audit started counts as on the device).
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

from ds_xc.parallel.device import local_rank_from_env
from ds_xc.parallel.device_simulation import GpuHostSimulation, is_host

__all__ = ["DeviceAudit", "DeviceAuditError", "Finding", "COLLECTIVES", "local_rank_from_env", "is_host"]

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
        self.simulation = GpuHostSimulation(simulate_gpus) if simulate_gpus else None
        self.simulate, self.strict = int(simulate_gpus), bool(strict)
        self.local_rank = local_rank_from_env() if local_rank is None else int(local_rank)
        self.findings: list = []
        self.audited = self.foreign = 0  # collectives judged; DeepSpeed's and the tests' own (not judged)
        self.sites: collections.Counter = collections.Counter()  # audited call sites
        self._saved: list = []
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
        if self.simulation is not None:
            self.simulation.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.simulation is not None:
            self.simulation.__exit__(*exc)
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)

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
        if self.simulation is not None:
            if not self.simulation.is_gloo(group) and is_host(t):
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
