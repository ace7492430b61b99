"""DeepSpeed glue: a backbone engine plus a class-parallel head that the engine never touches.

Why the head lives outside the engine: ``deepspeed.initialize`` broadcasts rank 0's
parameters to every rank and the engine averages every gradient over the data-parallel
group; ZeRO 1/2 even flattens and partitions parameters, mixing rank-distinct shards at
lr=0 (see shared/docs/DEEPSPEED_CPU.md). A class shard is different on every rank and
must only ever see its own gradient. So the engine gets the backbone alone, and the head
gets its own optimizer, stepped at the engine's gradient-accumulation boundaries.

Gradients still flow through one graph: ``engine.backward(loss)`` runs backward through
the head and the backbone together. The engine divides the loss by the accumulation
steps before backward, so the head's gradient is scaled like the backbone's. Loss
scaling (fp16) would scale the head's gradient too, and is refused at start.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ds_xc import config as cfg
from ds_xc.checkpoint import check_head_checkpoint, load_head_state, save_head_state
from ds_xc.head import ClassParallelHead, build_head_optimizer

log = logging.getLogger(__name__)

__all__ = ["initialize", "init_distributed", "XCEngine", "check_supported", "load_raw_config"]


def load_raw_config(config=None, args=None) -> dict:
    """The whole DeepSpeed config as a dict, from ``config`` or ``args.deepspeed_config``."""
    source = config if config is not None else getattr(args, "deepspeed_config", None)
    if source is None:
        raise cfg.ConfigError("no DeepSpeed config: pass config= (dict or path) or args.deepspeed_config")
    return cfg._load(source)


def check_supported(raw: dict) -> None:
    """Refuse, at start, combinations the head cannot train correctly."""
    if raw.get("fp16", {}).get("enabled", False):
        raise cfg.ConfigError("fp16.enabled=true: fp16 loss scaling would scale the head's gradients; "
                              "use bf16.enabled=true (or fp32) with ds_xc")
    stage = raw.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise cfg.ConfigError(f"zero_optimization.stage={stage!r}: ds_xc supports ZeRO stages 0, 1 and 2 "
                              "for the backbone")
    method = (raw.get(cfg.COMPRESSION_SECTION) or {}).get("method", "bayes_prior")
    if cfg.COMPRESSION_SECTION in raw and method != "none":  # refused before an engine is built
        from ds_xc.compression.deepspeed import check_zero_stage
        check_zero_stage(stage, method)
    overlap = (raw.get(cfg.HEAD_SECTION) or {}).get("overlap")
    if overlap:
        from ds_xc.overlap.run import check_overlap
        check_overlap(cfg.validate_section(cfg.OverlapConfig, overlap, f"{cfg.HEAD_SECTION}.overlap"), int(stage),
                      bool(raw.get("bf16", {}).get("enabled", False)))
    if cfg.HEAD_SECTION not in raw:
        raise cfg.ConfigError(f"the DeepSpeed config has no '{cfg.HEAD_SECTION}' section; add one with at "
                              "least num_classes and embedding_dim")


def _cpu_friendly_deepspeed():
    """Skip the shared-memory inference op that DeepSpeed JIT-builds on CPU (about a minute)."""
    import deepspeed
    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def init_distributed(timeout_s: float = 1800.0) -> None:
    """Start torch.distributed the way DeepSpeed does (gloo on CPU, NCCL on GPU).

    Without launcher variables (a plain ``python train.py``) it starts a one-process group.
    """
    import datetime
    import socket
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed = _cpu_friendly_deepspeed()
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=timeout_s))


def _base_lr(raw: dict, optimizer) -> Optional[float]:
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        return float(optimizer.param_groups[0]["lr"])
    lr = raw.get("optimizer", {}).get("params", {}).get("lr")
    return float(lr) if lr else None


@dataclass
class XCEngine:
    """A DeepSpeed engine (the backbone) stepped together with a ClassParallelHead.

    ``loss = xc(inputs, labels); xc.backward(loss); xc.step()`` is one micro-step; the head
    optimizer steps when the engine reaches a gradient-accumulation boundary.
    """

    engine: Any
    head: ClassParallelHead
    head_optimizer: torch.optim.Optimizer
    config: cfg.XCConfig
    lr_scheduler: Any = None
    base_lr: Optional[float] = None
    compression: Any = None  # the CompressedOptimizer reducing the backbone, when configured
    schedule: Any = None  # ds_xc.overlap.ChunkedHeadSchedule, when extreme_classification.overlap.enabled
    grad_reducer: Any = None  # ds_xc.overlap.BucketedGradReducer, when overlap_grad_reduce is on

    def __call__(self, inputs, labels, batch_sizes=None) -> torch.Tensor:
        return self.head(self.engine(inputs), labels, batch_sizes)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def forward_backward(self, inputs, labels, batch_sizes=None) -> torch.Tensor:
        """One micro-step's forward and backward; returns the global-batch mean loss (detached).

        With ``extreme_classification.overlap.enabled`` this is the overlapped schedule
        (ds_xc/overlap): the head runs in micro-chunks with its gathers and reduce-scatters
        in flight, the backbone's backward starts per chunk, and its gradients are reduced in
        buckets during the backward. Otherwise ``loss = xc(inputs, labels); xc.backward(loss)``.
        Follow it with :meth:`step` as usual.
        """
        if self.schedule is None:
            loss = self(inputs, labels, batch_sizes)
            self.backward(loss)
            return loss.detach()
        from ds_xc.overlap.run import overlapped_micro_step
        return overlapped_micro_step(self, inputs, labels, batch_sizes)

    def overlap_stats(self) -> dict:
        """The overlap timeline: {"last": the last micro-step, "mean": means over all} (empty when off)."""
        if self.schedule is None:
            return {}
        tl = self.schedule.timeline
        return {"last": dict(tl.last), "mean": tl.summary()}

    def step(self) -> None:
        """Optimizer step at gradient-accumulation boundaries (a no-op between them, as engine.step).

        The head steps first, with the learning rate the backbone uses in this step: its
        update does not depend on the backbone's gradients, so with the overlap pipeline it
        runs while the backbone's gradient buckets are still on the wire; then the buckets
        are waited for and the engine steps.
        """
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary:
            head_cfg = self.config.extreme_classification.optimizer
            if head_cfg.lr_schedule == "follow_engine" and self.base_lr:
                ratio = self.engine.get_lr()[0] / self.base_lr
                for group in self.head_optimizer.param_groups:
                    group["lr"] = head_cfg.lr * ratio
            self.head_optimizer.step()
            self.head_optimizer.zero_grad(set_to_none=True)
            if self.grad_reducer is not None:
                self.grad_reducer.finish()
        self.engine.step()
        if self.schedule is not None:
            from ds_xc.overlap.run import end_micro_step
            end_micro_step(self)

    def train(self, mode: bool = True) -> "XCEngine":
        self.engine.train(mode)
        self.head.train(mode)
        return self

    def eval(self) -> "XCEngine":
        return self.train(False)

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None) -> str:
        """Save the engine's checkpoint plus every rank's head shard and head optimizer.

        The head shards are written first (atomically, one file per rank), then the engine
        writes its files and moves ``latest`` last, so ``latest`` never points at a tag
        whose head is missing.
        """
        tag = tag or f"global_step{self.global_steps}"
        save_head_state(os.path.join(save_dir, str(tag)), self.head, self.head_optimizer)
        if self.compression is not None:  # per-rank residuals: DeepSpeed saves rank 0's optimizer only
            from ds_xc.compression import save_compression_state
            save_compression_state(os.path.join(save_dir, str(tag)), self.compression)
        if dist.is_initialized():
            dist.barrier()
        state = dict(client_state or {})
        state["ds_xc"] = {"num_classes": self.head.num_classes, "world_size": self.head.world_size}
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=state)
        return str(tag)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None) -> Optional[dict]:
        """Load engine + head; returns the client state, or None when there is no checkpoint."""
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                return None
            with open(latest) as fh:
                tag = fh.read().strip()
        check_head_checkpoint(os.path.join(load_dir, str(tag)), self.head)  # refuse before anything loads
        path, client_state = self.engine.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint for tag {tag!r} in {load_dir!r}")
        load_head_state(os.path.join(load_dir, str(tag)), self.head, self.head_optimizer)
        if self.compression is not None:  # absent or other world size: residuals restart (warned)
            from ds_xc.compression import load_compression_state
            load_compression_state(os.path.join(load_dir, str(tag)), self.compression)
        return client_state or {}


def initialize(args=None, model: torch.nn.Module = None, config=None, model_parameters=None,
               optimizer=None, lr_scheduler=None, head_group=None, **ds_kwargs) -> XCEngine:
    """Build the DeepSpeed engine for ``model`` (the backbone), the head and its optimizer.

    ``config`` is the whole DeepSpeed config (dict or path; or pass ``args.deepspeed_config``);
    its ``extreme_classification`` section describes the head. ``head_group`` is the group
    the classes are sharded over (default: the world).
    """
    raw = load_raw_config(config, args)
    check_supported(raw)
    xc_config = cfg.parse_config(raw)
    deepspeed = _cpu_friendly_deepspeed()
    if not dist.is_initialized():  # a plain `python script.py` becomes a one-process group
        init_distributed()
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    base_lr = _base_lr(raw, optimizer)
    use_args_config = args is not None and getattr(args, "deepspeed_config", None) is not None
    engine, _, _, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model_parameters, optimizer=optimizer,
        lr_scheduler=lr_scheduler, config=None if use_args_config else raw, **ds_kwargs)
    head = ClassParallelHead.from_config(xc_config.extreme_classification, group=head_group,
                                         device=engine.device)
    head_optimizer = build_head_optimizer(head, xc_config.extreme_classification.optimizer)
    compression = None
    if xc_config.gradient_compression is not None and xc_config.gradient_compression.enabled:
        from ds_xc.compression import attach_to_engine  # takes over the backbone's reduction
        compression = attach_to_engine(engine, xc_config.gradient_compression)
    schedule = reducer = None
    if xc_config.extreme_classification.overlap.enabled:
        from ds_xc.overlap.run import build_overlap
        schedule, reducer = build_overlap(engine, head, xc_config.extreme_classification.overlap, compression)
    log.info("ds_xc: engine ready (ZeRO stage %d, bf16=%s), head shard %s", engine.zero_optimization_stage(),
             engine.bfloat16_enabled(), head.extra_repr())
    return XCEngine(engine=engine, head=head, head_optimizer=head_optimizer, config=xc_config,
                    lr_scheduler=scheduler, base_lr=base_lr, compression=compression, schedule=schedule,
                    grad_reducer=reducer)
