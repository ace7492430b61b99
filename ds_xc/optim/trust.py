"""The layer-wise trust ratio shared by LAMB and LARS, and the norms it needs.

A trust ratio scales one layer's (one parameter tensor's) update by ``||w|| / ||u||``-like
quotients, so that every layer moves by a similar fraction of its own size whatever the
scale of its gradient (You et al. 2017, 2019). Two things are decided here, once for both
optimizers:

* the ratio is 1 wherever a norm it divides by or multiplies with is 0 (a freshly zeroed
  layer, a layer without gradient): a 0 or inf ratio would freeze or blow up that layer;
* the exclusion of 1-D parameters (biases, norm layers' scales and shifts) from the trust
  ratio and from weight decay (``exclude_bias_and_norm``), as in the papers' experiments.

A parameter is normally a whole tensor, and its norms are the tensor's. Under ZeRO stages 1 and 2
the optimizer sees one flat partition per parameter group instead, holding slices of many
layers, one layer possibly split between ranks; :class:`PartitionLayout` then gives, for
every element, its layer's norm summed over the slices of all ranks (one all-reduce on the
data-parallel group per step and flat tensor).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["LayerwiseOptimizer", "PartitionLayout", "excluded_of", "layer_norms", "trust_ratio", "where_excluded"]



class LayerwiseOptimizer(Optimizer):
    """The step loop of LAMB and LARS: each parameter with a dense gradient gets ``_update(p, group)``
    (a trust ratio needs the whole tensor, so sparse gradients are refused, naming the optimizer);
    ``layouts`` ({flat parameter: PartitionLayout}) is set by ds_xc under ZeRO 1/2."""

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        self.layouts = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__}: sparse gradients are not supported (the trust ratio "
                                     "needs the whole tensor)")
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        raise NotImplementedError

def trust_ratio(numerator: torch.Tensor, denominator: torch.Tensor, w_norm: torch.Tensor, u_norm: torch.Tensor,
                low: float = 0.0, high: float = float("inf")) -> torch.Tensor:
    """``clamp(numerator / denominator, low, high)``, and 1 where ``w_norm`` or ``u_norm`` is 0
    (elementwise on broadcastable tensors: 0-d for a whole tensor, (n,) for a flat partition)."""
    ok = (w_norm > 0) & (u_norm > 0)
    ratio = (numerator / torch.where(ok, denominator, torch.ones_like(denominator))).clamp(low, high)
    return torch.where(ok, ratio, torch.ones_like(ratio))


def excluded_of(optimizer, p: torch.Tensor, exclude_1d: bool):
    """Whether ``p`` is excluded from trust ratio and weight decay: a bool for a whole tensor
    (1-D tensors, when ``exclude_1d``), a bool tensor (numel,) for a flat ZeRO partition."""
    layout = getattr(optimizer, "layouts", {}).get(p)
    if layout is not None:
        return layout.excluded(exclude_1d)
    return bool(exclude_1d and p.dim() <= 1)


def where_excluded(excluded, value, fill: float):
    """``value`` (a float or tensor) where the parameter takes part, ``fill`` where it is excluded."""
    if isinstance(excluded, bool):
        return fill if excluded else value
    value = torch.as_tensor(value, device=excluded.device)
    return torch.where(excluded, torch.full((), fill, dtype=value.dtype, device=excluded.device), value)


def layer_norms(optimizer, p: torch.Tensor, update: torch.Tensor):
    """(||w||, ||update||) of ``p``'s layer: 0-d tensors for a whole tensor, (numel,) per element of a
    flat ZeRO partition (its layer's norms over every rank's slices), in the update's dtype."""
    layout = getattr(optimizer, "layouts", {}).get(p)
    if layout is not None:
        return layout.norms(p, update)
    w = p.detach().to(update.dtype)
    return torch.linalg.vector_norm(w), torch.linalg.vector_norm(update)


class PartitionLayout:
    """Where the layers lie in one rank's flat partition, and the group their slices are spread over.

    ``segments``: [(start, length, layer, ndim)], a layer's slice in this rank's partition of
    ``numel`` elements (``layer`` numbers the layers of the whole flat group, ``num_layers`` of
    them, the same on every rank); elements outside every segment (padding) get norms 0, so
    ratio 1. ``group``: the ranks the layers are split over (None: this rank holds whole layers).
    """

    def __init__(self, numel: int, segments: Sequence[tuple], num_layers: int, group: object | None = None,
                 device=None):
        key = torch.full((numel,), num_layers, dtype=torch.long)  # (numel,): layer of each element, padding last
        one_d = torch.zeros(num_layers + 1, dtype=torch.bool)
        for start, length, layer, ndim in segments:
            if start < 0 or length < 0 or start + length > numel or not 0 <= layer < num_layers:
                raise ValueError(f"segment (start={start}, length={length}, layer={layer}) outside a partition of "
                                 f"{numel} elements and {num_layers} layers")
            key[start:start + length] = layer
            one_d[layer] = ndim <= 1
        self.numel, self.num_layers, self.group = numel, num_layers, group
        self.key = key.to(device) if device is not None else key
        self.one_d = one_d.to(self.key.device)

    def excluded(self, exclude_1d: bool) -> torch.Tensor:
        """(numel,) bool: the elements of 1-D layers when ``exclude_1d``, else none."""
        if not exclude_1d:
            return torch.zeros_like(self.key, dtype=torch.bool)
        return self.one_d[self.key]

    def norms(self, p: torch.Tensor, update: torch.Tensor):
        """Per-element norms (numel,), (numel,) of each element's layer, over the slices of every rank."""
        if p.numel() != self.numel:
            raise ValueError(f"flat parameter of {p.numel()} elements, layout made for {self.numel}")
        key = self.key
        w = p.detach().reshape(-1).to(update.dtype)
        u = update.reshape(-1)
        sq = torch.zeros(2, self.num_layers + 1, dtype=update.dtype, device=p.device)  # (2, layers + padding)
        sq[0].index_add_(0, key, w * w)
        sq[1].index_add_(0, key, u * u)
        if self.group is not None:
            dist.all_reduce(sq, group=self.group)
        sq[:, -1] = 0  # padding: norms 0, ratio 1
        norms = sq.sqrt()[:, key]  # (2, numel)
        return norms[0], norms[1]
