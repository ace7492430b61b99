"""Bayes-prior gradient sampling: the maths, no communication (docs/papers.md section 3, [R]).

Per tensor, v = g + e (gradient plus error-feedback residual). Every few steps the ranks
sum a compact summary of |v|: a histogram of log2|v| over ``SPAN_OCTAVES`` octaves below
the global max (bins are log-spaced, so a few KB describe any scale). From the global
histogram we derive

* the threshold tau such that exploitation, keeping element i with probability
  ``p_i = min(1, (|v_i| / tau)^k)``, keeps the target number of elements in expectation
  (:func:`solve_threshold`). k = 1 is the reconstruction of docs/papers.md; a larger
  ``exploit_power`` k sharpens exploitation towards a hard threshold (k -> inf is a
  global-threshold top-k without the sort);
* the exploration probability per magnitude bin (:func:`exploration_table`): a flat
  prior (every element equally likely) or a Dirichlet posterior over the bins.

Sampling is O(n) with no sort (:func:`sample_indices`). Flipping a coin for each of
the n elements would cost one random number per element, about as much as the rest
together, so the coins are thinned: elements with p_i >= r (few: at most E[kept] / r
of them) get their own coin, and the others are reached through a Bernoulli(r) candidate
set drawn with geometric gaps (r*n random numbers) and accepted with probability p_i / r.
Every element is still kept with
probability exactly p_i; r is chosen per tensor from the histogram (:func:`thinning_rate`).

Legend: n elements of one tensor (flat view), B histogram bins, m sampled indices.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

__all__ = ["SPAN_OCTAVES", "bin_edges", "log2_ceil_max", "local_histogram", "solve_threshold",
           "thinning_rate", "exploration_table", "bernoulli_positions", "sample_indices", "bin_of"]

SPAN_OCTAVES = 32.0  # histogram range below the global max |v|; smaller values share the lowest bin
_RATES = [2.0 ** -k for k in range(0, 17)]  # candidate thinning rates


def log2_ceil_max(a: torch.Tensor) -> float:
    """ceil(log2(max a)) as a float (the histogram's top edge); -inf for an all-zero tensor."""
    top = float(a.max()) if a.numel() else 0.0
    if not math.isfinite(top):
        raise FloatingPointError(f"non-finite gradient value {top} in a compressed tensor")
    return math.ceil(math.log2(top)) if top > 0.0 else -math.inf


def bin_edges(log2_hi: float, bins: int) -> torch.Tensor:
    """(B+1,) float64 edges, geometric from 2^(log2_hi - SPAN) to 2^log2_hi."""
    return torch.pow(2.0, torch.linspace(log2_hi - SPAN_OCTAVES, log2_hi, bins + 1, dtype=torch.float64))


def bin_of(a: torch.Tensor, log2_hi: float, bins: int) -> torch.Tensor:
    """Bin index (int64, same shape as a) of each |v|; zeros and tiny values go to bin 0."""
    pos = (torch.log2(a) - (log2_hi - SPAN_OCTAVES)).mul_(bins / SPAN_OCTAVES)
    return pos.floor_().clamp_(0, bins - 1).long()


def local_histogram(v: torch.Tensor, log2_hi: float, bins: int, samples: int,
                    gen: Optional[torch.Generator]) -> torch.Tensor:
    """(B,) float32 counts of |v| per bin, estimated from ``samples`` uniform draws (0 = all)."""
    n = v.numel()
    if samples and n > samples:
        idx = torch.randint(n, (samples,), generator=gen, device=v.device)  # (samples,)
        v, scale = v[idx], n / samples
    else:
        scale = 1.0
    counts = torch.bincount(bin_of(v.abs(), log2_hi, bins), minlength=bins)[:bins]
    return counts.float().mul_(scale)


_MAX_TILT = 4.0  # most e-folds the density may change across one bin in the within-bin model
_GRID = 1025  # points of ln tau across the crossing bin in _solve_in_bin (a 1/1024 of a bin's width apart)


def _exprel(z: torch.Tensor) -> torch.Tensor:
    """(e^z - 1) / z, 1 at z = 0."""
    small = z.abs() < 1e-12
    return torch.where(small, torch.ones_like(z), torch.expm1(z) / torch.where(small, torch.ones_like(z), z))


def _bin_tilts(c: torch.Tensor) -> torch.Tensor:
    """(B,) float64: beta h per bin, the density's e-folds across the bin (per unit of ln|v|: beta).

    Within a bin the elements are modelled with a density exp(beta t) in t = ln(|v| / x0), beta from
    the neighbouring bins' counts (a central difference; one-sided at the ends), bounded by
    ``_MAX_TILT``. A log-uniform bin (beta 0) overstates the mean of |v|^k of a falling tail by up to
    (x1 / x0)^k / k ln(x1 / x0) (tests/test_compression.py measures the threshold's expected count)."""
    floor = c * math.exp(-2.0 * _MAX_TILT)
    left = torch.maximum(torch.cat([c[:1], c[:-1]]), floor)
    right = torch.maximum(torch.cat([c[1:], c[-1:]]), floor)
    width = torch.full_like(c, 2.0)
    width[0] = width[-1] = 1.0
    tilt = (torch.log(right.clamp(min=1e-300)) - torch.log(left.clamp(min=1e-300))) / width
    return torch.where(c > 0, tilt.clamp(-_MAX_TILT, _MAX_TILT), torch.zeros_like(c))


def _bin_power_means(edges: torch.Tensor, power: float, tilts: torch.Tensor) -> torch.Tensor:
    """(B,) mean of x^power inside each bin under the tilted density: x0^k phi(bh + kh) / phi(bh)."""
    x0, h = edges[:-1], torch.log(edges[1:] / edges[:-1])
    return x0 ** power * _exprel(tilts + power * h) / _exprel(tilts)


def solve_threshold(counts: torch.Tensor, log2_hi: float, target: float, power: float = 1.0) -> float:
    """tau with sum_i min(1, (|v_i| / tau)^power) = target, from a (B,) histogram of |v|.

    F(tau) = #{|v| >= tau} + sum_{|v| < tau} (|v| / tau)^power decreases in tau. We evaluate F
    at the bin edges (bin contents represented by their means of |v|^power under the within-bin
    density of :func:`_bin_tilts`), find the bin where it crosses ``target`` and solve inside it
    (:func:`_solve_in_bin`). Magnitudes are handled in units of 2^log2_hi (no under/overflow for
    any scale). Returns 0.0 (keep every nonzero element) when the target reaches the element
    count, and inf for an empty histogram.
    """
    c = counts.double().cpu()
    total = float(c.sum())
    if total <= 0.0 or not math.isfinite(log2_hi):
        return math.inf
    if target >= total:
        return 0.0
    edges = bin_edges(0.0, c.numel())  # relative to 2^log2_hi
    tilts = _bin_tilts(c)
    s = c * _bin_power_means(edges, power, tilts)
    zero = torch.zeros(1, dtype=torch.float64)
    s_below = torch.cat([zero, torch.cumsum(s, 0)])  # (B+1,): sum of |v|^k over bins < j
    c_above = total - torch.cat([zero, torch.cumsum(c, 0)])  # (B+1,): count of bins >= j
    f = c_above + s_below / edges ** power  # F at each edge, decreasing
    if float(f[-1]) >= target:  # even tau = max keeps too many: every element is sampled
        rel = (float(s_below[-1]) / target) ** (1.0 / power)
    else:
        j = int(torch.nonzero(f >= target).max())  # f[0] = total > target, f[B] < target
        rel = _solve_in_bin(float(edges[j]), float(edges[j + 1]), float(c[j]), float(tilts[j]), float(s_below[j]),
                            float(c_above[j + 1]), target, power)
    return rel * 2.0 ** log2_hi


def _solve_in_bin(x0: float, x1: float, count: float, tilt: float, s_below: float, c_above: float,
                  target: float, power: float) -> float:
    """tau in [x0, x1] with F(tau) = target, the crossing bin's ``count`` elements spread with density
    exp(beta t) over t = ln(x / x0) in [0, L], L = ln(x1 / x0), beta L = ``tilt``.

    F(tau) = c_above + s_below / tau^k + count * g(tau), g the bin's mean of min(1, (x / tau)^k):
    with T = ln(tau / x0) and phi_t(a) = (e^(a t) - 1) / a, g = ((x0 / tau)^k phi_T(beta + k)
    + phi_L(beta) - phi_T(beta)) / phi_L(beta). Counting the elements above tau as (x / tau)^k
    instead of 1 would overstate F by up to (x1 / x0)^k in that bin (4x at k = 8 with 4 bins an
    octave). With both that and log-uniform bins the threshold sent 5-18% under its budget at k 8 and
    up to 3x under at k 32; now within 2%. F decreases in tau: evaluated on a grid of ``_GRID`` points
    in ln tau (one tensor expression) and interpolated linearly between the two around ``target``."""
    L = math.log(x1 / x0)
    beta = tilt / L
    t = torch.linspace(0.0, L, _GRID, dtype=torch.float64)  # (G,): tau = x0 e^t

    def phi(a: float, u: torch.Tensor) -> torch.Tensor:  # (e^(a u) - 1) / a
        return u * _exprel(a * u)

    whole = phi(beta, torch.tensor(L, dtype=torch.float64))
    g = (torch.exp(-power * t) * phi(beta + power, t) + whole - phi(beta, t)) / whole
    f = c_above + s_below / (x0 * torch.exp(t)) ** power + count * g  # (G,) F(tau), decreasing
    j = min(max(int((f >= target).sum()) - 1, 0), _GRID - 2)  # f[j] >= target > f[j + 1]
    fa, fb = float(f[j]), float(f[j + 1])
    frac = (fa - target) / (fa - fb) if fa > fb else 0.0
    return x0 * math.exp(float(t[j]) + min(max(frac, 0.0), 1.0) * float(t[j + 1] - t[j]))


def thinning_rate(counts: torch.Tensor, log2_hi: float, tau: float, power: float = 1.0) -> float:
    """Rate r minimising the coins drawn: #{p_i >= r} (own coins) + 2 r n (candidates)."""
    c = counts.double().cpu()
    total = float(c.sum())
    if total <= 0.0 or not (0.0 < tau < math.inf):
        return 1.0
    upper = bin_edges(log2_hi, c.numel())[1:]
    best, best_cost = 1.0, math.inf
    for r in _RATES:
        cost = float(c[upper > tau * r ** (1.0 / power)].sum()) / total + 2.0 * r
        if cost < best_cost:
            best, best_cost = r, cost
    return best


def exploration_table(counts: torch.Tensor, rate: float, form: str, pseudo_count: float) -> torch.Tensor:
    """Per-element exploration probability for each |v| bin: (B,) float32, or (1,) when flat.

    uniform: ``rate`` everywhere. dirichlet: the exploration budget ``rate * N`` is shared
    over bins by the posterior mean pi_b = (c_b + a) / (N + B a), spread evenly over the
    c_b elements of bin b, capped at 1.
    """
    c = counts.double()
    if form == "uniform" or pseudo_count == 0.0:
        return torch.tensor([rate], dtype=torch.float32)  # (1,): the same for every bin
    total, num_bins = float(c.sum()), c.numel()
    pi = (c + pseudo_count) / (total + num_bins * pseudo_count)
    return (rate * total * pi / c.clamp(min=1.0)).clamp(max=1.0).float()


def bernoulli_positions(n: int, rate: float, gen: Optional[torch.Generator], device=None) -> torch.Tensor:
    """Sorted positions in [0, n), each present independently with probability ``rate``.

    Drawn as cumulative geometric gaps: about rate*n random numbers instead of n.
    """
    if rate >= 1.0:
        return torch.arange(n, device=device)
    if rate <= 0.0 or n == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    parts, start = [], -1
    while True:
        want = int(rate * (n - start) + 6.0 * math.sqrt(rate * n) + 16)
        gaps = torch.empty(want, dtype=torch.float64, device=device).geometric_(rate, generator=gen)
        pos = torch.cumsum(gaps.long(), 0).add_(start)  # (want,) strictly increasing
        if int(pos[-1]) >= n:
            parts.append(pos[: int(torch.searchsorted(pos, n))])
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        parts.append(pos)
        start = int(pos[-1])


def sample_indices(v: torch.Tensor, tau: float, rate: float, explore: Optional[torch.Tensor],
                   log2_hi: float, gen: Optional[torch.Generator], power: float = 1.0,
                   select: Optional[Callable] = None) -> torch.Tensor:
    """Sorted unique indices of v kept by exploitation, p = min(1, (|v|/tau)^power), or exploration.

    ``rate`` is the thinning rate r; ``explore`` is the exploration table (None: none).
    ``select(v, theta) -> (idx, v[idx])`` is the threshold pass |v| >= theta (ascending idx,
    ds_xc_ops.triton_select.select_above's semantics: the compressors pass it, which runs a Triton
    kernel on CUDA and a C++ one on the CPU); None: its PyTorch reference. Only that pass reads
    all of v: the candidates are gathered.
    """
    n = v.numel()
    parts = []
    if tau <= 0.0:  # keep every nonzero element
        parts.append(torch.nonzero(v).squeeze(1))
    elif tau < math.inf:
        theta = tau * rate ** (1.0 / power)  # p_i >= r  <=>  |v_i| >= theta
        own, v_own = (select or _select_torch)(v, theta)  # (n1,) elements with their own coin
        u = torch.rand(own.numel(), generator=gen, device=v.device)
        parts.append(own[u < _prob(v_own.abs(), tau, power)])
        cand = bernoulli_positions(n, rate, gen, v.device)  # (n2,) ~ Bernoulli(r) each
        a_cand = v[cand].abs()
        u = torch.rand(cand.numel(), generator=gen, device=v.device)
        parts.append(cand[(a_cand < theta) & (u < _prob(a_cand, theta, power))])  # accept with p / r
    if explore is not None:
        q_max = float(explore.max())
        if q_max > 0.0:
            cand = bernoulli_positions(n, q_max, gen, v.device)  # (n3,)
            if explore.numel() > 1:  # dirichlet: accept with q_bin / q_max
                q = explore.to(v.device)[bin_of(v[cand].abs(), log2_hi, explore.numel())]
                u = torch.rand(cand.numel(), generator=gen, device=v.device)
                cand = cand[u.mul_(q_max) < q]
            parts.append(cand)
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=v.device)
    idx = torch.cat(parts)
    return torch.unique(idx, sorted=True) if len(parts) > 1 else idx


def _select_torch(v: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, v[idx]) of |v| >= theta: the PyTorch pass (select_above_torch's semantics for float32)."""
    idx = torch.nonzero(v.abs() >= theta).squeeze(1)  # (n1,)
    return idx, v[idx]


def _prob(a: torch.Tensor, scale: float, power: float) -> torch.Tensor:
    """(a / scale)^power (values above 1 mean "always")."""
    p = a / scale
    return p if power == 1.0 else p.pow_(power)
