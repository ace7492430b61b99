"""Building an XCEngine: the raw DeepSpeed config, checks of what ds_xc supports, the ranks'
agreement on the config, torch.distributed's start, and :func:`initialize`.

Why the head lives outside the engine: ``deepspeed.initialize`` broadcasts rank 0's
parameters to every rank and the engine averages every gradient over the data-parallel
group; ZeRO 1/2 even flattens and partitions parameters, mixing rank-distinct shards at
lr=0 (see docs/deepspeed_cpu.md). A class shard is different on every rank and
must only ever see its own gradient. So the engine gets the backbone alone, and the head
gets its own optimizer, stepped at the engine's gradient-accumulation boundaries.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from ds_xc import config as cfg
from ds_xc.config_schedule import check_no_scheduler_clash
from ds_xc.engine.core import XCEngine
from ds_xc.engine.lr_follow import check_follow_engine, reference_lr
from ds_xc.engine.reduction import (check_sparse_rows, compression_nodes, plan_head_collectives, plan_reduction,
                                   row_sparse_params, take_over_reduction)
from ds_xc.head import ClassParallelHead, build_head_optimizer
from ds_xc.optim.deepspeed import attach_partition_layouts, build_backbone_optimizer, check_backbone_optimizer
from ds_xc.parallel.agree import agree, all_or_none
from ds_xc.parallel.device import bind_device
from ds_xc.parallel.groups import (comm_timeout, copy_subgroups, group_size, group_timeout, resolve_group,
                                  set_comm_timeout, world_rank_and_size)
from ds_xc.peers import gather_peers

log = logging.getLogger(__name__)

__all__ = ["initialize", "init_distributed", "check_supported", "load_raw_config", "cpu_friendly_deepspeed",
           "engine_group", "check_launch_env", "LaunchEnvError", "LAUNCH_ENV"]


def load_raw_config(config=None, args=None) -> dict:
    """The whole DeepSpeed config as a dict, from ``config`` or ``args.deepspeed_config``."""
    source = config if config is not None else getattr(args, "deepspeed_config", None)
    if source is None:
        raise cfg.ConfigError("no DeepSpeed config: pass config= (dict or path) or args.deepspeed_config")
    return cfg.load_raw(source)


def _raw_section(raw: dict, name: str) -> dict:
    """``raw[name]`` as a dict ({} when absent or null); anything else is refused naming the section."""
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise cfg.ConfigError(f"{name}: expected a JSON object (dict), got {type(value).__name__} {value!r}")
    return value


def check_supported(raw: dict) -> None:
    """Refuse, at start, combinations the head cannot train correctly (and a misspelt ds_xc section)."""
    cfg.check_section_names(raw)  # "did you mean extreme_classification?" before "no such section"
    for name in ("fp16", "bf16", "zero_optimization", cfg.COMPRESSION_SECTION, cfg.HEAD_SECTION):
        _raw_section(raw, name)  # DeepSpeed's own sections too: not an object is refused here, by name
    if _raw_section(raw, "fp16").get("enabled", False):
        raise cfg.ConfigError("fp16.enabled=true: fp16 loss scaling would scale the head's gradients; "
                              "use bf16.enabled=true (or fp32) with ds_xc")
    stage = _raw_section(raw, "zero_optimization").get("stage", 0)
    if type(stage) is not int or stage not in (0, 1, 2):
        raise cfg.ConfigError(f"zero_optimization.stage={stage!r}: ds_xc supports ZeRO stages 0, 1 and 2 "
                              "for the backbone")
    method = _raw_section(raw, cfg.COMPRESSION_SECTION).get("method", "bayes_prior")
    if cfg.COMPRESSION_SECTION in raw and method != "none":  # refused before an engine is built
        from ds_xc.compression.deepspeed import check_zero_stage
        zero = _raw_section(raw, "zero_optimization")
        offload = zero.get("offload_optimizer") or {}
        check_zero_stage(stage, method, overlap_comm=zero.get("overlap_comm"),
                         bf16=bool(_raw_section(raw, "bf16").get("enabled", False)),
                         offload=isinstance(offload, dict) and offload.get("device", "none") not in (None, "none"))
    overlap = _raw_section(raw, cfg.HEAD_SECTION).get("overlap")
    if overlap:
        from ds_xc.overlap.run import check_overlap
        check_overlap(cfg.validate_section(cfg.OverlapConfig, overlap, f"{cfg.HEAD_SECTION}.overlap"), int(stage),
                      bool(_raw_section(raw, "bf16").get("enabled", False)))
    check_backbone_optimizer(raw)  # "optimizer": {"type": "Lamb" | "LARS"}: ds_xc builds it (docs/optimizers.md)
    check_no_scheduler_clash(raw)  # adaptive_lr and DeepSpeed's scheduler section: one of them
    if cfg.HEAD_SECTION not in raw:
        raise cfg.ConfigError(f"the DeepSpeed config has no '{cfg.HEAD_SECTION}' section; add one with at "
                              "least num_classes and embedding_dim")
    loss = _raw_section(raw, cfg.HEAD_SECTION).get("loss")
    if isinstance(loss, dict) and loss.get("reduction") == "none":  # per-row losses: no scalar to step on
        raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.loss.reduction: 'none' returns each row's loss; the XCEngine's "
                              "step needs the batch's loss: use 'mean' or 'sum' (or the head on its own)")


def cpu_friendly_deepspeed():
    """Skip the shared-memory inference op that DeepSpeed JIT-builds on CPU (about a minute)."""
    import deepspeed
    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what an env:// start reads
MPI_RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")  # an MPI launcher's: DeepSpeed asks MPI instead


class LaunchEnvError(cfg.ConfigError, RuntimeError):
    """The launcher variables of a multi-process start are incomplete; the message names the missing ones
    (a ConfigError: bad input found at start, like the config's)."""


def check_launch_env(env=None) -> None:
    """With ``RANK`` set (a launcher's start) every variable of :data:`LAUNCH_ENV` must be set too.

    DeepSpeed's ``init_distributed`` takes a start with any of them missing for an MPI job and asks
    mpi4py for them ("No module named 'mpi4py'" when it is not installed, a wrong world when it is);
    this names the missing variables and what to set, first. Under an MPI launcher (its rank variable
    set, :data:`MPI_RANK_ENV`) DeepSpeed's own discovery runs."""
    env = os.environ if env is None else env
    if "RANK" not in env or any(name in env for name in MPI_RANK_ENV):
        return
    missing = [name for name in LAUNCH_ENV if name not in env]
    if missing:
        raise LaunchEnvError(
            f"RANK={env['RANK']} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
            f"a multi-process start reads {', '.join(LAUNCH_ENV)} (the deepspeed and torchrun launchers set them "
            "all). Set the missing ones (MASTER_ADDR: the host of rank 0, e.g. 127.0.0.1 on one machine; "
            "MASTER_PORT: a free port, e.g. 29500; WORLD_SIZE: the number of processes; LOCAL_RANK: the rank "
            "on this machine), start with a launcher, or unset RANK to run one process")


def init_distributed(timeout_s: float = 1800.0) -> torch.device:
    """Bind this rank's device, then start torch.distributed the way DeepSpeed does (gloo on CPU, NCCL
    on GPU); returns the rank's device.

    The GPU is bound first (``ds_xc.parallel.device.bind_device``: cuda:LOCAL_RANK, logged), so that
    no collective of any rank of a host lands on cuda:0 (the data barrier of launch/train.py, the
    agreement of ``initialize`` and everything of launch/grow.py and tune.py run before DeepSpeed's
    engine would bind it). When torch.distributed is running already it only binds. Without
    launcher variables (a plain ``python train.py``) it starts a one-process group; with ``RANK`` but
    not every other launcher variable it raises :class:`LaunchEnvError` naming the missing ones
    (:func:`check_launch_env`). ``timeout_s`` is the process groups' timeout: the world's and, through
    ``ds_xc.parallel.groups.set_comm_timeout``, every group ds_xc creates.
    """
    import datetime
    import socket
    if not dist.is_initialized():  # a group started by the caller (tcp://, a file) needs no launcher variables
        check_launch_env()
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = bind_device()  # before the first collective of anything
    deepspeed = cpu_friendly_deepspeed()
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=timeout_s))
    set_comm_timeout(timeout_s)  # for the groups ds_xc creates (torch would give them 30 minutes)
    return device



