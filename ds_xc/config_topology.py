"""Section ``extreme_classification.topology``: how dense reductions follow the node layout.

A model of its own (the style of ds_xc/config_compression.py) so that ds_xc/config.py only
names it. ds_xc/parallel/topology.py reads it: the layout comes from the launcher, the mode
decides between one flat all-reduce and the hierarchical one (ds_xc/parallel/hierarchical.py).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ds_xc.config_base import Section

__all__ = ["REDUCTIONS", "TopologyConfig"]

REDUCTIONS = ("auto", "flat", "hierarchical")


class TopologyConfig(Section):
    """Node layout and the dense reduction built on it (docs/multinode.md)."""
    reduction: Literal["auto", "flat", "hierarchical"] = Field(
        "auto", description="Dense all-reduces of the backbone's gradients (and the compressed reduction's node "
        "groups): flat = one all-reduce over every rank; hierarchical = reduce-scatter inside each node, "
        "all-reduce of each shard among the ranks with the same local rank on every node, all-gather inside "
        "the node (EFLOPS' rank-aligned scheme); auto = on more than one node with the same number (> 1) of "
        "ranks on each, time both on a probe of bucket_size_mb at initialize and keep the faster (hierarchical "
        "only when at least 5% faster; see probe_repeats), else flat. Hierarchical makes ds_xc own the "
        "backbone's reduction (fp32, ZeRO stage 0), as overlap_grad_reduce does.")
    ranks_per_node: int = Field(
        0, ge=0, le=1 << 16, description="0 = the node layout from the launcher (ranks with the same hostname "
        "and node rank: GROUP_RANK, CROSS_RANK, SLURM_NODEID...); > 0 = an explicit override: consecutive "
        "blocks of this many ranks form a node (must divide the group size), e.g. to simulate nodes on one host.")
    bucket_size_mb: float = Field(
        16.0, gt=0.0, le=4096.0, description="Bucket size of the backbone's hierarchical reduction when ds_xc "
        "takes it over from DeepSpeed (buckets are launched from the gradient hooks during the backward); also "
        "the size of auto's probe.")
    sparse_rows: bool = Field(
        False, description="Send the gradient of each nn.Embedding / nn.EmbeddingBag weight of the backbone as "
        "its nonzero rows (indices and rows all-gathered, as DDP does for sparse embeddings and DeepSpeed's "
        "sparse_gradients) whenever that moves fewer bytes than the dense ring all-reduce; the choice is made "
        "each step from every rank's row count, alike on every rank; the mean is the same. ds_xc then owns the "
        "backbone's reduction (fp32, ZeRO stage 0), in buckets from the gradient hooks; not with "
        "gradient_compression (its selection already works on the nonzeros).")
    head_collectives: Literal["auto", "flat", "hierarchical"] = Field(
        "auto", description="The head's row exchange (the all-gather of embeddings and labels, the reduce-scatter "
        "of their gradient): flat = one all-gather over the head's group; hierarchical = two rank-aligned stages, "
        "an all-gather among the ranks with the same local rank on every node, then one inside the node (each "
        "row crosses the nodes once; ds_xc/parallel/node_gather.py); auto = where the two stages can run (more "
        "than one node with the same number > 1 of ranks on each), time both on a micro-batch of rows at "
        "initialize (probe_repeats; hierarchical only when at least 5% faster; 0 = no probe: hierarchical), else "
        "flat. Needs a head group that spans the world, input_parallel 'data' and no overlap pipeline (whose "
        "chunked gathers stay flat).")
    probe_repeats: int = Field(
        3, ge=0, le=100, description="auto only (reduction and head_collectives): timed repeats of each mode on "
        "the probe (after one warm-up each, alternating; the slowest rank's time, the median; the group's first "
        "rank decides and broadcasts). 0 = no probe: auto is hierarchical whenever the layout allows it.")
