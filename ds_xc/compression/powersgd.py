"""PowerSGD: low-rank compression of the gradient mean, with error feedback and warm start.

The method of Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization" (NeurIPS 2019), written here from the paper's
algorithm. Each compressed tensor (``min_numel`` or more elements, two or more dimensions)
is viewed as a matrix M (n, m): its first dimension by the product of the others. With
r = min(rank, n, m) and Q (m, r) shared by the ranks, one step is

    M = grad + e                      (e: this rank's residual; M = grad without error feedback)
    P = M Q                           (n, r)       all-reduce-mean of every tensor's P in one buffer
    P = orthonormal columns of P      (modified Gram-Schmidt, twice, fp32)
    Q = M^T P                         (m, r)       all-reduce-mean of every tensor's Q in one buffer
    mean ~ P Q^T                      (n, m)       the reduced gradient, the same on every rank
    e = M - P Q^T                     (what the approximation missed waits for the next step)

Because Q is shared and the means are linear, P Q^T = P P^T mean(M): the projection of the
ranks' mean onto the span of P, one step of subspace (power) iteration. With warm start the
next step starts from this Q (kept in ``optimizer.state[param]["powersgd_q"]``, so it is
checkpointed); without it, and at the first step, Q is drawn from a generator seeded
identically on every rank (seed, step, tensor). A column of Q that is zero or not finite
(a tensor whose mean gradient was zero) is redrawn, else the iteration would stay at zero.
With r = min(n, m) the approximation is the exact mean. Each step sends 2 all-reduces of
4 sum (n + m) r bytes together (fp32), instead of one of 4 sum n m.

Pure functions (matrix view, orthonormalisation, one round given an all-reduce-mean
callable) and :class:`LowRankSteps`, the mixin of CompressedOptimizer that runs the round
on its compressed tensors (``reduce_gradients`` dispatches to it for ``method: powersgd``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ds_xc.compression.seeds import mix_seed, seeded_generator
from ds_xc.compression.transport import values_allreduce_mean
from ds_xc.parallel.groups import group_size

__all__ = ["matrix_view", "matrix_shape", "effective_rank", "orthonormalise_", "start_q", "low_rank_round",
           "wire_floats", "LowRankSteps", "Q_KEY", "Q_STREAM", "EPS"]

Q_KEY = "powersgd_q"  # optimizer.state[param] key of the warm-start Q (m, r)
EPS = 1e-30  # norm guard of the orthonormalisation: a zero column stays zero instead of becoming NaN
Q_STREAM = -3  # the shared draws of Q: (seed, step, tensor, -3); other streams use -1, -2 and ranks >= 0


def matrix_view(t: torch.Tensor) -> torch.Tensor:
    """(d0, d1, ..., dk) -> (d0, d1 * ... * dk), a view of a contiguous tensor."""
    return t.reshape(t.shape[0], -1)


def matrix_shape(shape) -> tuple[int, int]:
    """(n, m) of the matrix view of a tensor of ``shape`` (two or more dimensions)."""
    m = 1
    for d in shape[1:]:
        m *= int(d)
    return int(shape[0]), m


def effective_rank(shape, rank: int) -> int:
    """r = min(rank, n, m) of a tensor of ``shape`` viewed as an (n, m) matrix."""
    return max(1, min(rank, *matrix_shape(shape)))


def wire_floats(shapes, rank: int) -> int:
    """Floats one rank contributes per step: sum over the tensors of (n + m) r (P and Q together)."""
    return sum(sum(matrix_shape(s)) * effective_rank(s, rank) for s in shapes)


def orthonormalise_(p: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Orthonormalise the columns of ``p`` (n, r) in place: modified Gram-Schmidt, two passes.

    The second pass ("twice is enough") keeps the columns orthogonal to working precision
    even when P is rank deficient (a gradient of rank below r, e.g. a small batch): the
    first pass leaves such a column as rounding noise, which without it would not be
    orthogonal to the others, and P P^T would not be a projection. A column that is exactly
    zero stays zero (its norm is clamped to ``eps``). Computed in fp32 (or the input's
    dtype when wider); no host synchronisation.
    """
    work = p if p.dtype in (torch.float32, torch.float64) else p.float()
    for j in range(work.shape[1]):
        v = work[:, j]
        for _ in range(2):
            for i in range(j):
                u = work[:, i]
                v.sub_(torch.dot(u, v) * u)
        v.div_(torch.linalg.vector_norm(v).clamp_min(eps))
    if work is not p:
        p.copy_(work)
    return p