def _agreed_config(raw: dict, head_group) -> cfg.XCConfig:
    """Validate the config on every rank, check that every rank has the same one, and that each
    rank of ``head_group`` gets at least one class; all before ``deepspeed.initialize`` runs.

    A config that is invalid on one rank only, or differs between ranks, is an error on every
    rank (naming the keys and the ranks' values) instead of a hang in DeepSpeed's first collective."""
    world = dist.group.WORLD  # deepspeed.initialize is collective over the world: every rank checks first
    with all_or_none("checking the DeepSpeed config", world):
        check_supported(raw)
        xc_config = cfg.parse_config(raw)
    agree(raw, "the DeepSpeed config (config= / args.deepspeed_config)", world)
    ranks, num_classes = group_size(head_group), xc_config.extreme_classification.num_classes
    if num_classes < ranks:
        raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.num_classes={num_classes} is below the number of ranks the "
                              f"classes are sharded over ({ranks}): every rank holds at least one class; use "
                              f"num_classes >= {ranks}, or at most {num_classes} ranks")
    return xc_config


def _start_distributed(raw: dict) -> bool:
    """Start torch.distributed for ``initialize`` unless it runs (True when started here): after refusing a bad
    config, with ``xc_train.comm_timeout_s`` (default 1800 s) for the world and every group ds_xc creates. A
    plain ``python script.py`` becomes a one-process group; under a launcher, the job's."""
    if dist.is_initialized():
        return False
    check_supported(raw)
    init_distributed(timeout_s=cfg.parse_config(raw).xc_train.comm_timeout_s)
    return True


