"""Configuration: the ds_xc sections of a DeepSpeed JSON config.

ds_xc reads its own top-level sections from the same JSON file that DeepSpeed reads
(DeepSpeed ignores keys it does not know). Each section is one pydantic model with
``extra="forbid"``, a docstring per field and bounds next to the field; cross-field
rules live in model validators. :func:`parse_config` validates the whole file and turns
every pydantic error into a :class:`ConfigError` whose message names the key path, the
bad value and what is allowed.

Sections: ``extreme_classification``, the class-parallel head (:class:`HeadConfig`); ``xc_train``, the
built-in training job of ``launch/train.py`` (:class:`TrainConfig`).
"""
from __future__ import annotations

import math
import os
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from typing_extensions import Annotated

from ds_xc.config_base import (COMPRESSION_SECTION, HEAD_SECTION, TRAIN_SECTION, ConfigError,  # noqa: F401
                               Section as _Section, load_raw, parse_json, validate_section, validation_error)
from ds_xc.config_compression import parse_compression
from ds_xc.config_topology import TopologyConfig
from ds_xc.config_schedule import ADAPTIVE_LR_SECTION, parse_adaptive_lr

__all__ = [
    "ConfigError", "LossConfig", "SamplerConfig", "HeadOptimizerConfig", "HeadConfig",
    "TrainConfig", "XCConfig", "parse_config", "parse_loss", "parse_sampler", "HEAD_SECTION", "TRAIN_SECTION",
    "COMPRESSION_SECTION", "validate_section", "validation_error", "load_raw", "UPDATE_MODES", "resolve_update",
    "XC_SECTIONS", "check_section_names", "parse_json",
]

# --------------------------------------------------------------------------- loss
class _LossOptions(_Section):
    """Options shared by every loss (docs/head.md, "Loss options"); ds_xc/head/row_terms.py applies them."""
    ignore_index: int = Field(-100, description="Rows whose label equals this add nothing to the loss or to any "
                              "gradient; the mean divides by the non-ignored rows of the global batch (as torch).")
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="eps of torch's label smoothing over all C "
                                   "classes of the head, on the logits the loss uses (the target's with its margin).")
    z_loss: float = Field(0.0, ge=0.0, description="Coefficient of lse^2 added to every row's loss (PaLM's z-loss; "
                          "lse = the row's log partition function, head.last_lse).")
    softcap: float = Field(0.0, ge=0.0, description="0: off; > 0: logits z -> softcap * tanh(z / softcap) "
                           "(softmax loss only: margin losses' logits are bounded by their scale already).")
    reduction: Literal["mean", "sum", "none"] = Field(
        "mean", description="mean: the (weighted) mean over the global batch's non-ignored rows; sum: their sum; "
        "none: this rank's rows' losses, the labels' shape.")


class _NormalisedLoss(_LossOptions):
    scale: float = Field(64.0, gt=0.0, le=1e4, description="Logit scale s applied to cosine logits.")

    @model_validator(mode="after")
    def _no_softcap(self):
        if self.softcap:
            raise ValueError(f"softcap = {self.softcap}: allowed only for the softmax loss (type 'softmax'); the "
                             f"{self.type} loss's logits are scale * cosine, bounded by scale = {self.scale} already: "
                             "set softcap 0")
        return self


class SoftmaxLoss(_LossOptions):
    """Plain softmax cross entropy on unnormalised logits x.w (no scale, no margin)."""
    type: Literal["softmax"] = "softmax"


class CosFaceLoss(_NormalisedLoss):
    """CosFace: target logit s * (cos - m)."""
    type: Literal["cosface"]
    margin: float = Field(0.35, ge=0.0, le=1.0, description="Additive cosine margin m.")


class ArcFaceLoss(_NormalisedLoss):
    """ArcFace: target logit s * cos(theta + m); s * (cos - m sin m) where theta + m > pi."""
    type: Literal["arcface"]
    margin: float = Field(0.5, ge=0.0, lt=math.pi / 2, description="Additive angular margin m (radians).")


