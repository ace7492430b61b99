"""Section ``gradient_compression``: how the data-parallel backbone gradients are reduced.

One pydantic model per section, ``extra="forbid"``, bounds next to the fields, cross-field
rules in a model validator (the style of ds_xc/config.py). :func:`parse_compression`
validates a dict (or passes a validated model through) and raises
:class:`ds_xc.config_base.ConfigError` (the same class as ``ds_xc.config.ConfigError``)
naming the key path, the value and what is allowed. ds_xc.compression.config re-exports it.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from ds_xc.config_base import COMPRESSION_SECTION, ConfigError, Section, validate_section

__all__ = ["COMPRESSION_SECTION", "PriorConfig", "HierarchyConfig", "PowerSGDConfig", "GradientCompressionConfig",
           "parse_compression", "ConfigError", "ADAM_WARMUP_STEPS", "PRESETS"]

ADAM_WARMUP_STEPS = 100  # the default warm-up when Adam's variance is frozen (docs/compression.md: how chosen)
# bayes_prior's keys a preset fills where the section leaves them out. tuned (the default, equal to the field
# defaults): a near-hard threshold, no exploration, thresholds every 2 steps; with select_by update it keeps the
# text task where the paper's formula is and lifts the glyphs CNN (docs/compression.md, "Ranking by the step");
# paper: the formula of the GSBP paper and the issue (p = min(1, |v|/tau), 10% exploration)
PRESETS = {"paper": {"exploit_power": 1.0, "stats_sync_interval": 10, "prior": {"strength": 0.1}},
           "tuned": {"exploit_power": 32.0, "stats_sync_interval": 2, "prior": {"strength": 0.0}}}


class PriorConfig(Section):
    """Exploration mixed into bayes_prior sampling (the Bayes prior on the gradient distribution).

    Exploitation keeps element i with probability min(1, |v_i| / tau), tau set for
    ``(1 - strength) * density``; exploration adds an independent draw with probability
    ``strength * density * w_b`` where w_b depends on the log-magnitude bin b of v_i.
    """
    form: Literal["uniform", "dirichlet"] = Field(
        "uniform", description="uniform: w_b = 1 (every element equally likely to be explored); "
        "dirichlet: w_b = n * pi_b / c_b with Dirichlet posterior mean pi_b = (c_b + a) / (N + B a) "
        "over the B bins of the global histogram (c_b elements in bin b), so sparsely populated "
        "magnitudes are explored more as the pseudo-count a grows (needs strength > 0 with bayes_prior).")
    strength: float = Field(0.0, ge=0.0, lt=1.0,
                            description="Share alpha of the density budget spent on exploration (preset "
                            "'paper': 0.1).")
    pseudo_count: float = Field(1.0, ge=0.0, le=1e9, description="Dirichlet pseudo-count a per bin "
                                "(form dirichlet only); 0 makes dirichlet equal to uniform.")


class HierarchyConfig(Section):
    """Node-aware reduction: dense inside a node, compressed across nodes."""
    ranks_per_node: int = Field(
        0, ge=0, le=1 << 16, description="Consecutive ranks of the group form a node (the launchers' "
        "rank order). 0 or 1: off (every rank exchanges compressed gradients with every other). "
        "> 1: reduce-scatter densely inside the node, exchange each slice sparsely with the same "
        "local rank of the other nodes, all-gather inside the node. Must divide the group size.")


class PowerSGDConfig(Section):
    """method powersgd: each compressed tensor's mean is approximated by a rank-r product P Q^T."""
    rank: int = Field(4, ge=1, le=1 << 16, description="Rank r of the approximation (capped per tensor at "
                      "min(n, m) of its (n, m) matrix view); each step all-reduces (n + m) r floats per tensor.")
    warm_start: bool = Field(True, description="Start each step's power iteration from the previous step's Q "
                             "(kept in the optimizer state, checkpointed); false: a fresh random Q every step.")


