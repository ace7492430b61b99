"""The overlap pipeline inside XCEngine: building it from the config and one micro-step.

DeepSpeed specifics (0.19, ZeRO stage 0): the backbone's backward must go through
``engine.backward`` (direct ``tensor.backward`` is refused), so a chunk's backward is
``engine.backward((emb * grad).sum())``, whose gradient with respect to ``emb`` is
``grad`` (the engine divides it by the accumulation steps, as for a loss). The engine's
own all-reduce after backward is switched off when our bucketed reducer takes over
(``engine.enable_backward_allreduce = False``, as the compression wrapper does), or
held back for all but the last chunk when it does not.
"""
from __future__ import annotations

import logging

import torch

from ds_xc.config import HEAD_SECTION, ConfigError
from ds_xc.overlap.schedule import ChunkedHeadSchedule
from ds_xc.parallel.buckets import BucketedGradReducer
from ds_xc.parallel.timeline import Timeline

log = logging.getLogger(__name__)

__all__ = ["check_overlap", "build_overlap", "overlapped_micro_step", "end_micro_step"]


def check_overlap(overlap, zero_stage: int, bf16: bool) -> None:
    """Refuse overlap settings the engine cannot serve exactly (names the keys and the way out)."""
    if not overlap.enabled:
        return
    where = f"{HEAD_SECTION}.overlap"
    if overlap.chunk_backbone and (zero_stage != 0 or bf16):
        raise ConfigError(f"{where}.chunk_backbone=true with zero_optimization.stage={zero_stage}, bf16={bf16}: "
                          "one engine.backward per chunk is exact only for fp32 ZeRO stage 0 (the bf16 wrapper "
                          "and ZeRO accumulate per backward call); set chunk_backbone=false")
    if overlap.overlap_grad_reduce and (zero_stage != 0 or bf16):
        raise ConfigError(f"{where}.overlap_grad_reduce=true with zero_optimization.stage={zero_stage}, "
                          f"bf16={bf16}: the bucketed reduction replaces the fp32 ZeRO-0 all-reduce only (ZeRO and "
                          "the bf16 wrapper reduce their own buffers); set overlap_grad_reduce=false")


def build_overlap(engine, head, overlap, compression=None, head_comm_group=None, reduction=None, row_sparse=()):
    """(ChunkedHeadSchedule, BucketedGradReducer or None) for an engine and its head.

    ``head_comm_group``: the schedule's copy of the head's group (default: built by the
    schedule, which needs the head's group to span the world; ``initialize`` passes one made
    by every rank with ``copy_subgroups``). ``reduction``: the hierarchical all-reduce the
    backbone's buckets use (None: flat; ds_xc/engine/reduction.py). ``row_sparse``: the embedding tables whose
    gradients go as their nonzero rows (``topology.sparse_rows``)."""
    check_overlap(overlap, int(engine.zero_optimization_stage()), bool(engine.bfloat16_enabled()))
    timeline = Timeline(head.weight.device)
    schedule = ChunkedHeadSchedule(head, overlap.num_chunks, timeline=timeline, comm_group=head_comm_group)
    reducer = None
    if overlap.overlap_grad_reduce:
        params = [p for p in engine.module.parameters() if p.requires_grad]
        group = getattr(engine, "seq_data_parallel_group", None)
        if compression is not None:
            reducer = compression.overlapped_reducer(timeline=timeline, bucket_bytes=int(overlap.bucket_size_mb * 2**20))
        else:
            reducer = BucketedGradReducer(params, group, int(overlap.bucket_size_mb * 2**20), timeline,
                                          reduction=reduction, row_sparse=row_sparse)
            engine.enable_backward_allreduce = False
    log.info("overlap pipeline: %d chunks, backbone per chunk=%s, bucketed gradient reduction=%s",
             overlap.num_chunks, overlap.chunk_backbone, reducer is not None)
    return schedule, reducer


def overlapped_micro_step(xc, inputs, labels, batch_sizes=None) -> torch.Tensor:
    """Forward and backward of one micro-step through the overlap pipeline (see XCEngine.forward_backward).

    At an accumulation boundary the backbone's gradient buckets are left in flight: XCEngine.step
    steps the head first and waits for them only before the engine's step."""
    engine, schedule, reducer = xc.engine, xc.schedule, xc.grad_reducer
    overlap = xc.config.extreme_classification.overlap
    boundary = engine.is_gradient_accumulation_boundary()
    timeline = schedule.timeline
    timeline.begin_step()

    def backward(index: int, emb: torch.Tensor, grad: torch.Tensor, last: bool) -> None:
        if last and boundary and reducer is not None:
            reducer.arm()  # the hooks of this backward see the window's final gradients
        keep = engine.enable_backward_allreduce
        if not last:
            engine.enable_backward_allreduce = False  # the engine's own reduction: once, after the last chunk
        try:
            engine.backward((emb * grad).sum())
        finally:
            engine.enable_backward_allreduce = keep

    scale = 1.0 / engine.gradient_accumulation_steps()  # what engine.backward does to the loss
    if overlap.chunk_backbone:
        loss = schedule.run_backbone(engine, inputs, labels, batch_sizes, backward, weight_grad_scale=scale)
    else:
        loss = schedule.run(engine(inputs), labels, batch_sizes, backward, weight_grad_scale=scale)
    return loss


def end_micro_step(xc) -> None:
    """Close the micro-step's timeline (called by XCEngine.step, after the reduction was waited for)."""
    timeline = xc.schedule.timeline
    if not timeline.in_step:
        return
    every = xc.config.extreme_classification.overlap.log_every
    read = bool(every) and (timeline.steps + 1) % every == 0  # only a logged step waits for its events
    rec = timeline.end_step(read=read)
    if read:
        log.info("overlap timeline (micro-step %d): %s", timeline.steps, Timeline.format(rec))
