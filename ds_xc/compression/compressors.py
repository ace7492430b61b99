"""Element selection for compressed gradients: top-k, random-k, Bayes-prior sampling.

Pure selection maths, no communication: ``select(v, tstate, gen, shared_gen)`` returns
the sorted, unique indices of the flat tensor ``v`` (gradient plus residual) to send.
``tstate`` is the tensor's entry of ``optimizer.state`` (thresholds and statistics live
there so that they are checkpointed). ``gen`` is this rank's generator for the step and
tensor, ``shared_gen`` one seeded identically on every rank.

A density of 1.0 selects every element, for every method (the transport still runs,
so that case is an end-to-end check of the sparse path).

Registry: :data:`COMPRESSORS` maps the config's ``method`` to a class. ``powersgd`` is a
low-rank method, not a selection: its entry (:class:`PowerSGD`) only tells the reducers so
(``low_rank``, ``min_dim``) and its ``select()`` raises; the maths is ds_xc/compression/powersgd.py.
"""
from __future__ import annotations

import functools
import math
from typing import ClassVar, Optional

import torch

from ds_xc.compression import bayes
from ds_xc.compression.config import GradientCompressionConfig

__all__ = ["Compressor", "TopK", "RandomK", "BayesPrior", "PowerSGD", "COMPRESSORS", "build_compressor", "num_keep",
           "allocate_densities"]


def num_keep(n: int, density: float) -> int:
    """Elements a fixed-count method keeps out of n: round(density * n), at least 1."""
    return n if density >= 1.0 else max(1, min(n, int(round(density * n))))


def allocate_densities(numel: list, weight: list, density: float) -> list:
    """Per-tensor densities that spend the budget ``density * sum(numel)`` in proportion to ``weight``.

    Water-filling: a tensor whose share would exceed its size is sent whole and the rest
    is shared again among the others. All weights zero: every tensor gets ``density``.
    """
    budget = density * float(sum(numel))
    w = [max(float(x), 0.0) for x in weight]
    out = [0.0] * len(numel)
    open_ = [i for i in range(len(numel)) if numel[i] > 0]
    if sum(w[i] for i in open_) <= 0.0:
        return [density] * len(numel)
    while open_:
        total = sum(w[i] for i in open_)
        if total <= 0.0:
            break
        full = {i for i in open_ if budget * w[i] / total >= numel[i]}
        if not full:
            for i in open_:
                out[i] = budget * w[i] / total / numel[i]
            break
        for i in full:
            out[i] = 1.0
            budget -= numel[i]
        open_ = [i for i in open_ if i not in full]
    return out


def _threshold_pass(backend: str):
    """The |v| >= theta pass of bayes.sample_indices: ds_xc_ops.triton_select.select_above (Triton
    kernel on CUDA when usable, the C++ kernel for float32 CPU tensors, else torch; identical results)."""
    from ds_xc_ops.triton_select import select_above
    return functools.partial(select_above, backend=backend)


class Compressor:
    """Chooses which elements of one tensor's v are sent this step."""

    name: ClassVar[str] = ""
    shared_indices: ClassVar[bool] = False  # same indices on every rank: a values-only all-reduce suffices
    uses_stats: ClassVar[bool] = False  # needs the periodic all-reduce of |v| statistics
    low_rank: ClassVar[bool] = False  # reduced by a low-rank approximation, not by selecting elements
    min_dim: ClassVar[int] = 1  # tensors of fewer dimensions are reduced densely

    def __init__(self, config: GradientCompressionConfig):
        self.config = config
        self.density = config.density
        self.scale = 1.0  # this step's factor on every density (>= 1 during density_warmup_steps)

    def density_of(self, tstate: dict) -> float:
        """The tensor's own density (``allocation: nonzero`` sets one per tensor), else the config's,
        times this step's ``scale`` (at most 1)."""
        density = tstate.get("density", self.density)
        return density if self.scale == 1.0 else min(1.0, density * self.scale)

    def select(self, v: torch.Tensor, tstate: dict, gen: Optional[torch.Generator],
               shared_gen: Optional[torch.Generator]) -> torch.Tensor:
        """Sorted unique int64 indices (m,) into the flat tensor v (n,)."""
        if self.density_of(tstate) >= 1.0:
            return torch.arange(v.numel(), device=v.device)
        return self._select(v, tstate, gen, shared_gen)

    def _select(self, v, tstate, gen, shared_gen) -> torch.Tensor:
        raise NotImplementedError

    def after_select(self, tstate: dict, num_sent: int, numel: int) -> None:
        """Hook called with the number of elements this rank sent from the tensor."""


class TopK(Compressor):
    """The k = round(density * n) largest |v| (torch.topk, O(n log k)); indices differ per rank."""

    name = "topk"

    def _select(self, v, tstate, gen, shared_gen):
        k = num_keep(v.numel(), self.density_of(tstate))
        idx = torch.topk(v.abs(), k, sorted=False).indices  # (k,)
        return torch.sort(idx).values