class CombinedLoss(_NormalisedLoss):
    """Combined margin (InsightFace): target logit s * (cos(m1 * theta + m2) - m3)."""
    type: Literal["combined"]
    m1: float = Field(1.0, ge=0.5, le=4.0, description="Multiplicative angular margin.")
    m2: float = Field(0.3, ge=0.0, lt=math.pi / 2, description="Additive angular margin (radians).")
    m3: float = Field(0.2, ge=0.0, le=1.0, description="Additive cosine margin.")


class DSoftmaxLoss(_NormalisedLoss):
    """D-Softmax: log(1 + exp(s(d - cos_y))) + log(1 + sum_{k!=y} exp(s cos_k))."""
    type: Literal["dsoftmax"]
    d: float = Field(0.9, ge=-1.0, le=1.0, description="Intra-class cosine target d.")


LossConfig = Annotated[
    Union[SoftmaxLoss, CosFaceLoss, ArcFaceLoss, CombinedLoss, DSoftmaxLoss],
    Field(discriminator="type"),
]


# --------------------------------------------------------------------------- sampler
class FullSampler(_Section):
    """Every class of the shard is active: the exact softmax."""
    type: Literal["full"] = "full"


class UniformSampler(_Section):
    """Partial FC: this shard's positives in the global batch plus uniform random negatives."""
    type: Literal["uniform"]
    sample_rate: float = Field(0.1, gt=0.0, le=1.0,
                               description="Active classes per shard = max(ceil(sample_rate * num_local), "
                               "min(rows of the global batch, num_local)): room for every positive.")


def _retrieved_share_field(what: str):
    """``retrieved_share`` of the ann and knn samplers (one rule: ds_xc/sampling/active.py)."""
    return Field(0.5, gt=0.0, le=1.0, description=f"Most of the budget left after the positives that {what} "
                 "may take; the rest is uniform fill, which keeps updating the tail of the softmax (1.0: "
                 f"{what} first, fill only when they run out; measurements in docs/ann.md).")


def _rebuild_warmup_field():
    """``rebuild_warmup`` of the ann index and the knn graph (schedule: ds_xc/sampling/base.rebuild_due)."""
    return Field(16, ge=0, description="Early rebuilds: the first after this many steps, then at doubling gaps "
                 "(16, 32, 64, ...) until the gap reaches rebuild_interval; an index built from the initial "
                 "weights goes stale fastest. 0 = fixed interval only.")


