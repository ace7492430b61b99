"""The backbone's dense reduction on the node layout: DeepSpeed's flat all-reduce or ds_xc's hierarchical one.

:func:`plan_reduction` detects the layout of the engine's data-parallel group (from the
launcher: ds_xc/parallel/topology.py) and resolves ``extreme_classification.topology.reduction``.
When the answer is hierarchical, ds_xc owns the backbone's reduction, the way the overlap
pipeline's bucketed reducer does (``engine.enable_backward_allreduce = False``): a
:class:`~ds_xc.parallel.buckets.BucketedGradReducer` on the
:class:`~ds_xc.parallel.hierarchical.HierarchicalAllReduce`, armed before the last backward of
an accumulation window (XCEngine.backward) and finished in XCEngine.step. The compressed
reduction gets the same layout's node groups (:func:`compression_nodes`) unless its
``hierarchy.ranks_per_node`` sets one by hand. That takeover is exact only for fp32 at ZeRO
stage 0 (ZeRO and the bf16 wrapper reduce their own buffers): there, ``auto`` stays flat and
``hierarchical`` is refused. Where the scheme applies, ``auto`` times both reductions on a probe of
the bucket size (ds_xc/parallel/reduction_probe.py) and keeps the faster; forced modes do not probe.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ds_xc.config import HEAD_SECTION, ConfigError
from ds_xc.parallel import node_gather, reduction_probe
from ds_xc.parallel.buckets import BucketedGradReducer
from ds_xc.parallel.groups import copy_subgroups, group_ranks, spans_world
from ds_xc.parallel.hierarchical import HierarchicalAllReduce
from ds_xc.parallel.node_gather import NodeGather
from ds_xc.parallel.topology import NodeLayout, choose_reduction, detect_layout

log = logging.getLogger(__name__)

__all__ = ["DenseReduction", "plan_reduction", "plan_head_collectives", "compression_nodes", "take_over_reduction",
           "check_sparse_rows", "row_sparse_params", "embedding_tables"]


@dataclass
class DenseReduction:
    """The layout, the mode in use ('flat' or 'hierarchical'), the hierarchical all-reduce (None when flat) and
    auto's probe times ({mode: median seconds}; None when there was no probe)."""
    layout: NodeLayout
    mode: str
    hier: Optional[HierarchicalAllReduce] = None
    probe: Optional[dict] = None


def _refuse_or_flat(topology, why: str) -> str:
    if topology.reduction == "hierarchical":
        raise ConfigError(f"{HEAD_SECTION}.topology.reduction='hierarchical' {why}; use 'auto' or 'flat'")
    log.info("topology: flat reduction (%s)", why)
    return "flat"


