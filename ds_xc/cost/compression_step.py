"""Whether compression pays for the whole step, against the best exact reduction of the same gradients.

Why: the reduction-only verdict (compression.py) compares the compressed reduction with a dense
all-reduce of the same elements. Two end-to-end measurements (docs/compression.md, "When
compression pays") show that this is not enough:

- a compute-bound model: the glyphs CNN at 100 Mbit/s, where the reduction is a fifth of the step:
  bayes_prior's step took 0.483 s against dense's 0.492, and it needed 1.3x the steps (0.79x end to end);
- a model whose gradient is mostly embedding tables' looked-up rows, whose exact mean sent as
  rows (``topology.sparse_rows``) costs little: the text job at 1 Gbit/s, 0.149 s a step against
  rows' 0.112 (0.66x end to end).

Model. A step is ``other`` (forward, backward, optimizer, data; everything but the reduction) plus
the reduction. The running job measures ``other`` and the compressed reduction
(ds_xc.compression.pays.StepCheck); the exact reduction is predicted on the link (alpha-beta ring
of :mod:`ds_xc.cost.comm`, c_dense of :class:`~ds_xc.cost.compression.Calibration`). A table of
n rows x d columns whose gradient has k nonzero rows goes as rows when that moves fewer bytes than
its ring, the rule of ds_xc.parallel.sparse_rows.RowSparseMean (a count, an index and a rows
all-gather, then the sum of P ranks' rows); every other tensor goes dense:

    rows       3 (P-1) alpha + (P-1) k (4 d + 8) / beta + c_dense P k d
    dense      2 (P-1) (alpha + 4 N / (P beta)) + c_dense N               (compression.py)

    step speedup   S = (other + exact) / (other + compressed)
    end to end     E = S / f

Under ZeRO stage 1 (``zero_stage=1``) DeepSpeed reduces every gradient densely with its own
reduce-scatter (rows are refused there: ``topology.sparse_rows`` needs ZeRO 0), and its parameter
all-gather runs in the step either way, so it is part of ``other`` on both sides.

f is how many more steps compressed training needs to reach the exact run's accuracy, per method
the fewest measured at the library defaults (:data:`STEPS_FACTORS`, :func:`steps_factor`):
bayes_prior 1.17 (the text job, 1,400 against 1,200 steps at 1 Gbit/s and 100 Mbit/s; glyphs 1.3),
topk 1.17 (the text job's 150-step horizon, 175 against 150), powersgd 1.3 (glyphs, 1,300 against
1,000; the text job 1.42); randomk was not measured end to end and takes the fewest of any method,
:data:`STEPS_FACTOR` (optimistic: for it the check says "pays" rather too early than too late).
The verdict reads E with compression.py's thresholds: ``pays`` >= 1.25, ``does not pay`` < 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ds_xc.cost.comm import Link, collective_time, wire_bytes
from ds_xc.cost.compression import (BREAK_EVEN, DEFAULT_CALIBRATION, PAYS_AT, Calibration, reduction_collectives,
                                    reduction_time)
from ds_xc.parallel.sparse_rows import INDEX_BYTES, rows_bytes, rows_pay

__all__ = ["STEPS_FACTOR", "STEPS_FACTORS", "steps_factor", "Table", "ExactReduction", "StepVerdict",
           "exact_reduction", "step_verdict"]

STEPS_FACTORS = {"bayes_prior": 1.17, "topk": 1.17, "powersgd": 1.3}  # per method, measured (module docstring)
STEPS_FACTOR = min(STEPS_FACTORS.values())  # the fewest of any method: for the methods not measured


def steps_factor(method: str) -> float:
    """The extra steps ``method`` needs to the exact run's accuracy (:data:`STEPS_FACTOR` where not measured)."""
    return STEPS_FACTORS.get(method, STEPS_FACTOR)

_VALUE_BYTES = 4  # fp32 gradients


@dataclass(frozen=True)
class Table:
    """A 2-D gradient of ``rows`` x ``dim`` with ``nonzero_rows`` rows holding a nonzero (the busiest rank's)."""
    rows: int
    dim: int
    nonzero_rows: int

    def __post_init__(self):
        if not (self.rows >= 1 and self.dim >= 1 and 0 <= self.nonzero_rows <= self.rows):
            raise ValueError(f"Table: got rows={self.rows}, dim={self.dim}, nonzero_rows={self.nonzero_rows}; "
                             "allowed: rows >= 1, dim >= 1, 0 <= nonzero_rows <= rows")


@dataclass(frozen=True)
class ExactReduction:
    """The predicted best exact mean: seconds on the link and on the CPU, bytes this rank sends, and
    the tables that go as rows."""
    comm_s: float
    compute_s: float
    bytes_sent: float
    as_rows: tuple = ()
    zero_stage: int = 0  # 1: ZeRO-1's dense reduce-scatter (no rows under ZeRO-1)

    @property
    def total_s(self) -> float:
        return self.comm_s + self.compute_s

    @property
    def kind(self) -> str:
        if self.zero_stage == 1:
            return "ZeRO-1 dense reduce-scatter"
        return "embedding rows and dense all-reduce" if self.as_rows else "dense all-reduce"