class AnnSampler(_Section):
    """ANN softmax: per sample, the classes of highest logit retrieved from a binary-code
    inverted file over the shard's weights; active set = positives, then retrieved classes
    by rank, then uniform fill, max(ceil(sample_rate * num_local), min(rows, num_local)) classes."""
    type: Literal["ann"]
    sample_rate: float = Field(0.1, gt=0.0, le=1.0,
                               description="Active classes per shard and group = max(ceil(sample_rate * "
                               "num_local), min(rows of the group, num_local)): room for every positive.")
    code_bits: int = Field(512, ge=32, le=1024, multiple_of=32, description="Bits of each binary code.")
    rotation: Literal["random", "itq"] = Field(
        "random", description="random: random orthogonal rotation then sign (SimHash); itq: rotation "
        "learned by iterative quantisation (needs code_bits <= embedding_dim).")
    code_precision: Literal["auto", "float32", "bfloat16"] = Field("auto", description="Projection precision of "
        "the codes (bfloat16: ~3x faster where bf16 matmuls are native, 0.07% of bits differ; auto = bfloat16 on "
        "CUDA and CPUs with AVX512_BF16/AMX). Dense updates' safe-radius refresh always encodes in float32.")
    nlist: int = Field(0, ge=0, description="Inverted lists (spherical k-means centroids); 0 = round(sqrt(num_local)).")
    nprobe: int = Field(32, ge=1, description="Lists scanned per query at least (capped at nlist).")
    scan_rows: int = Field(65536, ge=0, description="Rows scanned per query at least, over the whole head "
                           "(scan_budget head): each shard scans its share ceil(scan_rows * num_local / "
                           "num_classes), so 1 and P ranks scan the same total; beyond the nprobe lists, the "
                           "next lists by centroid score are added until the share is covered, and a shard "
                           "within its share is scanned flat (the scan costs 1-2.5 ns per row and query at 512 "
                           "bits on one CPU core with AVX-512 VPOPCNTDQ, 2.5-4 ns without); 0 = nprobe lists only.")
    top_k: int = Field(64, ge=1, le=4096, description="Classes retrieved per sample, over the whole head "
                       "(scan_budget head): each shard keeps its share ceil(top_k * num_local / num_classes), "
                       "at least top_k_min, of its re-ranked candidates, so the rows retrieved, re-encoded and "
                       "gathered per rank shrink with more ranks; per shard under scan_budget shard.")
    top_k_min: int = Field(16, ge=1, le=4096, description="Least classes a shard retrieves per sample under "
                           "scan_budget head (capped at top_k). With rerank on, the kept rows are a shard's "
                           "best candidates by exact score, so any value >= 10 leaves recall@10 in the union of "
                           "the shards equal to keeping top_k on every shard wherever a shard's rerank share is "
                           "at least top_k (at the defaults: up to 4 ranks).")
    rerank: int = Field(256, ge=0, le=16384, description="Candidates per sample re-ranked by the exact "
                        "cosine before keeping top_k, over the whole head (scan_budget head): each shard "
                        "re-ranks its share ceil(rerank * num_local / num_classes), at least top_k (0 = rank "
                        "by Hamming distance only).")
    scan_budget: Literal["head", "shard"] = Field(
        "head", description="What scan_rows, rerank and top_k count: head = rows, candidates and retrieved "
        "classes per query over all shards, each shard taking its share of its classes (the same recall and "
        "total work at any world size); shard = per shard, whatever the world size (the behaviour before "
        "issue 16: every rank scans scan_rows rows and keeps top_k classes per query, so retrieval does not "
        "shrink with more ranks).")
    retrieved_share: float = _retrieved_share_field("retrieved classes")
    groups: int = Field(1, ge=1, le=1024, description="Sample groups G: the global batch is split into G "
                        "groups, each with its own active set.")
    encode_interval: int = Field(1, ge=0, description="Re-encode the rows the optimizer changed every N "
                                 "steps (0 = only at rebuilds).")
    encode_rows: Literal["retrieved", "active"] = Field(
        "retrieved", description="Which changed rows are re-encoded between rebuilds: retrieved = the "
        "positives and retrieved classes (large updates); active = also the uniform fill, whose updates "
        "are the small softmax probabilities of easy negatives. Every row is re-encoded at each rebuild.")
    rebuild_interval: int = Field(1000, ge=0, description="Re-run k-means and re-encode every row every N "
                                  "steps (0 = only at start and after loading).")
    rebuild_warmup: int = _rebuild_warmup_field()
    kmeans_iterations: int = Field(10, ge=1, le=100, description="Spherical k-means iterations per rebuild.")
    background_rebuild: bool = Field(
        False, description="Run the periodic rebuild in a background thread on a snapshot of the weights, "
        "keeping the old index (with re-encoded rows) until it is done; the swap time depends on the "
        "machine, so runs are no longer bitwise reproducible.")
    backend: Literal["auto", "torch", "cpu", "cuda", "triton", "faiss"] = Field(
        "auto", description="Hamming scan kernel (ops/hamming.py): auto picks cuda, then triton (CUDA "
        "tensors, k <= 1024), then the C++ kernel for CPU tensors, then PyTorch.")
    metrics_interval: int = Field(0, ge=0, description="Log recall@k against the exact top-k and the "
                                  "covered softmax mass every N steps (0 = off; costs an exact pass).")

    @model_validator(mode="after")
    def _check(self):
        if self.rerank and self.rerank < self.top_k:
            raise ValueError(f"rerank={self.rerank} must be 0 or >= top_k={self.top_k}")
        return self


