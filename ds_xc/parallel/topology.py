"""The node layout of a process group, from the launcher, and the choice of the dense reduction.

A rank's node is named by its hostname and the node rank its launcher exported (torchrun's
``GROUP_RANK``, the DeepSpeed launcher's ``CROSS_RANK``, Slurm's ``SLURM_NODEID``): several
"hosts" that share one hostname (containers, network namespaces) are still told apart. The
names are gathered once over the group (one object all-gather); ranks with the same name form a
node, in group-rank order. The launcher's local size (``LOCAL_WORLD_SIZE``, ``LOCAL_SIZE``,
``OMPI_COMM_WORLD_LOCAL_SIZE``) is cross-checked. ``ranks_per_node`` > 0 overrides the
detection with consecutive blocks (simulated nodes on one host).

:func:`choose_reduction` turns ``extreme_classification.topology.reduction`` (auto | flat |
hierarchical) and a layout into the mode the layout allows: auto is hierarchical when there is
more than one node and every node holds the same number (> 1) of ranks, and there
ds_xc/engine/reduction.py then times both on a probe (ds_xc/parallel/reduction_probe.py) and
keeps the faster.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from ds_xc.parallel.groups import group_rank, group_ranks, group_size, is_distributed, resolve_group

log = logging.getLogger(__name__)

__all__ = ["NodeLayout", "node_name", "detect_layout", "layout_from_blocks", "choose_reduction"]

NODE_RANK_VARS = ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID", "NODE_RANK")  # torchrun, deepspeed, Slurm, Lightning
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


@dataclass(frozen=True)
class NodeLayout:
    """The world ranks of every node (each sorted; nodes ordered by their lowest rank) and where it came from."""
    nodes: tuple
    source: str

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def regular(self) -> bool:
        """Every node holds the same number of ranks (what the rank-aligned scheme needs)."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node (0 when the nodes differ in size)."""
        return len(self.nodes[0]) if self.regular else 0

    def locate(self, world_rank: int) -> tuple[int, int]:
        """(node index, local index) of a world rank."""
        for i, node in enumerate(self.nodes):
            if world_rank in node:
                return i, node.index(world_rank)
        raise ValueError(f"NodeLayout: world rank {world_rank} is in no node of {self.nodes}")

    def describe(self) -> str:
        sizes = sorted({len(n) for n in self.nodes})
        per = str(sizes[0]) if len(sizes) == 1 else "/".join(map(str, sizes))
        return f"{self.num_nodes} node(s) x {per} rank(s) ({self.source})"


def node_name() -> str:
    """This process's node: hostname plus the launcher's node rank when it exported one."""
    host = socket.gethostname()
    for var in NODE_RANK_VARS:
        if os.environ.get(var, "") != "":
            return f"{host}/{var}={os.environ[var]}"
    return host


def layout_from_blocks(ranks_per_node: int, group=None) -> NodeLayout:
    """Consecutive blocks of ``ranks_per_node`` ranks of ``group`` form the nodes (the explicit override)."""
    members, world = group_ranks(group), group_size(group)
    if ranks_per_node < 1 or world % ranks_per_node:
        from ds_xc.config_base import ConfigError
        raise ConfigError(f"extreme_classification.topology.ranks_per_node={ranks_per_node} must divide the "
                          f"data-parallel group size {world}; use 0 (the layout from the launcher) or a divisor")
    nodes = tuple(tuple(sorted(members[i: i + ranks_per_node])) for i in range(0, world, ranks_per_node))
    return NodeLayout(nodes=tuple(sorted(nodes)), source=f"ranks_per_node={ranks_per_node}")


def detect_layout(group=None, ranks_per_node: int = 0) -> NodeLayout:
    """The node layout of ``group`` (collective over it: one object all-gather, unless overridden)."""
    group = resolve_group(group)
    if ranks_per_node > 0:
        return layout_from_blocks(ranks_per_node, group)
    me = node_name()
    names = [me]
    if is_distributed(group):
        names = [None] * group_size(group)
        dist.all_gather_object(names, me, group=group)
    by_name: dict = {}
    for name, rank in zip(names, group_ranks(group)):
        by_name.setdefault(name, []).append(rank)
    nodes = tuple(sorted(tuple(sorted(r)) for r in by_name.values()))
    layout = NodeLayout(nodes=nodes, source="launcher (hostname, node rank)")
    mine = len(by_name[me])
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) != mine:
            log.warning("node layout: %s=%s but %d rank(s) of the group share this node's name %r (rank %d); "
                        "using the names", var, value, mine, me, group_rank(group))
            break
    return layout


def choose_reduction(mode: str, layout: NodeLayout) -> str:
    """'flat' or 'hierarchical' for ``extreme_classification.topology.reduction`` = ``mode`` on ``layout``."""
    if mode not in ("auto", "flat", "hierarchical"):
        from ds_xc.config_base import ConfigError
        raise ConfigError(f"extreme_classification.topology.reduction={mode!r}; allowed: auto, flat, hierarchical")
    if mode == "hierarchical" and not layout.regular:
        from ds_xc.config_base import ConfigError
        raise ConfigError(f"extreme_classification.topology.reduction='hierarchical' on {layout.describe()}: the "
                          "rank-aligned scheme needs the same number of ranks on every node; use auto or flat, or "
                          "set topology.ranks_per_node")
    if mode == "auto":
        return "hierarchical" if layout.regular and layout.num_nodes > 1 and layout.ranks_per_node > 1 else "flat"
    return mode