def plan_reduction(engine, topology, group, compression: bool) -> DenseReduction:
    """Detect ``group``'s node layout and choose the reduction (collective over ``group``, every rank alike)."""
    layout = detect_layout(group, topology.ranks_per_node)
    mode = choose_reduction(topology.reduction, layout)
    stage, bf16 = int(engine.zero_optimization_stage()), bool(engine.bfloat16_enabled())
    if mode == "hierarchical" and not compression and (stage != 0 or bf16):
        mode = _refuse_or_flat(topology, f"with zero_optimization.stage={stage}, bf16={bf16}: ds_xc takes the "
                               "backbone's reduction over from DeepSpeed only for fp32 at ZeRO stage 0")
    if mode == "hierarchical" and not spans_world(group):
        mode = _refuse_or_flat(topology, "on a data-parallel group that is a proper subgroup of the world (the node "
                               "groups are created by every rank of the world)")
    hier = HierarchicalAllReduce(layout) if mode == "hierarchical" else None
    probe = None
    if hier is not None and topology.reduction == "auto" and topology.probe_repeats > 0:
        numel = max(int(topology.bucket_size_mb * 2**20) // 4, 1)  # float32 elements of one bucket
        mode, probe = reduction_probe.probe_reduction(hier, group, numel, topology.probe_repeats)
        hier = hier if mode == "hierarchical" else None
    log.info("topology: %s, %s reduction (%s.topology.reduction=%r)", layout.describe(), mode, HEAD_SECTION,
             topology.reduction)
    return DenseReduction(layout=layout, mode=mode, hier=hier, probe=probe)


def plan_head_collectives(head, plan: DenseReduction, topology, overlap_enabled: bool, rows: int) -> None:
    """Resolve ``topology.head_collectives`` and give ``head`` a NodeGather when the answer is hierarchical.

    Where the two stages can run (more than one node, the same number > 1 of ranks on each; the head's
    classes held over the data-parallel group's ranks, spanning the world; ``input_parallel='data'``; no overlap
    pipeline), ``auto`` times both exchanges of a micro-batch of ``rows`` rows of the head's width at initialize
    (the probe of the dense reduction, ``topology.probe_repeats``; 0: hierarchical) and keeps the faster; a
    forced ``hierarchical`` that cannot run is refused naming the key. Collective over the world."""
    mode = topology.head_collectives
    if mode == "flat":
        return
    layout, key = plan.layout, f"{HEAD_SECTION}.topology.head_collectives"
    members = sorted(r for node in layout.nodes for r in node)
    why = None
    if not (layout.regular and layout.num_nodes > 1 and layout.ranks_per_node > 1):
        why = f"on {layout.describe()} (needs more than one node, the same number (> 1) of ranks on each)"
    elif sorted(group_ranks(head.group)) != members or not spans_world(head.group):
        why = "with a head group other than the data-parallel group spanning the world (2-D layouts, tensor " \
              "parallelism)"
    elif head.input_parallel != "data":
        why = f"with input_parallel={head.input_parallel!r} (the head gathers no rows)"
    elif overlap_enabled:
        why = "with the overlap pipeline (its chunked gathers stay flat)"
    if why is not None and mode == "hierarchical":
        raise ConfigError(f"{key}='hierarchical' {why}; use 'auto' or 'flat'")
    if why is not None:
        log.info("topology: the head's row exchange is flat (%s=%r, %s)", key, mode, why)
        return
    gather = NodeGather(layout, head.group)
    if mode == "auto" and topology.probe_repeats > 0:
        d = head.embedding_dim

        def measure(m, buf):
            return node_gather.time_exchange(gather, head.group, m, buf.view(-1, d))
        mode, _ = reduction_probe.probe_reduction(None, head.group, max(int(rows), 1) * d, topology.probe_repeats,
                                                  measure=measure, label="head's row exchange")
        if mode == "flat":
            return
    head.node_gather = gather
    log.info("topology: the head's row exchange runs in two rank-aligned stages across %s", layout.describe())


def compression_nodes(plan: DenseReduction, compression_cfg, overlap_cfg):
    """The compressed reduction's NodeGroups from the detected layout, or None (flat, set by hand, or the
    overlapped compressed reducer, which has no hierarchy)."""
    if plan.hier is None or compression_cfg.hierarchy.ranks_per_node > 1:
        return None
    if compression_cfg.method == "powersgd":
        log.info("topology: method powersgd has no node hierarchy; compressing flat")
        return None
    if overlap_cfg.enabled and overlap_cfg.overlap_grad_reduce:
        log.info("topology: the overlapped compressed reduction has no node hierarchy; compressing flat")
        return None
    from ds_xc.compression.transport import NodeGroups
    h = plan.hier
    return NodeGroups(intra=h.intra, inter=h.inter, local_rank=h.local_rank, local_size=h.local_size,
                      num_nodes=h.num_nodes)


def embedding_tables(module: torch.nn.Module) -> list:
    """The weights of ``module``'s dense-gradient embedding tables (nn.Embedding / nn.EmbeddingBag, sparse=False,
    trainable): the gradients that are zero outside the rows a batch looked up."""
    return [m.weight for m in module.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            and not m.sparse and m.weight.requires_grad]


def check_sparse_rows(engine, topology, compression: bool) -> None:
    """Refuse ``topology.sparse_rows`` where ds_xc cannot own the backbone's reduction exactly."""
    if not topology.sparse_rows:
        return
    stage, bf16 = int(engine.zero_optimization_stage()), bool(engine.bfloat16_enabled())
    where = f"{HEAD_SECTION}.topology.sparse_rows=true"
    if compression:
        raise ConfigError(f"{where} with gradient_compression enabled: the compressed reduction already selects "
                          "from the nonzeros (allocation 'nonzero'); set sparse_rows=false or disable compression")
    if stage != 0 or bf16:
        raise ConfigError(f"{where} with zero_optimization.stage={stage}, bf16={bf16}: ds_xc takes the backbone's "
                          "reduction over from DeepSpeed only for fp32 at ZeRO stage 0; set sparse_rows=false")


def row_sparse_params(engine, topology) -> list:
    """The tables whose gradients go as rows (empty unless ``topology.sparse_rows``)."""
    if not topology.sparse_rows:
        return []
    tables = embedding_tables(engine.module)
    if not tables:
        log.warning("%s.topology.sparse_rows=true but the backbone has no nn.Embedding / nn.EmbeddingBag with a "
                    "dense gradient: every gradient is reduced dense", HEAD_SECTION)
    else:
        log.info("topology: %d embedding table(s) sent as their nonzero rows (%s)", len(tables),
                 ", ".join("x".join(map(str, t.shape)) for t in tables))
    return tables


def take_over_reduction(engine, plan: DenseReduction, topology, group, rows=()) -> Optional[BucketedGradReducer]:
    """Make ds_xc reduce the backbone (None when DeepSpeed's flat all-reduce serves): buckets from the hooks,
    hierarchical when the plan is, with the tables ``rows`` (:func:`row_sparse_params`) sent as rows."""
    if plan.hier is None and not rows:
        return None
    params = [p for p in engine.module.parameters() if p.requires_grad]
    comm = copy_subgroups(group) if rows else None  # the rows' all-gathers; any data-parallel subgroup
    reducer = BucketedGradReducer(params, group, int(topology.bucket_size_mb * 2**20), reduction=plan.hier,
                                  row_sparse=rows, comm_group=comm)
    engine.enable_backward_allreduce = False
    return reducer