class KnnSampler(_Section):
    """KNN softmax: a k-nearest-neighbour graph over the shard's class weights; active set =
    positives, then their graph neighbours, then uniform fill."""
    type: Literal["knn"]
    sample_rate: float = Field(0.1, gt=0.0, le=1.0,
                               description="Active classes per shard = max(ceil(sample_rate * num_local), "
                               "min(rows of the global batch, num_local)): room for every positive.")
    neighbors: int = Field(32, ge=1, le=1024, description="Neighbours per class in the graph (10 to 100 usual).")
    retrieved_share: float = _retrieved_share_field("graph neighbours")
    rebuild_interval: int = Field(1000, ge=0, description="Rebuild the graph every N steps (0 = only at "
                                  "start and after loading).")
    rebuild_warmup: int = _rebuild_warmup_field()
    graph: Literal["exact", "ann"] = Field(
        "exact", description="exact: chunked matmul + top-k over the shard (O(L^2 d)); ann: through the "
        "binary-code inverted file of the ann sampler (for large shards).")


SamplerConfig = Annotated[Union[FullSampler, UniformSampler, AnnSampler, KnnSampler],
                          Field(discriminator="type")]


# --------------------------------------------------------------------------- head optimizer
class HeadOptimizerConfig(_Section):
    """The optimizer of the head shards (stepped together with the DeepSpeed engine)."""
    type: Literal["sgd", "adamw"] = Field("sgd", description="sgd (with momentum) or adamw.")
    lr: float = Field(0.1, gt=0.0, le=1e3, description="Learning rate of the head.")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum.")
    nesterov: bool = Field(False, description="SGD Nesterov momentum.")
    weight_decay: float = Field(5e-4, ge=0.0, le=1.0, description="Weight decay (decoupled for adamw).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0.0, le=1.0, description="AdamW epsilon.")
    update: Literal["auto", "dense", "lazy", "frozen", "lazy_exact"] = Field(
        "auto", description="auto (the default, resolved when the head is built and logged once): dense for "
        "the full sampler, lazy_exact for sampled heads (uniform, ann, knn; lazy for bfloat16 heads, which "
        "lazy_exact does not support). dense: exact dense optimizer semantics, every row every step, O(L*d); "
        "lazy (alias frozen): only the active rows (and their optimizer state) are touched each step, O(K*d) "
        "per step, inactive rows stay frozen (no momentum, no weight decay); lazy_exact: O(K*d) per step too, "
        "but a row that becomes active is first caught up on the zero-gradient steps it skipped, so the "
        "trajectory is the dense one for the same active sets (SGD exactly; AdamW up to a relative "
        "eps/sqrt(v) on the skipped steps' displacement); float32/float64 heads only. See docs/head.md "
        "(Exact lazy updates).")
    bf16_update: Literal["stochastic_rounding", "master_fp32", "plain"] = Field(
        "stochastic_rounding", description="How the head optimizer writes updates into bfloat16 weights "
        "(dtype: bfloat16 only; ignored otherwise). stochastic_rounding: float32 update, stochastically "
        "rounded bf16 weights and first moments, float32 AdamW second moment (SGD 4 B/weight, AdamW 8 B, "
        "vs 8 and 12 in float32); master_fp32: a float32 master copy and float32 states (SGD 10 B, "
        "AdamW 14 B: the float32 trajectory, more memory than float32); plain: round to nearest, all "
        "states bf16 (updates below half a bf16 ulp are lost). See docs/head.md (bf16 head).")
    lr_schedule: Literal["follow_engine", "constant"] = Field(
        "follow_engine", description="follow_engine: before each head step, head lr = lr * the engine's lr of "
        "this step / the schedule's reference lr (a torch scheduler's base_lrs, DeepSpeed WarmupLR's "
        "warmup_max_lr, WarmupCosineLR's optimizer lr; without a scheduler the engine's lr at initialize), so "
        "lr is the head's lr at the schedule's peak; a scheduler without one is refused at initialize (see "
        "docs/optimizers.md, 'The head's learning rate'). constant keeps lr.")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas):
        # a field validator, so that the error's key path ends in ".betas"
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}]={b!r} must be in [0, 1)")
        return betas

    @model_validator(mode="after")
    def _check(self):
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("nesterov=true needs momentum > 0")
        return self