def exact_reduction(dense_numel: int, tables: Sequence[Table], world_size: int, link: Link,
                    calibration: Optional[Calibration] = None, *, zero_stage: int = 0,
                    backend: str = "gloo") -> ExactReduction:
    """The exact mean of ``dense_numel`` elements sent dense and of ``tables``, each as rows where
    that moves fewer bytes than its ring (``rows_pay``, module docstring). One rank: nothing to reduce.
    ``zero_stage`` 1: everything dense, as ZeRO-1's reduce-scatter on ``backend`` (module docstring)."""
    if not isinstance(dense_numel, int) or dense_numel < 0:
        raise ValueError(f"dense_numel: got {dense_numel!r}; must be an int >= 0")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: got {world_size!r}; must be an int >= 1")
    p, cal = world_size, DEFAULT_CALIBRATION if calibration is None else calibration
    if p == 1:
        return ExactReduction(0.0, 0.0, 0.0, (), zero_stage)
    if zero_stage == 1:  # the reduce-scatter alone: the parameters' all-gather is in the step on both sides
        numel = dense_numel + sum(t.rows * t.dim for t in tables)
        scatter = [c for c in reduction_collectives(numel, p, "none", zero_stage=1) if c.name == "dense_grads"]
        return ExactReduction(sum(collective_time(c, link, backend=backend) for c in scatter),
                              cal.dense_ns * 1e-9 * numel, sum(wire_bytes(c, backend=backend) for c in scatter), (), 1)
    dense = dense_numel
    comm = compute = sent = 0.0
    as_rows = []
    for t in tables:
        if rows_pay(t.nonzero_rows, (t.rows, t.dim), _VALUE_BYTES, p):  # count, indices, rows: three all-gathers
            row_bytes = rows_bytes(t.nonzero_rows, t.dim, _VALUE_BYTES, p)
            comm += 3 * (p - 1) * link.latency_s + row_bytes * 8.0 / link.bandwidth_bps
            compute += cal.dense_ns * 1e-9 * p * t.nonzero_rows * t.dim
            sent += row_bytes + (p - 1) * INDEX_BYTES  # the rows with their indices, and the int64 count
            as_rows.append(t)
        else:
            dense += t.rows * t.dim
    if dense:  # the ring all-reduce and c_dense per element, as compression.py's dense reduction
        ring = reduction_time(dense, p, link, "none", calibration=cal)
        comm, compute, sent = comm + ring.comm_s, compute + ring.compute_s, sent + ring.bytes_sent
    return ExactReduction(comm, compute, sent, tuple(as_rows))  # zero_stage 0


@dataclass(frozen=True)
class StepVerdict:
    """Measured step and compressed reduction against the predicted exact reduction (module docstring)."""
    step_s: float
    compressed_s: float
    exact: ExactReduction
    steps_factor: float = STEPS_FACTOR

    @property
    def other_s(self) -> float:
        """The step without its reduction (forward, backward, optimizer, data)."""
        return max(self.step_s - self.compressed_s, 0.0)

    @property
    def exact_step_s(self) -> float:
        """The predicted step with the exact reduction instead of the compressed one."""
        return self.other_s + self.exact.total_s

    @property
    def step_speedup(self) -> float:
        """S = exact step / compressed step: > 1 when a compressed step is faster."""
        return self.exact_step_s / self.step_s if self.step_s > 0 else 1.0

    @property
    def speedup(self) -> float:
        """E = S / steps_factor: the predicted speed-up to the same accuracy."""
        return self.step_speedup / self.steps_factor

    @property
    def verdict(self) -> str:
        e = self.speedup
        return "pays" if e >= PAYS_AT else ("does not pay" if e < BREAK_EVEN else "marginal")

    def summary(self) -> dict:
        """The numbers as plain JSON values (benchmarks record them)."""
        return {"verdict": self.verdict, "step_s": self.step_s, "compressed_s": self.compressed_s,
                "other_s": self.other_s, "exact_s": self.exact.total_s, "exact_kind": self.exact.kind,
                "exact_step_s": self.exact_step_s, "step_speedup": self.step_speedup, "speedup": self.speedup,
                "steps_factor": self.steps_factor,
                "as_rows": [[t.rows, t.dim, t.nonzero_rows] for t in self.exact.as_rows]}


def step_verdict(step_s: float, compressed_s: float, dense_numel: int, tables: Sequence[Table], world_size: int,
                 link: Link, *, steps_factor: float = STEPS_FACTOR, calibration: Optional[Calibration] = None,
                 zero_stage: int = 0, backend: str = "gloo") -> StepVerdict:
    """Judge a measured compressed step (``step_s`` seconds, of which ``compressed_s`` the reduction)
    against the predicted exact reduction of the same gradients on ``link`` (``zero_stage`` 1: DeepSpeed's
    ZeRO-1 reduce-scatter, see :func:`exact_reduction`).

    The default job at 1 Gbit/s (measured 135.5 ms a step, 43.4 of them the reduction; 569 of the
    20,001 rows of its table looked up; 0.36 M other elements):

    >>> from ds_xc.cost.comm import Link
    >>> v = step_verdict(0.1355, 0.0434, 360_000, [Table(20_001, 256, 569)], 2, Link.gbit(1.0, 50e-6))
    >>> v.verdict, round(v.exact_step_s, 3), round(v.speedup, 2)
    ('does not pay', 0.112, 0.7)
    """
    for name, value in (("step_s", step_s), ("compressed_s", compressed_s), ("steps_factor", steps_factor)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: got {value!r}; must be a finite number >= 0")
    if steps_factor <= 0:
        raise ValueError(f"steps_factor: got {steps_factor!r}; must be > 0")
    exact = exact_reduction(dense_numel, tables, world_size, link, calibration, zero_stage=zero_stage, backend=backend)
    return StepVerdict(float(step_s), float(min(compressed_s, step_s)), exact, float(steps_factor))