def _timeout_for_callers_group(train: cfg.TrainConfig) -> None:
    """The timeout of the groups ds_xc creates when the caller started torch.distributed: the config's
    ``xc_train.comm_timeout_s`` where it sets one, else the caller's world group's timeout (torch would
    give a new group 30 minutes), else (a backend that does not tell it) whatever was set before.

    The caller's own groups keep their timeout: a warning says so when the config asks for another."""
    world = group_timeout(None)
    rank0 = world_rank_and_size()[0] == 0  # for the messages only
    if "comm_timeout_s" in train.model_fields_set:
        seconds = train.comm_timeout_s
        if world is not None and abs(world - seconds) > 1e-3 and rank0:
            log.warning("xc_train.comm_timeout_s=%g s applies to the process groups ds_xc creates; the world group "
                        "you started keeps its %g s (pass timeout= to torch.distributed.init_process_group, or let "
                        "ds_xc.initialize start it)", seconds, world)
    elif world is not None:
        seconds = world
    else:
        if rank0:
            log.info("the timeout of your process group is not known: ds_xc's own groups get %s (set "
                     "xc_train.comm_timeout_s to choose)", "torch's default (30 minutes for gloo)" if
                     comm_timeout() is None else f"{comm_timeout():g} s")
        return
    set_comm_timeout(seconds)