UPDATE_MODES = ("dense", "lazy", "frozen", "lazy_exact")  # what "auto" resolves among
_EXACT_LAZY_DTYPES = ("float32", "float64")


def resolve_update(update: str, sampler_type: str, dtype: str) -> tuple[str, str]:
    """``extreme_classification.optimizer.update`` as it runs: (mode, why). "auto" is dense for the
    full sampler (every row is active: a lazy step would touch every row anyway) and lazy_exact for
    sampled heads (the dense trajectory at O(K*d) per step), lazy for bfloat16 sampled heads (lazy_exact
    keeps float32/float64 rows only). An explicit mode is kept; lazy_exact with a bfloat16 head is a
    ConfigError naming the field, the value and what is allowed."""
    if update not in UPDATE_MODES + ("auto",):
        raise ConfigError(f"{HEAD_SECTION}.optimizer.update: got {update!r}; allowed: "
                          f"{', '.join(map(repr, ('auto',) + UPDATE_MODES))}")
    if update == "lazy_exact" and dtype not in _EXACT_LAZY_DTYPES:
        raise ConfigError(f"{HEAD_SECTION}.optimizer.update: got 'lazy_exact' with {HEAD_SECTION}.dtype "
                          f"{dtype!r}; lazy_exact needs dtype {' or '.join(map(repr, _EXACT_LAZY_DTYPES))}; "
                          f"with {dtype!r} allowed: 'auto', 'dense', 'lazy', 'frozen'")
    if update != "auto":
        return update, "set in the config"
    if sampler_type == "full":
        return "dense", "auto: the full sampler makes every row active each step"
    if dtype not in _EXACT_LAZY_DTYPES:
        return "lazy", (f"auto: sampler {sampler_type!r} with a {dtype} head (lazy_exact keeps float32/float64 "
                        "rows only): lazy, inactive rows neither decay nor move")
    return "lazy_exact", f"auto: sampler {sampler_type!r}: the dense trajectory at O(K*d) per step"


class OverlapConfig(_Section):
    """Section ``extreme_classification.overlap``: hide communication under computation (ds_xc/overlap)."""
    enabled: bool = Field(False, description="Run the chunked, overlapped schedule in XCEngine.forward_backward "
                          "(launch/train.py uses it); off = the serial path.")
    num_chunks: int = Field(2, ge=1, le=256, description="Micro-chunks of the local batch: chunk i+1's "
                            "all-gather and chunk i's gradient reduce-scatter run while a chunk computes.")
    chunk_backbone: bool = Field(False, description="Run the backbone forward per chunk too, so that a chunk's "
                                 "backbone backward starts as soon as its embedding gradient arrives and its "
                                 "gather overlaps the next chunk's forward (needs rows that are independent: no "
                                 "BatchNorm over the batch; fp32 ZeRO-0). Only the last chunk's backward then hides "
                                 "the gradient reduction; false (one backbone graph) hides it under the whole "
                                 "backward.")
    overlap_grad_reduce: bool = Field(True, description="Reduce the backbone's gradients in buckets issued "
                                      "from gradient hooks during the backward (replaces DeepSpeed's reduction "
                                      "after it; ZeRO stage 0 only), compressed buckets too when "
                                      "gradient_compression is on.")
    bucket_size_mb: float = Field(4.0, gt=0.0, le=4096.0, description="Bucket size of the overlapped "
                                  "backbone gradient reduction, in MiB of fp32 gradients.")
    log_every: int = Field(0, ge=0, description="Log the step timeline (compute, communication issued, "
                           "exposed) every N steps; 0 = never (it is still collected, see overlap_stats()).")