class GradientCompressionConfig(Section):
    """Section ``gradient_compression``: compressed data-parallel reduction of the backbone gradients."""
    method: Literal["none", "topk", "randomk", "bayes_prior", "powersgd"] = Field(
        "bayes_prior", description="none: dense all-reduce; topk: the k largest |v| per tensor "
        "(torch.topk); randomk: k random elements per tensor from a seed shared by the ranks "
        "(values-only all-reduce); bayes_prior: sampling from the global |v| distribution; "
        "powersgd: a low-rank approximation per tensor (one power iteration, see powersgd.rank).")
    density: float = Field(0.01, gt=0.0, le=1.0, description="Fraction of each compressed tensor's "
                           "elements sent per step (target; exact for topk/randomk, expected for bayes_prior; not "
                           "used by powersgd, whose traffic powersgd.rank sets).")
    error_feedback: bool = Field(True, description="Keep what was not sent (v - sent) and add it to "
                                 "the next step's gradient.")
    select_by: Literal["auto", "magnitude", "update"] = Field(
        "auto", description="What topk and bayes_prior rank: magnitude = |v|; update = |v| / sqrt(v-hat), v-hat the "
        "wrapped Adam(W)'s bias-corrected second moment, i.e. the size of the step the pending value would make, so "
        "a small consistent gradient is not starved by large noisy ones (ds_xc/compression/score.py); auto = update "
        "with an Adam (torch's Adam/AdamW, DeepSpeed's FusedAdam or DeepSpeedCPUAdam) that steps the reduced "
        "tensors (or their per-parameter fp32 masters, DeepSpeed's bf16 at ZeRO 0, or its partitions under ZeRO "
        "stage 1, gathered every score_sync_interval steps), else magnitude. update needs method topk or "
        "bayes_prior.")
    score_sync_interval: int = Field(
        64, ge=1, le=1 << 20, description="select_by update under ZeRO stage 1, whose Adam second moment is "
        "partitioned: Adam steps between all-gathers of it into the full-size snapshot the score divides by (at "
        "every power of two up to this many, then every this many steps); 1 = every step, ranking exactly as "
        "without ZeRO at 4 bytes per element a step; larger = a v-hat up to this many steps old, 4 bytes per "
        "element per interval (ds_xc/compression/zero_score.py).")
    warmup_steps: Optional[int] = Field(None, ge=0, description="Optimizer steps reduced densely before compression "
                                        "starts. Default (null): ADAM_WARMUP_STEPS when the wrapped optimizer's "
                                        "variance is frozen (adam_variance auto or frozen), whose estimate the "
                                        "warm-up provides, else 0.")
    density_warmup_steps: int = Field(0, ge=0, le=1 << 30, description="Compressed steps over which the density "
                                      "falls geometrically from density_warmup_start to density (DGC's warm-up: "
                                      "more of the gradient while it changes fastest, at a fraction of a dense "
                                      "warm-up's bytes); counted from the first compressed step (after "
                                      "warmup_steps); 0 = off. Not used by powersgd.")
    density_warmup_start: float = Field(0.25, gt=0.0, le=1.0, description="The density of the first compressed "
                                        "step under density_warmup_steps (DGC's 0.25); at least density.")
    adam_variance: Literal["auto", "frozen", "live"] = Field(
        "live", description="A wrapped torch.optim.Adam/AdamW under compression: frozen = the wrapper takes its "
        "steps with the second moment fixed at its (bias-corrected) value after the dense warm-up (error feedback "
        "sends an element as a burst of its residual, which inflates a live second moment and shrinks the "
        "steps; see ds_xc/compression/frozen_adam.py); live = the optimizer steps as it is; auto = frozen when "
        "it can be (Adam/AdamW without amsgrad or maximize, warmup_steps >= 1, error feedback, an element-"
        "selecting method), else live. frozen needs a warm-up (warmup_steps null or >= 1). Default live: frozen "
        "won on the text task and lost badly on the glyphs CNN (docs/compression.md).")
    preset: Literal["paper", "tuned"] = Field(
        "tuned", description="bayes_prior's exploitation power, exploration and threshold sync interval where the "
        "section does not set them: tuned = exploit_power 32, no exploration, thresholds every 2 steps (the field "
        "defaults; chosen on the text and glyphs tasks with select_by update, see docs/compression.md); paper = "
        "the GSBP paper's formula (exploit_power 1, prior.strength 0.1, stats_sync_interval 10).")
    stats_sync_interval: int = Field(2, ge=1, le=1 << 20, description="bayes_prior: steps between "
                                     "all-reduces of the |v| histograms that set the thresholds (and, "
                                     "with allocation nonzero, between measurements of the allocation).")
    stats_samples: int = Field(262144, ge=0, description="bayes_prior: elements per tensor and rank "
                               "drawn (uniformly) into the histogram at a sync; 0 = every element.")
    exploit_power: float = Field(32.0, ge=1.0, le=64.0, description="bayes_prior: exponent k of the "
                                 "exploitation probability min(1, (|v|/tau)^k); 1 = proportional to |v| "
                                 "(docs/papers.md), larger = closer to a hard threshold (top-k like).")
    prior: PriorConfig = Field(default_factory=PriorConfig, description="bayes_prior exploration.")
    bins: int = Field(128, ge=16, le=4096, description="bayes_prior: log2-spaced histogram bins over "
                      "the 32 octaves below the global max |v| of a tensor.")
    min_numel: int = Field(4096, ge=1, description="Tensors with fewer elements are reduced densely.")
    granularity: Literal["tensor", "bucket"] = Field(
        "tensor", description="tensor: each compressed tensor sends its own density share (own threshold); "
        "bucket: one selection over all compressed tensors together, the budget going to the largest "
        "|v| wherever they are.")
    allocation: Literal["auto", "nonzero", "numel"] = Field(
        "auto", description="How the budget (density x all compressed elements) is shared among the "
        "tensors (granularity tensor). nonzero: in proportion to the nonzero elements of their fresh "
        "gradients (summed over the ranks, re-measured every stats_sync_interval steps; at least "
        "density x size), so a row-sparse embedding gradient does not take the budget of dense layers "
        "and every nonzero waits about as long in the residual; numel: each tensor sends density x its "
        "size; auto: nonzero for the magnitude-aware methods (topk, bayes_prior), numel for randomk "
        "(whose uniform draws reach every element equally often, zero or not). nonzero and numel agree "
        "when no gradient element is exactly zero. Not used by powersgd.")
    value_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the values on the wire (indices travel as 16-bit offsets "
        "inside 65536-element blocks plus one int32 count per block). The part lost by rounding "
        "stays in the residual.")
    momentum_correction: Optional[float] = Field(
        None, ge=0.0, lt=1.0, description="DGC momentum m: accumulate u = m u + g of the compressed tensors "
        "locally before error feedback and the selection, zero u where sent, and after a compressed reduction "
        "step without the wrapped optimizer's first moment: a torch Adam/AdamW every reduced tensor with beta1 0, "
        "a torch SGD the compressed ones with momentum 0 (ds_xc/compression/momentum.py). Default (null): m = "
        "that optimizer's own beta1 or momentum (read every step), where the wrapper steps it on the tensors it "
        "reduces (or, an Adam/AdamW, on their master copies inside DeepSpeed's ZeRO-1 or bf16 wrapper), else 0; "
        "0 = off. With another optimizer a number still sets m and its own momentum is the "
        "user's to turn off. Chosen on the glyphs CNN and the text task (docs/compression.md).")
    hierarchy: HierarchyConfig = Field(default_factory=HierarchyConfig, description="Node groups.")
    powersgd: PowerSGDConfig = Field(default_factory=PowerSGDConfig, description="method powersgd: rank and "
                                     "warm start (density and allocation do not apply to it).")
    seed: int = Field(0, ge=0, lt=2**62, description="Seed of the random-k indices and the sampling.")
    link_gbit_per_s: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="Speed of the slowest "
                                   "link between the ranks in Gbit/s, for the check whether compression pays "
                                   "(ds_xc.compression.pays): when > 0 and the cost model predicts the compressed "
                                   "reduction slower than the dense all-reduce, a WARNING is logged at start; "
                                   "after the warm-ups the measured step is judged against the predicted exact one "
                                   "(embedding tables as rows), a WARNING when it does not pay. "
                                   "0 = unknown: the checks log at DEBUG only.")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        """Fill the keys the preset names that the section leaves out (explicit keys win)."""
        if not (isinstance(data, dict) and isinstance(data.get("preset"), str) and data["preset"] in PRESETS):
            return data
        data = dict(data)
        for key, value in PRESETS[data["preset"]].items():
            if key != "prior":
                data.setdefault(key, value)
            elif data.get("prior") is None or isinstance(data.get("prior"), dict):
                data["prior"] = dict(value, **(data.get("prior") or {}))
        return data

    @model_validator(mode="after")
    def _check(self):
        if (self.momentum_correction or 0.0) > 0.0 and not self.error_feedback:
            raise ValueError(f"momentum_correction={self.momentum_correction} needs error_feedback=true "
                             "(momentum correction accumulates what was not sent)")
        if self.adam_variance == "frozen" and (self.warmup_steps == 0 or self.method in ("none", "powersgd")
                                               or not self.error_feedback):
            raise ValueError(f"adam_variance='frozen' with warmup_steps={self.warmup_steps}, method={self.method!r}, "
                             f"error_feedback={self.error_feedback}: the variance is frozen after a dense warm-up, "
                             "for the bursts of error feedback; allowed: warmup_steps null or >= 1, method topk, "
                             "randomk or bayes_prior, error_feedback true (or adam_variance 'auto' / 'live')")
        if self.density_warmup_steps and self.density_warmup_start < self.density:
            raise ValueError(f"density_warmup_start={self.density_warmup_start} is below density={self.density}: "
                             "the warm-up starts above the density it falls to; allowed: density_warmup_start >= "
                             "density (or density_warmup_steps 0)")
        if self.select_by == "update" and self.method in ("randomk", "powersgd"):
            raise ValueError(f"select_by='update' with method={self.method!r}: {self.method} does not rank elements by "
                             "size; allowed: 'auto' or 'magnitude' (or method 'topk' / 'bayes_prior')")
        if self.method == "powersgd":
            self._check_powersgd()
        return self

    def _check_powersgd(self) -> None:
        """The settings of the element-selecting methods that have no meaning for a low-rank method."""
        where = "with method='powersgd'"
        if self.granularity != "tensor":
            raise ValueError(f"granularity={self.granularity!r} {where}: each tensor is its own matrix; "
                             "allowed: 'tensor'")
        if self.hierarchy.ranks_per_node > 1:
            raise ValueError(f"hierarchy.ranks_per_node={self.hierarchy.ranks_per_node} {where}: the node slices "
                             "of the flat bucket are not matrices; allowed: 0 or 1")
        if (self.momentum_correction or 0.0) > 0.0:
            raise ValueError(f"momentum_correction={self.momentum_correction} {where}: DGC momentum zeroes the "
                             "sent elements, and a low-rank approximation sends none exactly; allowed: 0.0")
        if self.value_dtype != "float32":
            raise ValueError(f"value_dtype={self.value_dtype!r} {where}: P and Q travel in float32 (the "
                             "orthonormalisation needs it); allowed: 'float32'")

    @property
    def resolved_allocation(self) -> str:
        """``allocation`` with ``auto`` resolved: numel for randomk, nonzero otherwise (powersgd: numel,
        whatever is set: it sends a rank, not a share of the elements)."""
        if self.method == "powersgd":
            return "numel"
        if self.allocation != "auto":
            return self.allocation
        return "numel" if self.method == "randomk" else "nonzero"

    @property
    def enabled(self) -> bool:
        """True when the section asks for a compressed reduction (method other than none)."""
        return self.method != "none"


def parse_compression(value: Any, prefix: str = COMPRESSION_SECTION) -> GradientCompressionConfig:
    """Validate the ``gradient_compression`` section (a dict, or a model passed through)."""
    return validate_section(GradientCompressionConfig, value, prefix)