def initialize(args=None, model: torch.nn.Module = None, config=None, model_parameters=None,
               optimizer=None, lr_scheduler=None, head_group=None, **ds_kwargs) -> XCEngine:
    """Build the DeepSpeed engine for ``model`` (the backbone), the head and its optimizer.

    ``config`` is the whole DeepSpeed config (dict or path; or pass ``args.deepspeed_config``);
    its ``extreme_classification`` section describes the head. ``head_group`` is the group
    the classes are sharded over (a ProcessGroup or 1-D DeviceMesh; default: the world). The
    head built here is 1-D: the 2-D layout (``ClassParallelHead(replica_group=...)``) is for
    plain torch.distributed / DDP for now (docs/head.md, "2-D layout").
    Binds the rank's device first (``ds_xc.parallel.device.bind_device``: cuda:LOCAL_RANK, as
    DeepSpeed's engine would later), before any collective.
    Collective over the world (as ``deepspeed.initialize``): the groups ds_xc adds (the
    non-finite verdict's, the overlap schedule's) are created by every rank
    (``ds_xc.parallel.groups.copy_subgroups``). The backbone's reduction (compression,
    buckets), the verdict, the checkpoint agreement and the peers use the engine's own
    data-parallel group (:func:`engine_group`), passed explicitly.
    Timeouts: ``xc_train.comm_timeout_s`` where initialize starts torch.distributed
    (:func:`_start_distributed`); with the caller's group, see :func:`_timeout_for_callers_group`.
    """
    raw = load_raw_config(config, args)
    check_no_scheduler_clash(raw, lr_scheduler)
    deepspeed = cpu_friendly_deepspeed()
    started_here = _start_distributed(raw)
    bind_device()  # cuda:LOCAL_RANK before the agreement's collectives (DeepSpeed binds only in its engine)
    head_group = resolve_group(head_group)  # None: the world, named explicitly
    xc_config = _agreed_config(raw, head_group)
    if not started_here:
        _timeout_for_callers_group(xc_config.xc_train)  # before ds_xc creates its groups (copy_subgroups below)
    model_parameters = list([p for p in model.parameters() if p.requires_grad] if model_parameters is None
                            else model_parameters)
    optimizer, ds_raw = build_backbone_optimizer(raw, model_parameters, optimizer)  # Lamb / LARS: ours or FusedLamb
    adaptive = xc_config.adaptive_lr
    if adaptive is not None and adaptive.enabled:  # DeepSpeed builds it around its optimizer, then steps it
        from ds_xc.engine.adaptive_lr import adaptive_lr_factory
        lr_scheduler = adaptive_lr_factory(adaptive)
    use_args_config = args is not None and getattr(args, "deepspeed_config", None) is not None
    if use_args_config and ds_raw is not raw:  # DeepSpeed must get the config without the optimizer section
        args, use_args_config = copy.copy(args), False
        args.deepspeed_config = None
    engine, _, _, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model_parameters, optimizer=optimizer,
        lr_scheduler=lr_scheduler, config=None if use_args_config else ds_raw, **ds_kwargs)
    attach_partition_layouts(engine, optimizer)  # ZeRO 1/2: the layers' places in the flat partitions
    base_lr = _follow_engine_reference(engine, scheduler, xc_config, engine_group(engine))
    head = ClassParallelHead.from_config(xc_config.extreme_classification, group=head_group,
                                         device=engine.device)
    head_optimizer = build_head_optimizer(head, xc_config.extreme_classification.optimizer)
    dp_group = engine_group(engine)
    compression = None
    head_cfg, comp_cfg = xc_config.extreme_classification, xc_config.gradient_compression
    comp_on = comp_cfg is not None and comp_cfg.enabled
    check_sparse_rows(engine, head_cfg.topology, comp_on)
    rows = row_sparse_params(engine, head_cfg.topology)  # embedding tables sent as rows (topology.sparse_rows)
    plan = plan_reduction(engine, head_cfg.topology, dp_group, comp_on)  # the node layout, flat or hierarchical
    plan_head_collectives(head, plan, head_cfg.topology, head_cfg.overlap.enabled,  # the head's row exchange
                          rows=engine.train_micro_batch_size_per_gpu())
    if comp_on:
        from ds_xc.compression import attach_to_engine  # takes over the backbone's reduction
        compression = attach_to_engine(engine, comp_cfg, group=dp_group,
                                       node_groups=compression_nodes(plan, comp_cfg, head_cfg.overlap))
    schedule = reducer = None
    if head_cfg.overlap.enabled:
        from ds_xc.overlap.run import build_overlap
        schedule, reducer = build_overlap(engine, head, head_cfg.overlap, compression,
                                          head_comm_group=copy_subgroups(head_group), reduction=plan.hier,
                                          row_sparse=rows)
    if reducer is None and compression is None:
        reducer = take_over_reduction(engine, plan, head_cfg.topology, dp_group, rows)
    flag_group = copy_subgroups(dp_group, backend="gloo")  # its own group: the verdict never queues behind buckets
    if hasattr(scheduler, "bind"):  # AdaptiveLR: rank 0 of the data-parallel group decides (its gloo copy)
        scheduler.bind(flag_group if flag_group is not None else dp_group, engine.train_batch_size())
    log.info("ds_xc: engine ready (ZeRO stage %d, bf16=%s), head shard %s", engine.zero_optimization_stage(),
             engine.bfloat16_enabled(), head.extra_repr())
    xc = XCEngine(engine=engine, head=head, head_optimizer=head_optimizer, config=xc_config,
                  lr_scheduler=scheduler, base_lr=base_lr, compression=compression, schedule=schedule,
                  grad_reducer=reducer, flag_group=flag_group, peers=gather_peers(dp_group),
                  head_graph=_head_graph(head, head_optimizer, engine, head_cfg) if head_cfg.cuda_graphs else None)
    _mark_phase(xc, engine, "allreduce_gradients", "gradient reduction")  # DeepSpeed's, inside engine.backward
    _mark_phase(xc, head.sampler, "rebuild", "index rebuild")  # ANN index / kNN graph, inside the forward
    return xc