class HeadConfig(_Section):
    """Section ``extreme_classification``: the class-parallel classifier head."""
    num_classes: int = Field(..., ge=2, le=10**10, description="Total number of classes C.")
    embedding_dim: int = Field(..., ge=1, le=65536, description="Embedding dimension d.")
    loss: LossConfig = Field(default_factory=SoftmaxLoss, description="Loss and margin.")
    sampler: SamplerConfig = Field(default_factory=FullSampler, description="Active-class sampler.")
    chunk_size: int = Field(0, ge=0, description="Rows of the global batch per logits chunk; 0 = one chunk.")
    softmax_backend: Literal["auto", "torch", "triton"] = Field(
        "torch", description="Implementation of the exact (fused) softmax and margin losses: torch = the chunked "
        "PyTorch path (any device and dtype); triton = the fused Triton kernels of ds_xc/head/triton_softmax.py (CUDA "
        "tensors, float32/bfloat16/float16 weights; the (N, K) logits never exist; chunk_size is ignored); "
        "auto = triton for CUDA tensors with bfloat16/float16 weights when triton imports (1.4-2x faster than torch "
        "on an H200), else torch (float32 weights: 4x slower in triton). Details in docs/ops.md.")
    dtype: Literal["float32", "float64", "bfloat16"] = Field("float32", description="Head weight dtype.")
    init_std: float = Field(0.01, gt=0.0, le=10.0, description="Std of the normal init of the weights.")
    seed: int = Field(0, ge=0, lt=2**63, description="Seed of the weight init (per class, independent "
                      "of the world size) and of the samplers.")
    check_inputs: bool = Field(True, description="Check label ranges, embedding shapes, devices and finiteness "
                               "before the step, agreed by every rank (one small all-reduce that also exchanges "
                               "the batch sizes; one host sync on GPU).")
    check_interval: int = Field(1, ge=1, le=10**6, description="Run the full input check every N-th head call "
                                "(1 = every call). Other calls only exchange the batch sizes (with a label-range "
                                "test) when batch_sizes is not passed, and run without any sync when it is: an "
                                "out-of-range label then makes that step's loss NaN and is raised at the next check.")
    nonfinite: Literal["skip", "raise"] = Field(
        "skip", description="NaN/Inf in the embeddings, the loss or the gradients: skip = every rank skips the "
        "optimizer step (head, backbone and their optimizer states unchanged), logs a warning and counts it "
        "(XCEngine.stats()['skipped_steps']); raise = every rank raises FloatingPointError.")
    input_parallel: Literal["data", "replicated"] = Field(
        "data", description="How the embeddings are spread over the head's group: data = each rank passes its own "
        "rows (all-gathered; the loss is the mean over every rank's rows and each rank gets P times the gradient "
        "of that mean for its rows); replicated = every rank passes the same rows, as under tensor (vocab) "
        "parallelism: no gather or reduce-scatter, the loss is the mean over the given rows and every rank gets "
        "the full gradient with respect to them (the partial gradients all-reduced over the group). Every sampler "
        "works with either; the overlap pipeline needs data.")
    cuda_graphs: bool = Field(False, description="Capture the head's training step (forward, backward, head optimizer "
                              "step) as a CUDA graph and replay it (ds_xc/head/graphs.py, docs/head.md): one rank, "
                              "check_interval > 1, float32 or float64 weights, softmax_backend torch, nonfinite raise, "
                              "no gradient accumulation, no overlap; steps with host work (checks, index rebuilds) "
                              "run eagerly. What cannot be captured is refused at initialize, naming this key.")
    optimizer: HeadOptimizerConfig = Field(default_factory=HeadOptimizerConfig, description="Head optimizer.")
    overlap: OverlapConfig = Field(default_factory=OverlapConfig, description="Overlap pipeline.")
    topology: TopologyConfig = Field(default_factory=TopologyConfig, description="Node layout, dense reduction.")

    @model_validator(mode="after")
    def _check_input_parallel(self):
        if self.input_parallel == "replicated" and self.overlap.enabled:
            raise ValueError("input_parallel='replicated' with overlap.enabled=true: the overlap pipeline hides the "
                             "gathers of input_parallel='data' (the replicated head has none); disable overlap")
        return self

    @model_validator(mode="after")
    def _check_sampled_loss(self):
        for key in ("label_smoothing", "z_loss"):  # over all C classes: a sampled head scores K of them
            if self.sampler.type != "full" and getattr(self.loss, key):
                raise ValueError(f"loss.{key}={getattr(self.loss, key)} with sampler {self.sampler.type!r}: it needs "
                                 "every class's logit, a sampled head scores only its active classes; set "
                                 f"loss.{key} 0 or use sampler 'full'")
        if self.overlap.enabled and self.loss.reduction == "none":
            raise ValueError("loss.reduction='none' with overlap.enabled=true: the overlap pipeline needs the "
                             "batch's loss; use 'mean' or 'sum'")
        return self

    @model_validator(mode="after")
    def _check_update(self):
        if self.optimizer.update == "lazy_exact" and self.dtype not in _EXACT_LAZY_DTYPES:
            raise ValueError(f"optimizer.update='lazy_exact' needs dtype {' or '.join(_EXACT_LAZY_DTYPES)}, "
                             f"got dtype={self.dtype!r}; with {self.dtype} allowed: 'auto' (resolves to lazy), "
                             "'dense', 'lazy', 'frozen'")
        return self


