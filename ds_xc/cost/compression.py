"""Time of one step's gradient reduction, dense vs compressed, and whether compression pays.

Why: compression trades compute (the selection, per element, every step) for bytes. On a slow
link the bytes win; on a fast one, or with a small model, the selection costs more than the
dense all-reduce it replaces. This module turns the transport's byte counts
(ds_xc/compression/transport.py) and the alpha-beta ring model of :mod:`ds_xc.cost.comm` into
seconds, so that a configuration can be judged before it runs. It sits on the cost floor and
does not import ds_xc.compression (tests/test_layering.py); the wire constants it repeats from
there (:data:`BLOCK`) are checked equal by tests/test_compression_pays.py.

Legend: N compressed elements, P ranks of the exchange, d density, beta the link's bandwidth
(bits/s), alpha its latency per ring step, v bytes of a value on the wire (4 fp32, 2 bf16),
H = 4 ceil(N / 65536) the bytes of the transport's block-count header.

    dense          2 (P-1) (alpha + 4N / (P beta))                   ring all-reduce of 4N bytes
                   + c_dense N
    topk,          (P-1) (alpha + H / beta)                          header all-gather
    bayes_prior    + (P-1) (alpha + m (2 + v) / beta),  m = d N      payload all-gather (pairs)
                   + (c_dense + c_method) N
    randomk        2 (P-1) (alpha + v m / (P beta)),  m = N (1 - e^-d)   values all-reduce (the
                   + (c_dense + c_method) N                          draws with replacement, deduplicated)

(beta in bytes/s inside the formulas.) c_dense is the per-element compute of the dense path
(flattening, gloo's reduction and copies, the kernel's socket copies), which the compressed path
pays too (its bucket copy, residual, decode, write-back); c_method is the extra per-element cost
of the method's selection. Both are :class:`Calibration` fields, measured on this project's
2-core CPU machine (benchmarks/compression_pays.py --calibrate, docs/compression.md "When
compression pays"); pass your own for another machine. Not modelled: bayes_prior's statistics
sync (a 4 x bins-byte all-reduce per tensor every stats_sync_interval steps), the spread of its
per-rank counts (the payload is padded to the largest: measured +4% bytes), the hierarchy, and
overlap of the reduction with the backward.

Per element and with alpha = 0, the two are equal at the link speed (Gbit/s, c in ns)

    B* = (P-1) (64 / P - 8 (2 + v) d) / c_method           topk, bayes_prior
    B* = 2 (P-1) / P (32 - 8 v (1 - e^-d)) / c_method       randomk

(:func:`break_even_gbit`): compression pays below B*, not above; N drops out, so the model size
matters only through the latency terms and the header.

Under ZeRO stage 1 (``zero_stage=1``) both sides change. DeepSpeed's dense reduction is then
the ZeRO optimizer's (a reduce-scatter of the 4N gradient bytes; gloo runs it as an all-reduce, see
:mod:`ds_xc.cost.comm`), and every step ends with an all-gather of the updated fp32 parameters, 4N
bytes, compressed or not (ds_xc/compression/zero.py: the compressed mean feeds DeepSpeed's own
step). Each side gains that all-gather, (P-1) (alpha + 4N / (P beta)), so the speedup is bounded
by (t_dense + t_gather) / t_gather, 2 to 3x for large N, however slow the link. B* stays where it
is on gloo (the same time added to both sides) and halves about with NCCL, whose reduce-scatter moves
half an all-reduce's bytes.

Verdict: speedup = t_dense / t_compressed; ``pays`` at >= :data:`PAYS_AT` (1.25), ``does not pay``
below :data:`BREAK_EVEN` (1.0), ``marginal`` between.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ds_xc.cost.comm import Collective, Link, collective_time, wire_bytes

__all__ = ["Calibration", "DEFAULT_CALIBRATION", "ReductionTime", "Verdict", "reduction_collectives",
           "reduction_time", "verdict", "break_even_gbit", "METHODS", "PAYS_AT", "BREAK_EVEN", "DEFAULT_LATENCY_S",
           "BLOCK"]

METHODS = ("topk", "randomk", "bayes_prior")
PAYS_AT = 1.25  # speedup from which compression "pays"
BREAK_EVEN = 1.0  # below it compression "does not pay"
DEFAULT_LATENCY_S = 50e-6  # per ring step: a TCP message between hosts on one switch
BLOCK = 1 << 16  # elements per block of the transport's header (ds_xc.compression.transport.BLOCK)
_INDEX_BYTES = 2  # a 16-bit offset inside its block


@dataclass(frozen=True)
class Calibration:
    """Compute per element in nanoseconds (fp32 gradient, 1 thread per rank).

    Defaults: the 2-core CPU machine of benchmarks/results/compression_pays_calibration.md, fitted
    to the reductions of 10^7 elements measured over tc-shaped 1 Gbit/s and 100 Mbit/s links
    (compression_netns*.md, clean revision b0c43ca, an otherwise idle machine) as (t_measured -
    the model's transfer) / N. ``dense_ns``: the dense path beyond its transfer (1 Gbit/s:
    366.7 ms - 320.1 ms = 4.66 ns); ``<method>_ns``: what the compressed path costs per element
    beyond ``dense_ns``, the mean over both links (bayes_prior 8.98, topk 24.0; randomk -0.05,
    zero within the noise: 0.5 keeps a cost for its draws). Runs on these shared cores while
    other jobs ran gave up to 2x more. For another machine (a GPU selects far faster) pass your own."""
    dense_ns: float = 4.7
    topk_ns: float = 24.0
    randomk_ns: float = 0.5
    bayes_prior_ns: float = 9.0

    def __post_init__(self):
        for name in ("dense_ns",) + tuple(f"{m}_ns" for m in METHODS):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Calibration.{name}: got {value!r}; must be a finite number >= 0")

    def method_ns(self, method: str) -> float:
        """The extra compute per element of ``method`` (see the class docstring)."""
        _check_method(method)
        return float(getattr(self, f"{method}_ns"))


DEFAULT_CALIBRATION = Calibration()


@dataclass(frozen=True)
class ReductionTime:
    """Seconds of one reduction: ``comm_s`` on the link, ``compute_s`` on the CPU; bytes this rank sends."""
    comm_s: float
    compute_s: float
    bytes_sent: float

    @property
    def total_s(self) -> float:
        return self.comm_s + self.compute_s


@dataclass(frozen=True)
class Verdict:
    """Whether ``method`` at ``density`` pays against the dense all-reduce (see the module docstring)."""
    numel: int
    world_size: int
    link_gbit_per_s: float
    method: str
    density: float
    dense: ReductionTime
    compressed: ReductionTime
    value_bytes: int = 4
    zero_stage: int = 0  # 1: both sides include ZeRO-1's parameter all-gather (module docstring)
    backend: str = "gloo"

    @property
    def dense_ms(self) -> float:
        return 1e3 * self.dense.total_s

    @property
    def compressed_ms(self) -> float:
        return 1e3 * self.compressed.total_s

    @property
    def speedup(self) -> float:
        """t_dense / t_compressed (1 when both are 0; 0 on one rank, where the dense path costs nothing)."""
        if self.compressed.total_s == 0:
            return 1.0 if self.dense.total_s == 0 else math.inf
        return self.dense.total_s / self.compressed.total_s

    @property
    def verdict(self) -> str:
        s = self.speedup
        return "pays" if s >= PAYS_AT else ("does not pay" if s < BREAK_EVEN else "marginal")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method: got {method!r}; the cost model covers {', '.join(map(repr, METHODS))}")


def reduction_collectives(numel: int, world_size: int, method: str = "none", density: float = 0.01,
                          value_bytes: int = 4, zero_stage: int = 0) -> list:
    """The collectives of one reduction of ``numel`` fp32 elements over ``world_size`` ranks, with
    the transport's byte counts (``method`` ``none``: the dense all-reduce; ``zero_stage`` 1: ZeRO-1's
    reduce-scatter instead, and the parameters' all-gather on both sides, module docstring)."""
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel: got {numel!r}; must be an int >= 0")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: got {world_size!r}; must be an int >= 1")
    if zero_stage not in (0, 1):
        raise ValueError(f"zero_stage: got {zero_stage!r}; allowed: 0, 1 (compression refuses ZeRO-2 and -3)")
    p = world_size
    gather = [Collective("params", "all_gather", p, 4 * numel)] if zero_stage == 1 else []
    if method == "none":
        return [Collective("dense_grads", "reduce_scatter" if zero_stage == 1 else "all_reduce", p, 4 * numel)] + gather
    _check_method(method)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density: got {density!r}; allowed: (0, 1]")
    if value_bytes not in (2, 4):
        raise ValueError(f"value_bytes: got {value_bytes!r}; allowed: 2 (bfloat16), 4 (float32)")
    if method == "randomk":  # k = round(d N) draws with replacement, deduplicated
        m = numel * (1.0 - math.exp(-density))
        return [Collective("values", "all_reduce", p, int(round(value_bytes * m)))] + gather
    m = density * numel  # topk exactly, bayes_prior in expectation
    header = 4 * -(-numel // BLOCK)  # (blocks,) int32
    # all_gather: nbytes is the whole output, P blocks of one rank's message
    return [Collective("header", "all_gather", p, p * header),
            Collective("pairs", "all_gather", p, p * int(round(m * (_INDEX_BYTES + value_bytes))))] + gather


def reduction_time(numel: int, world_size: int, link: Link, method: str = "none", density: float = 0.01,
                   value_bytes: int = 4, calibration: Optional[Calibration] = None, *, zero_stage: int = 0,
                   backend: str = "gloo") -> ReductionTime:
    """Seconds of one reduction (see the module docstring); one rank: no communication at all.
    ``backend`` (gloo, nccl) decides what a reduce-scatter costs (:func:`ds_xc.cost.comm.ring_steps`)."""
    cal = DEFAULT_CALIBRATION if calibration is None else calibration
    colls = reduction_collectives(numel, world_size, method, density, value_bytes, zero_stage)
    if world_size == 1:  # the dense path returns at once; the compressed one still selects
        compute = 0.0 if method == "none" else (cal.dense_ns + cal.method_ns(method)) * 1e-9 * numel
        return ReductionTime(0.0, compute, 0.0)
    comm = sum(collective_time(c, link, backend=backend) for c in colls)
    ns = cal.dense_ns + (0.0 if method == "none" else cal.method_ns(method))
    return ReductionTime(comm, ns * 1e-9 * numel, sum(wire_bytes(c, backend=backend) for c in colls))


def verdict(numel: int, world_size: int, link_gbit_per_s: float, method: str = "bayes_prior",
            density: float = 0.01, *, latency_s: float = DEFAULT_LATENCY_S, value_bytes: int = 4,
            calibration: Optional[Calibration] = None, zero_stage: int = 0, backend: str = "gloo") -> Verdict:
    """Does compressing ``numel`` gradient elements with ``method`` at ``density`` pay over
    ``world_size`` ranks joined by a ``link_gbit_per_s`` link (``latency_s`` per ring step)?
    ``zero_stage`` 1: under DeepSpeed's ZeRO-1, whose parameter all-gather both sides pay (module
    docstring); ``backend``: the process group's (what a reduce-scatter costs).

    >>> v = verdict(10**8, 4, 0.1, "bayes_prior", 0.01)
    >>> v.verdict, round(v.speedup, 1)
    ('pays', 14.0)
    """
    if not (isinstance(link_gbit_per_s, (int, float)) and math.isfinite(link_gbit_per_s) and link_gbit_per_s > 0):
        raise ValueError(f"link_gbit_per_s: got {link_gbit_per_s!r}; must be a finite number > 0")
    link = Link.gbit(float(link_gbit_per_s), latency_s)
    where = dict(zero_stage=zero_stage, backend=backend)
    dense = reduction_time(numel, world_size, link, "none", calibration=calibration, **where)
    comp = reduction_time(numel, world_size, link, method, density, value_bytes, calibration, **where)
    return Verdict(numel, world_size, float(link_gbit_per_s), method, float(density), dense, comp, value_bytes,
                   zero_stage, backend)


def break_even_gbit(world_size: int, method: str, density: float = 0.01, value_bytes: int = 4,
                    calibration: Optional[Calibration] = None) -> float:
    """The link speed (Gbit/s) at which the compressed reduction takes as long as the dense one,
    for large N and zero latency (module docstring); inf when the method's compute is 0. Without
    ZeRO, or ZeRO-1 on gloo (its parameter all-gather adds the same time to both sides)."""
    cal = DEFAULT_CALIBRATION if calibration is None else calibration
    _check_method(method)
    p = world_size
    if method == "randomk":
        saved_bits = 2 * (p - 1) / p * (32 - 8 * value_bytes * (1 - math.exp(-density)))
    else:
        saved_bits = (p - 1) * (64 / p - 8 * (_INDEX_BYTES + value_bytes) * density)
    c = cal.method_ns(method)
    if c == 0:
        return math.inf if saved_bits > 0 else 0.0
    return max(saved_bits, 0.0) / c
