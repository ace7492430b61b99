"""Rank and size of an explicit process group, with a single-process fallback; creating groups.

Every ds_xc component takes ``group`` as an argument: a ``ProcessGroup`` or a 1-D torch
``DeviceMesh`` (:func:`resolve_group`). ``None`` means the default (world) group when
torch.distributed is initialised, and a single process otherwise, so the same code runs
in a notebook and under the DeepSpeed launcher; components resolve it once, when built,
and pass the group they hold to every collective.

Creating a group is collective over the whole world in torch (``dist.new_group``: every
rank enters it, in the same order, member or not). :func:`new_groups` creates a set of
groups with every rank passing the full set; :func:`copy_group` copies a group that spans
the world, and refuses a proper subgroup (only its members would call it): build the
copies of every subgroup with :func:`new_groups` on every rank and pass them in.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ds_xc.parallel.device import check_bound

ProcessGroup = Optional["dist.ProcessGroup"]


def is_distributed(group: ProcessGroup = None) -> bool:
    """True when collectives on ``group`` involve more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(resolve_group(group)) > 1


def comm_device(group: ProcessGroup = None) -> torch.device:
    """Where a tensor handed to a collective on ``group`` must live: this rank's GPU when the group's
    backend is NCCL alone (NCCL moves CUDA tensors only: a CPU tensor fails with "No backend type
    associated with device type cpu"), else the CPU (gloo, a mixed "cpu:gloo,cuda:nccl" group, one
    process). Small bookkeeping tensors (flags, counts, verdicts) are made here before a collective.

    For NCCL: the group's bound device when it has one (``init_process_group(device_id=...)``), else the
    current device after checking that it is this rank's (ds_xc.parallel.device.check_bound: a
    DeviceBindingError names the device and how to bind it, where NCCL would open the rank's
    communicator on another rank's GPU)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    pg = resolve_group(group)
    if is_nccl(pg):
        bound = getattr(pg, "bound_device_id", None)
        if bound is not None:
            return torch.device(bound)
        check_bound("a collective on an NCCL group")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_nccl(group: ProcessGroup = None) -> bool:
    """True when ``group``'s collectives run on NCCL alone (CUDA tensors only)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    backend = str(dist.get_backend(resolve_group(group))).lower()
    return "nccl" in backend and "cpu" not in backend and "gloo" not in backend


def group_size(group: ProcessGroup = None) -> int:
    """Number of ranks in ``group`` (1 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(resolve_group(group))


def group_rank(group: ProcessGroup = None) -> int:
    """This process's rank inside ``group`` (0 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(resolve_group(group))


_COMM_TIMEOUT_S: list = [None]  # set by ds_xc.init_distributed (or set_comm_timeout); None: torch's default


def set_comm_timeout(seconds: Optional[float]) -> None:
    """The timeout of the process groups ds_xc creates (:func:`new_group`): the world's, normally.

    torch gives a new group its own default (30 minutes for gloo), not the timeout the world
    group was started with, so a stopped peer would hold a collective on it that long.
    ``ds_xc.engine.init_distributed`` calls this, and ``ds_xc.initialize`` with a group you started
    (``xc_train.comm_timeout_s`` when the config sets it, else your world group's timeout); call it
    yourself if you start torch.distributed and build ds_xc's components without ``initialize``."""
    _COMM_TIMEOUT_S[0] = None if seconds is None else float(seconds)


def comm_timeout() -> Optional[float]:
    """The timeout (seconds) the groups ds_xc creates get (:func:`set_comm_timeout`); None: torch's default."""
    return _COMM_TIMEOUT_S[0]


def group_timeout(group: ProcessGroup = None) -> Optional[float]:
    """The timeout (seconds) ``group`` (None: the world) was created with, or None where torch does not
    tell it (no torch.distributed; a backend without options). torch has no public getter: this reads
    the options of the group's backend for the CPU, else CUDA (``_get_backend(device).options``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = resolve_group(group)
    for device in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        seconds = getattr(timeout, "total_seconds", None)
        if seconds is not None:
            return float(seconds())
    return None


def new_group(ranks=None, backend=None):
    """``dist.new_group`` with the timeout of :func:`set_comm_timeout` (collective: every rank calls it)."""
    import datetime
    timeout = None if _COMM_TIMEOUT_S[0] is None else datetime.timedelta(seconds=_COMM_TIMEOUT_S[0])
    return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)


def resolve_group(group=None):
    """The ``ProcessGroup`` that ``group`` names: a ProcessGroup as it is, a 1-D ``DeviceMesh`` its
    group, None the world group when torch.distributed is initialised (None otherwise: one process)."""
    if group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if hasattr(group, "get_group") and hasattr(group, "mesh"):  # torch.distributed.device_mesh.DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"group: a DeviceMesh of {group.ndim} dimensions {tuple(group.mesh.shape)} "
                             "names several groups; pass one dimension, e.g. mesh['tp']")
        return group.get_group()
    return group


def group_ranks(group=None) -> list[int]:
    """The world ranks of ``group``'s members in group-rank order ([0] without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    return list(dist.get_process_group_ranks(resolve_group(group)))


def spans_world(group=None) -> bool:
    """True when ``group`` holds every rank of the world (so its members are all the ranks)."""
    return not (dist.is_available() and dist.is_initialized()) or \
        group_size(resolve_group(group)) == dist.get_world_size(dist.group.WORLD)