# --------------------------------------------------------------------------- training job
class TrainConfig(_Section):
    """Section ``xc_train``: the built-in job of ``launch/train.py`` (flags override it)."""
    data: Literal["text", "synthetic", "corpus", "glyphs"] = Field(
        "text", description="Built-in data set (docs/data.md, docs/glyphs.md); corpus and glyphs fetch Debian "
        "packages on first use.")
    max_steps: int = Field(300, ge=1, description="Optimizer steps to train.")
    eval_every: int = Field(100, ge=0, description="Held-out evaluation every N steps (0 = only at the end).")
    eval_samples: int = Field(4096, ge=1, description="Held-out samples per evaluation (at most).")
    log_every: int = Field(10, ge=1, description="Steps between progress and monitor updates.")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only at the end, if save_dir).")
    hidden_dim: int = Field(256, ge=1, description="Hidden width of the built-in backbone.")
    context: int = Field(4, ge=1, le=64, description="Previous words used as input (text and corpus data).")
    text_mode: Literal["word", "bigram"] = Field(
        "word", description="text data: the label is the next word (num_classes = vocabulary size, up to "
        "about 1.1e5 words) or the pair of the next two words (num_classes pair classes, about 9e5 exist; "
        "docs/data.md).")
    text_vocab_size: int = Field(0, ge=0, le=250_000, description="text data, bigram mode: input word "
                                 "vocabulary, 1e3 to 2.5e5; 0 = 20000. Must be 0 in word mode (the "
                                 "vocabulary is extreme_classification.num_classes).")
    corpus_mode: Literal["word", "bigram"] = Field(
        "word", description="corpus data: the label is the next word (num_classes = vocabulary size, "
        "useful from 1e4 to 2.5e5) or the pair of the next two words (num_classes pair classes, "
        "about 2.8e6 exist).")
    corpus_vocab_size: int = Field(0, ge=0, le=250_000, description="corpus data, bigram mode: input word "
                                   "vocabulary, 1e4 to 2.5e5; 0 = 100000. Must be 0 in word mode (the "
                                   "vocabulary is extreme_classification.num_classes).")
    seed: int = Field(0, ge=0, description="Seed of the backbone init and the data order.")
    eval_class_split: int = Field(0, ge=0, description="Class id C: the held-out evaluation also reports the "
                                  "top-1 of classes below C and of classes C and up (a grown class set's old and "
                                  "new classes, docs/growing.md); 0 = off.")
    comm_timeout_s: float = Field(1800.0, ge=1.0, le=86400.0, description="Process-group timeout: a collective "
                                  "that waits longer (a peer died or hangs) raises, and every surviving rank "
                                  "exits naming the lost peer when it can. Applies to the world group that "
                                  "launch/train.py or ds_xc.initialize starts and to every group ds_xc creates; "
                                  "with a process group you started, to ds_xc's groups only (unset: they take "
                                  "your world group's timeout).")

    @model_validator(mode="after")
    def _check_vocab_sizes(self):
        for name, least in (("text", 1_000), ("corpus", 10_000)):
            size, mode = getattr(self, f"{name}_vocab_size"), getattr(self, f"{name}_mode")
            if size and size < least:
                raise ValueError(f"{name}_vocab_size={size} must be 0 or in [{least}, 250000]")
            if size and mode == "word":
                raise ValueError(f"{name}_vocab_size={size} applies to {name}_mode='bigram' only: in word "
                                 "mode the vocabulary is extreme_classification.num_classes; use 0")
        return self


