"""The loss options shared by every loss (ignore_index, label_smoothing, z_loss, softcap, reduction,
sample weights) and the per-row terms they add to the fused softmax (docs/head.md, "Loss options").

Legend: N rows of the global batch, C classes of the whole head, v_i a row's weight (its sample
weight, 0 where the label is ``ignore_index``), z_ic the logits the loss uses (the target's with
its margin; ``softcap`` applied), lse_i = log sum_c exp(z_ic), eps = ``label_smoothing``.

Every row's loss (torch's definitions, over all C classes of the head, exact across shards):

    row_i = lse_i - (1 - eps) z_iy - eps / C * sum_c z_ic + z_loss * lse_i^2

and the head returns sum_i v_i row_i / sum_i v_i (mean), sum_i v_i row_i (sum) or v_i row_i for
this rank's rows (none). D-Softmax, whose target is not in its partition function, keeps its
intra-class term: row_i = lse_i + (1 - eps) softplus(s (d - c_iy)) - eps / C * sum_c s c_ic +
z_loss * lse_i^2, lse_i = log(1 + sum_{c != y} exp(s c_ic)). The sum over classes rides in the
softmax statistics' one all-gather per chunk (a fourth column), so no collective is added.

Gradients (what :mod:`ds_xc.head.softmax` folds into its factored form): d row_i / d z_ic =
p_ic (1 + 2 z_loss lse_i) - (1 - eps) [c = y] - eps / C, times v_i. The per-row factor scales
the softmax part; the smoothing's -v_i eps / C on every column is a rank-1 term (a column sum of
the weights and a row sum of the embeddings), except under ``softcap`` where each entry also
carries the cap's derivative 1 - tanh^2 and two more GEMMs take it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ds_xc import config as cfg

__all__ = ["LossOptions", "RowTerms", "REDUCTIONS", "mean_of"]

REDUCTIONS = ("mean", "sum", "none")
_KEY = f"{cfg.HEAD_SECTION}.loss"


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The options of one head's loss (from its loss config, overridden by the head's keywords)."""
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float = 0.0
    reduction: str = "mean"

    @classmethod
    def build(cls, loss_config, normalised: bool, **overrides) -> "LossOptions":
        """From a parsed loss config (its fields, defaults where absent) and keyword overrides (None:
        keep the config's). Raises ConfigError naming the key, the value and what is allowed."""
        values = {f.name: getattr(loss_config, f.name, f.default) for f in dataclasses.fields(cls)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        opts = cls(**values)
        opts.validate(normalised)
        return opts

    def validate(self, normalised: bool) -> None:
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise cfg.ConfigError(f"{_KEY}.ignore_index: got {self.ignore_index!r}; must be an int")
        if not 0.0 <= float(self.label_smoothing) < 1.0:
            raise cfg.ConfigError(f"{_KEY}.label_smoothing: got {self.label_smoothing}; allowed: 0 <= x < 1")
        if not float(self.z_loss) >= 0.0:
            raise cfg.ConfigError(f"{_KEY}.z_loss: got {self.z_loss}; must be >= 0")
        if not float(self.softcap) >= 0.0:
            raise cfg.ConfigError(f"{_KEY}.softcap: got {self.softcap}; must be >= 0 (0: off)")
        if self.softcap and normalised:
            raise cfg.ConfigError(f"{_KEY}.softcap: got {self.softcap}; allowed only for the softmax loss (margin "
                                  "losses' logits are scale * cosine, bounded by the scale already): set 0")
        if self.reduction not in REDUCTIONS:
            raise cfg.ConfigError(f"{_KEY}.reduction: got {self.reduction!r}; allowed: "
                                  f"{', '.join(map(repr, REDUCTIONS))}")

    def refuse_sampled(self, sampler: str) -> None:
        """Sampled heads score K of the C classes: the smoothing's mean over all C classes and the z-loss's
        lse over all of them are not computed there, so they are refused rather than silently taken over
        the active classes. ignore_index, sample weights, reduction and softcap are per row or per logit
        and work as on the full head."""
        for key in ("label_smoothing", "z_loss"):
            if getattr(self, key):
                raise cfg.ConfigError(f"{_KEY}.{key}: got {getattr(self, key)}; not supported with the sampled "
                                      f"sampler {sampler!r} (it needs all C classes' logits, a sampled head scores "
                                      f"only its active classes): set {key} 0 or use sampler 'full'")

    def positives(self, y: torch.Tensor) -> torch.Tensor:
        """The labels (N,) a sampler sees: ignored rows as -1, nobody's positives."""
        return torch.where(y == self.ignore_index, torch.full_like(y, -1), y)

    def row_terms(self, y: torch.Tensor, num_classes: int, dtype: torch.dtype,
                  sample_weight: Optional[torch.Tensor] = None, lse_out: Optional[torch.Tensor] = None) -> "RowTerms":
        """The terms of the rows labelled ``y`` (N,): weights v (N,) in ``dtype``, 0 where ignored, times
        ``sample_weight`` (N,) when given (then ``signed``: it may be negative), and these options."""
        v = (y != self.ignore_index).to(dtype)  # (N,)
        if sample_weight is not None:
            v = v * sample_weight
        return RowTerms(weight=v, smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                        num_classes=num_classes, lse_out=lse_out, signed=sample_weight is not None)

    def describe(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return ", ".join(parts)


@dataclasses.dataclass
class RowTerms:
    """The per-row part of one fused call (rows of ``x`` in order).

    weight (N,) v_i in the statistics dtype (None: every row weighs 1); smoothing eps, z_loss,
    softcap; num_classes C (the smoothing's mean); rows_out / lse_out (N,) filled with v_i row_i
    and lse_i when given; ``signed``: some weights may be negative (the Triton kernels then run a second
    launch for those rows)."""
    weight: Optional[torch.Tensor] = None
    smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float = 0.0
    num_classes: int = 1
    rows_out: Optional[torch.Tensor] = None
    lse_out: Optional[torch.Tensor] = None
    signed: bool = False  # the weights may be negative (sample weights, reduction none's upstream gradient)

    def slice(self, a: int, b: int) -> "RowTerms":
        """The same terms for rows [a, b) (views: the outputs are written in place)."""
        cut = (lambda t: None if t is None else t[a:b])
        return dataclasses.replace(self, weight=cut(self.weight), rows_out=cut(self.rows_out),
                                   lse_out=cut(self.lse_out))

    def but(self, **changes) -> "RowTerms":
        """A copy with ``changes`` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    def with_weight(self, weight: Optional[torch.Tensor], signed: bool = False) -> "RowTerms":
        return dataclasses.replace(self, weight=weight, rows_out=None, lse_out=None, signed=self.signed or signed)

    @property
    def columns(self) -> int:
        """Columns of the row statistics: [max, sum-exp, target term] and, with smoothing, the logit sum."""
        return 4 if self.smoothing else 3

    def rows(self, lse: torch.Tensor, target: torch.Tensor, zsum: Optional[torch.Tensor], loss):
        """The loss rows (n,) from the merged statistics, unweighted, and D-Softmax's d(intra)/dc (else None)."""
        eps = self.smoothing
        d_intra = None
        if loss.separate_target:
            intra, d_intra = loss.target_term(target)
            rows = lse + (1.0 - eps) * intra
        else:
            rows = lse - (1.0 - eps) * target
        if eps:
            rows = rows - (eps / self.num_classes) * zsum
        if self.z_loss:
            rows = rows + self.z_loss * lse * lse
        return rows, d_intra

    def record(self, rows: torch.Tensor, lse: torch.Tensor, v: Optional[torch.Tensor]) -> torch.Tensor:
        """Weighted rows (n,): v_i row_i (0 where v_i is 0, whatever the row); fills the outputs."""
        if v is not None:
            rows = torch.where(v != 0, rows * v, torch.zeros_like(rows))
        if self.rows_out is not None:
            self.rows_out.copy_(rows)
        if self.lse_out is not None:
            self.lse_out.copy_(lse)
        return rows

    def target_grad(self, p_t, pfac, dz_t, unit: float, d_intra, loss) -> torch.Tensor:
        """d row / d c at the target (unweighted), less the smoothing's rank-1 share there (-eps/C times
        ``unit``, d z / d c off the target: the scale, or 1), which the rank-1 term adds back."""
        eps, c = self.smoothing, self.num_classes
        if loss.separate_target:  # the smoothing's target share (-eps/C s) is exactly the rank-1 term's
            return (1.0 - eps) * d_intra
        g = (p_t * pfac - (1.0 - eps)) * dz_t
        if eps:
            g = g + (eps / c) * (unit - dz_t)
        return g


DEFAULT_TERMS = RowTerms()


def mean_of(total: torch.Tensor, weight_sum: torch.Tensor) -> torch.Tensor:
    """total / weight_sum, and NaN without gradients where weight_sum is 0 (every row ignored: torch's
    mean over no rows is NaN; the gradients stay exact zeros, never NaN, so no weight or optimizer
    state takes a NaN)."""
    ok = weight_sum != 0
    safe = torch.where(ok, weight_sum, torch.ones_like(weight_sum)).to(total.dtype)
    return total / safe + torch.where(ok, 0.0, float("nan")).to(total.dtype)