def new_groups(rank_lists, backend=None) -> ProcessGroup:
    """Create one process group per list of world ranks and return the one holding this rank
    (None when it is in none, e.g. an idle rank).

    Collective over the world: every rank calls it with the same ``rank_lists`` (the full set,
    disjoint lists), because torch requires every rank to enter each ``dist.new_group``, in the
    same order. E.g. on 4 ranks ``new_groups([[0, 1], [2, 3]])`` gives ranks 0 and 1 one group
    and ranks 2 and 3 another."""
    lists = [sorted(int(r) for r in ranks) for ranks in rank_lists]
    flat = [r for ranks in lists for r in ranks]
    if len(flat) != len(set(flat)) or any(not ranks for ranks in lists):
        raise ValueError(f"new_groups: rank_lists={rank_lists!r} must be non-empty, disjoint lists of world ranks")
    if not (dist.is_available() and dist.is_initialized()):
        if lists != [[0]]:
            raise ValueError(f"new_groups: rank_lists={rank_lists!r} without torch.distributed: only [[0]] exists")
        return None
    world, me = dist.get_world_size(dist.group.WORLD), dist.get_rank(dist.group.WORLD)
    if flat and (min(flat) < 0 or max(flat) >= world):
        raise ValueError(f"new_groups: rank_lists={rank_lists!r} name ranks outside the world [0, {world})")
    mine = None
    for ranks in lists:  # every rank creates every group, in the same order
        g = new_group(ranks=ranks, backend=backend)
        if me in ranks:
            mine = g
    return mine


def copy_subgroups(group, backend=None) -> ProcessGroup:
    """A copy of this rank's ``group`` (a new group with the same ranks), where the ranks may hold
    different subgroups of the world (or none: pass ``group=None`` on a rank in no group).

    Collective over the world: every rank calls it. The ranks' groups are gathered (one
    object all-gather over the world: creating groups involves every rank of the world in
    torch anyway), and every distinct group is created on every rank in the same order
    (:func:`new_groups`). Returns None on a rank in no group or in a one-rank group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mine = None if group is None else tuple(group_ranks(group))
    world = dist.group.WORLD  # group creation is collective over the world in torch
    every: list = [None] * dist.get_world_size(world)
    dist.all_gather_object(every, mine, group=world)
    distinct = sorted({ranks for ranks in every if ranks is not None and len(ranks) > 1})
    copy = new_groups([list(ranks) for ranks in distinct], backend=backend) if distinct else None
    return copy if mine is not None and len(mine) > 1 else None


def world_rank_and_size() -> tuple[int, int]:
    """(rank, size) of this process in the world; (0, 1) without torch.distributed.

    For messages only (which process this is): a collective, a per-rank file and a rank-0
    decision take the rank in their explicit group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    world = dist.group.WORLD  # the world on purpose: names and messages, never a collective
    return dist.get_rank(world), dist.get_world_size(world)


def copy_group(group: ProcessGroup = None, backend=None):
    """A new process group with the same ranks as ``group`` (None: the world), on the same
    backend (or ``backend``) and with the timeout of :func:`set_comm_timeout`; None when
    ``group`` has one rank.

    Traffic on the copy never queues behind collectives on ``group``. Collective over the
    world, so ``group`` must span the world (every rank is a member and calls it); a proper
    subgroup is refused: create its copy together with its siblings' on every rank
    (:func:`copy_subgroups` or :func:`new_groups`) and pass it to the component (``comm_group=``)."""
    group = resolve_group(group)
    if not is_distributed(group):
        return None
    if not spans_world(group):
        raise ValueError(f"copy_group: the group of world ranks {group_ranks(group)} is a proper subgroup of the "
                         f"world ({dist.get_world_size(dist.group.WORLD)} ranks); torch creates groups with every "
                         "rank of the world, so only its members cannot copy it: build the copies of all subgroups "
                         "on every rank with ds_xc.parallel.groups.copy_subgroups(group) (or new_groups([...])) "
                         "and pass yours as comm_group=")
    return new_group(ranks=group_ranks(group), backend=backend or dist.get_backend(group))


def block_groups(nodes, backend=None) -> tuple:
    """(this rank's node group, its rank-aligned group) of a node layout, every group created, one-rank
    groups included: ``nodes`` are the world ranks of every node, equal counts; the rank-aligned group
    holds the ranks with this rank's local index on every node. Collective over the world (every rank
    calls it with the same ``nodes``, nodes first, then the rank-aligned sets)."""
    nodes = [sorted(int(r) for r in node) for node in nodes]
    size = len(nodes[0])
    return new_groups(nodes, backend), new_groups([[node[i] for node in nodes] for i in range(size)], backend)


def node_groups(nodes, backend=None) -> tuple:
    """(intra, intra_gather, inter) groups of a node layout for this rank (None where a group would have one rank).

    ``nodes``: the world ranks of every node, equal counts (ds_xc.parallel.topology.NodeLayout.nodes).
    ``intra`` and ``intra_gather`` both hold this rank's node (two groups so that a reduce-scatter and an
    all-gather of different buckets never compete for one group's order); ``inter`` holds the ranks with
    this rank's local index on every node (rank-aligned, :func:`block_groups`). Collective over the world:
    every rank calls it with the same ``nodes``, which must cover the whole world."""
    nodes = [sorted(int(r) for r in node) for node in nodes]
    sizes = {len(node) for node in nodes}
    if len(sizes) != 1:
        raise ValueError(f"node_groups: nodes={nodes} must all have the same number of ranks")
    world = dist.get_world_size(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else 1
    if sorted(r for node in nodes for r in node) != list(range(world)):
        raise ValueError(f"node_groups: nodes={nodes} must hold every rank of the world (0..{world - 1}) once: "
                         "torch creates groups with every rank of the world")
    size = sizes.pop()
    intra, inter = block_groups(nodes, backend)
    intra_gather = new_groups(nodes, backend) if size > 1 else None
    return (intra if size > 1 else None), intra_gather, (inter if len(nodes) > 1 else None)