class XCConfig(BaseModel):
    """All ds_xc sections of one DeepSpeed config; absent optional sections are None."""
    model_config = ConfigDict(extra="ignore")
    extreme_classification: Optional[HeadConfig] = None
    xc_train: TrainConfig = Field(default_factory=TrainConfig)
    # a ds_xc.config_compression.GradientCompressionConfig (parse_compression validates it)
    gradient_compression: Optional[Any] = None
    adaptive_lr: Optional[Any] = None  # a ds_xc.config_schedule.AdaptiveLRConfig (parse_adaptive_lr validates it)


_SECTIONS = (HEAD_SECTION, TRAIN_SECTION)
class _LossHolder(BaseModel):
    model_config = ConfigDict(extra="forbid")
    loss: LossConfig


class _SamplerHolder(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sampler: SamplerConfig


def parse_loss(value: Any):
    """Validate a loss config given alone: a model, a dict, or the bare type name."""
    if isinstance(value, str):
        value = {"type": value}
    if isinstance(value, BaseModel):
        return value
    return validate_section(_LossHolder, {"loss": value}, HEAD_SECTION).loss


def parse_sampler(value: Any):
    """Validate a sampler config given alone: a model, a dict, or the bare type name."""
    if isinstance(value, str):
        value = {"type": value}
    if isinstance(value, BaseModel):
        return value
    return validate_section(_SamplerHolder, {"sampler": value}, HEAD_SECTION).sampler


XC_SECTIONS = (HEAD_SECTION, TRAIN_SECTION, COMPRESSION_SECTION, ADAPTIVE_LR_SECTION)  # ds_xc's top-level sections


def check_section_names(raw: dict) -> None:
    """Refuse a top-level key that is not a ds_xc section but nearly spells one ("extreme_clasification",
    "xc-train"): DeepSpeed ignores keys it does not know, so the section's settings would be lost and
    the error would name a key missing from the real section instead. The ConfigError suggests the
    section (difflib, case and "-" ignored)."""
    import difflib
    for key in raw:
        if not isinstance(key, str) or key in XC_SECTIONS:
            continue
        folded = key.lower().replace("-", "_").replace(" ", "_")
        close = difflib.get_close_matches(folded, XC_SECTIONS, n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"top-level section {key!r} is not a ds_xc section: did you mean {close[0]}? "
                              f"(ds_xc's sections: {', '.join(XC_SECTIONS)}; DeepSpeed ignores unknown keys, so "
                              f"its settings would be lost)")


def parse_config(config: Union[str, os.PathLike, dict]) -> XCConfig:
    """Validate the ds_xc sections of a whole DeepSpeed config (a dict or a path to the JSON).

    Keys that belong to DeepSpeed are left alone; each ds_xc section is validated by its
    model, and any problem raises :class:`ConfigError` naming the key path. A top-level key
    that nearly spells a ds_xc section is refused with a suggestion (:func:`check_section_names`).
    """
    raw = load_raw(config)
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a JSON object, got {type(raw).__name__}")
    check_section_names(raw)
    sections: dict[str, Any] = {}
    if HEAD_SECTION in raw:
        sections[HEAD_SECTION] = validate_section(HeadConfig, raw[HEAD_SECTION], HEAD_SECTION)
    if TRAIN_SECTION in raw:
        sections[TRAIN_SECTION] = validate_section(TrainConfig, raw[TRAIN_SECTION], TRAIN_SECTION)
    if COMPRESSION_SECTION in raw:
        sections[COMPRESSION_SECTION] = parse_compression(raw[COMPRESSION_SECTION])
    if ADAPTIVE_LR_SECTION in raw:
        sections[ADAPTIVE_LR_SECTION] = parse_adaptive_lr(raw[ADAPTIVE_LR_SECTION])
    return XCConfig(**sections)