def start_q(q: Optional[torch.Tensor], shape: tuple, gen: torch.Generator, device) -> torch.Tensor:
    """This step's Q (m, r) fp32: ``q`` (warm start) with its zero or non-finite columns redrawn,
    or, when ``q`` is None or of another shape, a standard normal draw from ``gen`` (shared seed)."""
    fresh = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)  # (m, r)
    if q is None or tuple(q.shape) != tuple(shape):
        return fresh
    bad = (q == 0).all(0) | ~torch.isfinite(q).all(0)  # (r,)
    return torch.where(bad.unsqueeze(0), fresh, q.to(device=device, dtype=torch.float32))


def _mean_in_one_buffer(tensors: list, allreduce_mean: Callable) -> None:
    """Replace each tensor by its mean over the ranks, with one all-reduce of their concatenation."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])  # (sum numel,)
    flat = allreduce_mean(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def low_rank_round(ms: list, qs: list, allreduce_mean: Callable) -> tuple[list, list]:
    """One PowerSGD round: ``ms`` the ranks' matrices M (n, m) fp32, ``qs`` the shared Q's (m, r).

    ``allreduce_mean(flat)`` returns the mean over the ranks of a flat fp32 tensor (it may work
    in place); it is called twice, once for all P's and once for all Q's. Returns (approx
    (n, m) per tensor, the new Q (m, r) per tensor), identical on every rank. ``ms`` is not changed.
    """
    ps = [m @ q for m, q in zip(ms, qs)]  # (n, r) each
    _mean_in_one_buffer(ps, allreduce_mean)
    for p in ps:
        orthonormalise_(p)
    new_qs = [m.t() @ p for m, p in zip(ms, ps)]  # (m, r) each
    _mean_in_one_buffer(new_qs, allreduce_mean)
    approx = [p @ q.t() for p, q in zip(ps, new_qs)]  # (n, m) each
    return approx, new_qs


class LowRankSteps:
    """Mixin of CompressedOptimizer: the PowerSGD reduction of its compressed tensors (``method: powersgd``).

    Reads the optimizer's parameters, state, config, step counter, residual views and byte
    counter, as ds_xc/compression/steps.py does; the maths is in the functions above.
    """

    def _reduce_low_rank(self, grads: list[torch.Tensor]) -> tuple:
        """M = grad + e per compressed tensor (n, m), the low-rank mean into ``.grad``, e = M - approx.

        Returns (sent, global_sent, comm) for close_step: sent = sum (n + m) r floats of this rank."""
        cfg, lay = self.config, self.layout
        rank, warm = cfg.powersgd.rank, cfg.powersgd.warm_start
        ms, qs = [], []
        for i in lay.sparse:
            p, g = self._params[i], grads[i]
            tstate = self.state[p]
            if "residual" in tstate:  # error feedback: M = e + grad, in the residual's storage
                m = matrix_view(tstate["residual"].add_(g))  # (n, m) fp32 view
            else:
                m = matrix_view(g.float())  # (n, m); the gradient itself when fp32 (read before written)
            shape = (m.shape[1], effective_rank(p.shape, rank))
            gen = seeded_generator(mix_seed(cfg.seed, self._step, i, Q_STREAM), p.device)
            qs.append(start_q(tstate.get(Q_KEY) if warm else None, shape, gen, p.device))
            ms.append(m)

        def mean(flat: torch.Tensor) -> torch.Tensor:
            return values_allreduce_mean(flat, self.comm_group, torch.float32, self.counter)

        approx, new_qs = low_rank_round(ms, qs, mean)
        for i, m, a, q in zip(lay.sparse, ms, approx, new_qs):
            tstate = self.state[self._params[i]]
            if "residual" in tstate:
                m.sub_(a)  # e = M - approx (m is the residual's view)
            grads[i].copy_(a.view_as(grads[i]))
            if warm:
                tstate[Q_KEY] = q
        sent = wire_floats([self._params[i].shape for i in lay.sparse], rank)
        return sent, sent * group_size(self.comm_group), self.comm_group