def _follow_engine_reference(engine, scheduler, xc_config, group) -> Optional[float]:
    """``lr_schedule: follow_engine``: the engine's lr at initialize (the reference when there is no
    scheduler), after checking on every rank of ``group`` (the engine's data-parallel group) that the
    scheduler gives a reference lr (ds_xc/engine/lr_follow.py; a ConfigError on every rank otherwise)."""
    lr = float(engine.get_lr()[0]) if engine.get_lr() else None
    if lr is None and scheduler is None:  # no backbone optimizer: no engine lr to follow
        if xc_config.extreme_classification.optimizer.lr_schedule == "follow_engine":
            log.info("ds_xc: the engine has no optimizer (no lr): the head's lr stays at its configured %s",
                     xc_config.extreme_classification.optimizer.lr)
        return None
    if xc_config.extreme_classification.optimizer.lr_schedule == "follow_engine":
        with all_or_none("checking the lr scheduler the head follows", group):
            ref = check_follow_engine(scheduler, lr)
        log.info("ds_xc: the head's lr follows the engine's: %s x engine lr / %.6g (%s)",
                 xc_config.extreme_classification.optimizer.lr, ref, reference_lr(scheduler, lr)[1])
    return lr


def _head_graph(head, head_optimizer, engine, head_cfg):
    """``extreme_classification.cuda_graphs``: the head's step as a CUDA graph (ds_xc/head/graphs.py), or
    the reason it cannot be, naming the key (the head's own limits are checked by HeadStepGraph)."""
    from ds_xc.head.graphs import KEY, HeadStepGraph
    gas = engine.gradient_accumulation_steps()
    if gas != 1:
        raise cfg.ConfigError(f"{KEY}: gradient_accumulation_steps is {gas}; a captured head step includes its "
                              "optimizer step, so it needs 1")
    if head_cfg.nonfinite != "raise":
        raise cfg.ConfigError(f"{KEY}: nonfinite is {head_cfg.nonfinite!r}; a captured step has updated the head "
                              "before its loss is read, so it cannot be skipped: set nonfinite 'raise'")
    if head_cfg.overlap.enabled:
        raise cfg.ConfigError(f"{KEY}: overlap.enabled; the overlap pipeline runs the head in chunks, not as one "
                              "captured step: disable one of them")
    return HeadStepGraph(head, head_optimizer, rows=engine.train_micro_batch_size_per_gpu())


def engine_group(engine):
    """The DeepSpeed engine's data-parallel group, as a ProcessGroup: the one it averages the backbone's
    gradients over (``engine.seq_data_parallel_group``, else ``engine.data_parallel_group``: the world
    unless an ``mpu`` or sequence parallelism was given)."""
    group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    if group is None:  # an engine without one (older DeepSpeed, a test double): DeepSpeed's default, the world
        group = dist.group.WORLD
    return resolve_group(group)


def _mark_phase(xc: XCEngine, obj, method: str, phase: str) -> None:
    """Wrap ``obj.method`` (this instance only) in ``xc.in_phase(phase)``; a no-op when it has no such method."""
    inner = getattr(obj, method, None)
    if inner is None:
        return

    def marked(*args, **kwargs):
        with xc.in_phase(phase):
            return inner(*args, **kwargs)
    setattr(obj, method, marked)