class RandomK(Compressor):
    """k = round(density * n) draws of positions from a generator shared by the ranks.

    The indices agree on every rank, so only the values travel (an all-reduce of k values).
    Draws are with replacement and deduplicated: slightly fewer than k distinct elements
    (a fraction about k / 2n less), far cheaper than a permutation of n.
    """

    name = "randomk"
    shared_indices = True

    def _select(self, v, tstate, gen, shared_gen):
        k = num_keep(v.numel(), self.density_of(tstate))
        idx = torch.randint(v.numel(), (k,), generator=shared_gen, device=v.device)  # (k,)
        return torch.unique(idx, sorted=True)


class BayesPrior(Compressor):
    """Sampling from the global |v| distribution with a prior for exploration (see bayes.py).

    State per tensor: ``tau`` (exploitation threshold), ``log2_hi`` (histogram top),
    ``rate`` (thinning rate), ``explore`` (exploration table), ``tau_scale`` (a correction
    of tau between syncs, from the counts actually sent).
    """

    name = "bayes_prior"
    uses_stats = True
    select_backend: ClassVar[str] = "auto"  # ds_xc_ops.triton_select backend of the threshold pass
    _GAIN, _STEP_LIMIT, _SCALE_LIMIT = 0.5, 1.25, 64.0

    def local_max(self, v: torch.Tensor) -> float:
        """Largest |v| of this rank's tensor (all-reduced with MAX before the histogram)."""
        if not v.numel():
            return 0.0
        lo, hi = torch.aminmax(v)  # no |v| temporary
        return max(-float(lo), float(hi))

    def local_histogram(self, v: torch.Tensor, log2_hi: float, gen) -> torch.Tensor:
        """(bins,) float32 counts of this rank's |v| below the global top 2^log2_hi."""
        if not math.isfinite(log2_hi):
            return torch.zeros(self.config.bins, dtype=torch.float32, device=v.device)
        return bayes.local_histogram(v, log2_hi, self.config.bins, self.config.stats_samples, gen)

    def update(self, tstate: dict, counts: torch.Tensor, log2_hi: float) -> None:
        """Set the tensor's threshold and tables from the global (all ranks) histogram."""
        prior = self.config.prior
        total = float(counts.double().sum())
        density = self.density_of(tstate)
        exploit = (1.0 - prior.strength) * density * total
        power = self.config.exploit_power
        tau = bayes.solve_threshold(counts, log2_hi, exploit, power) if exploit > 0 else math.inf
        tstate.update(tau=tau, log2_hi=log2_hi, tau_scale=1.0,
                      rate=bayes.thinning_rate(counts, log2_hi, tau, power),
                      explore=bayes.exploration_table(counts.cpu(), prior.strength * density,
                                                      prior.form, prior.pseudo_count))

    def _select(self, v, tstate, gen, shared_gen):
        if "tau" not in tstate:
            raise RuntimeError("bayes_prior: select() before the first statistics sync")
        explore = tstate["explore"] if self.config.prior.strength > 0.0 else None
        select = _threshold_pass(self.select_backend)  # Triton on CUDA, C++ for float32 on the CPU
        return bayes.sample_indices(v, tstate["tau"] * tstate["tau_scale"], tstate["rate"], explore,
                                    tstate["log2_hi"], gen, self.config.exploit_power, select=select)

    def after_select(self, tstate: dict, num_sent: int, numel: int) -> None:
        """Nudge tau towards the target count: too many sent -> raise tau, too few -> lower it.

        The count falls about as tau^-k (k = exploit_power, for the elements below tau), so a
        damped Newton step scales tau by ratio^(gain / k): with k = 8 a fixed ratio^0.5 would move
        the count by ratio^4 and overshoot on the next step."""
        density = self.density_of(tstate)
        expected = density * numel
        if density >= 1.0 or expected <= 0.0 or not math.isfinite(tstate.get("tau", math.inf)):
            return
        ratio = max(num_sent, 0.5) / expected
        factor = min(max(ratio ** (self._GAIN / self.config.exploit_power), 1.0 / self._STEP_LIMIT), self._STEP_LIMIT)
        limit = self._SCALE_LIMIT
        tstate["tau_scale"] = min(max(tstate["tau_scale"] * factor, 1.0 / limit), limit)


class PowerSGD(Compressor):
    """``method: powersgd``: the registry's entry of the low-rank method (ds_xc/compression/powersgd.py).

    It selects no elements: CompressedOptimizer.reduce_gradients sends each compressed tensor's
    rank-r approximation instead (``low_rank``), so :meth:`select` raises. Tensors of one
    dimension are no matrices and go dense (``min_dim``).
    """

    name = "powersgd"
    low_rank = True
    min_dim = 2

    def select(self, v, tstate, gen, shared_gen):
        raise NotImplementedError("gradient_compression.method='powersgd' selects no elements; its reduction is "
                                  "the low-rank round of ds_xc/compression/powersgd.py")


COMPRESSORS: dict[str, type[Compressor]] = {cls.name: cls for cls in (TopK, RandomK, BayesPrior, PowerSGD)}


def build_compressor(config: GradientCompressionConfig) -> Compressor:
    """The compressor registered for ``config.method`` (``none`` has none: reduce densely)."""
    if config.method not in COMPRESSORS:
        raise ValueError(f"gradient_compression.method={config.method!r} has no compressor; "
                         f"allowed {sorted(COMPRESSORS)}")
    return COMPRESSORS[config.method](config)
