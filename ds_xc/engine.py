"""DeepSpeed glue: a backbone engine plus a class-parallel head that the engine never touches.

Why the head lives outside the engine: ``deepspeed.initialize`` broadcasts rank 0's
parameters to every rank and the engine averages every gradient over the data-parallel
group; ZeRO 1/2 even flattens and partitions parameters, mixing rank-distinct shards at
lr=0 (see docs/deepspeed_cpu.md). A class shard is different on every rank and
must only ever see its own gradient. So the engine gets the backbone alone, and the head
gets its own optimizer, stepped at the engine's gradient-accumulation boundaries.

Gradients still flow through one graph: ``engine.backward(loss)`` runs backward through
the head and the backbone together. The engine divides the loss by the accumulation
steps before backward, so the head's gradient is scaled like the backbone's. Loss
scaling (fp16) would scale the head's gradient too, and is refused at start.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import random
import shutil
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ds_xc import config as cfg
from ds_xc.checkpoint import (CheckpointError, apply_head_state, atomic_save, fsync_tree, load_file, publish_tag,
                              read_head_state, resolve_tag, save_head_state)
from ds_xc.head import ClassParallelHead, build_head_optimizer
from ds_xc.manifest import raise_if_disk_full, verify_manifest_all_ranks, write_manifest_all_ranks
from ds_xc.parallel.agree import agree, all_or_none
from ds_xc.parallel.groups import group_size, new_group, set_comm_timeout
from ds_xc.peers import describe_comm_failure, gather_peers, is_comm_failure, lost_peers, stopped_peers

log = logging.getLogger(__name__)

__all__ = ["initialize", "init_distributed", "XCEngine", "check_supported", "load_raw_config", "gather_peers",
           "lost_peers", "stopped_peers", "describe_comm_failure", "is_comm_failure", "PHASES"]

RNG_DIR = "ds_xc_rng"
STAGING_PREFIX = ".staging_"
# what XCEngine.phase can name: the part of a step a rank is in, for the message of a failed collective
PHASES = ("setup", "forward", "backward", "gradient reduction", "optimizer step", "checkpoint save",
          "checkpoint load", "index rebuild", "evaluation", "overlapped forward-backward")


class _Phase:
    """``with xc.in_phase(name):`` sets ``xc.phase`` for the block; an exception leaves it set (the
    failure handler reads it), a normal exit restores the enclosing phase. Two attribute writes."""

    __slots__ = ("xc", "name", "prev")

    def __init__(self, xc, name: str):
        self.xc, self.name = xc, name

    def __enter__(self):
        self.prev, self.xc.phase = self.xc.phase, self.name

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.xc.phase = self.prev
        return False


def load_raw_config(config=None, args=None) -> dict:
    """The whole DeepSpeed config as a dict, from ``config`` or ``args.deepspeed_config``."""
    source = config if config is not None else getattr(args, "deepspeed_config", None)
    if source is None:
        raise cfg.ConfigError("no DeepSpeed config: pass config= (dict or path) or args.deepspeed_config")
    return cfg._load(source)


def _raw_section(raw: dict, name: str) -> dict:
    """``raw[name]`` as a dict ({} when absent or null); anything else is refused naming the section."""
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise cfg.ConfigError(f"{name}: expected a JSON object (dict), got {type(value).__name__} {value!r}")
    return value


def check_supported(raw: dict) -> None:
    """Refuse, at start, combinations the head cannot train correctly."""
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
        check_zero_stage(stage, method)
    overlap = _raw_section(raw, cfg.HEAD_SECTION).get("overlap")
    if overlap:
        from ds_xc.overlap.run import check_overlap
        check_overlap(cfg.validate_section(cfg.OverlapConfig, overlap, f"{cfg.HEAD_SECTION}.overlap"), int(stage),
                      bool(_raw_section(raw, "bf16").get("enabled", False)))
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
    set_comm_timeout(timeout_s)  # for the groups ds_xc creates (torch would give them 30 minutes)


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
    flag_group: Any = None  # a gloo group of the world for the per-step non-finite verdict (off the bucket traffic)
    peers: list = field(default_factory=list)  # [(hostname, pid)] per world rank, to name a lost peer
    skipped_steps: int = 0  # optimizer steps skipped for NaN/Inf (extreme_classification.nonfinite="skip")
    _window_bad: bool = False  # a micro-step of the current accumulation window had a non-finite loss
    phase: str = "setup"  # the part of the step this rank is in (one of PHASES), named when a collective fails

    def in_phase(self, name: str) -> _Phase:
        """A context manager marking a part of the step (see PHASES), e.g. ``with xc.in_phase("evaluation"):``."""
        return _Phase(self, name)

    def where(self) -> str:
        """'during <phase> at global step N' (N: optimizer steps completed), for error messages."""
        return f"during {self.phase} at global step {self.global_steps}"

    def __call__(self, inputs, labels, batch_sizes=None) -> torch.Tensor:
        with self.in_phase("forward"):
            return self.head(self.engine(inputs), labels, batch_sizes)

    def backward(self, loss: torch.Tensor) -> None:
        """engine.backward(loss), unless the loss is NaN/Inf: then no backward runs and the step is skipped.

        The loss is the global-batch mean, the same value on every rank, so every rank takes this
        decision alike without communicating (and nobody waits in DeepSpeed's gradient all-reduce)."""
        if self._loss_is_finite(loss):
            with self.in_phase("backward"):
                self.engine.backward(loss)

    def _loss_is_finite(self, loss: torch.Tensor) -> bool:
        if bool(torch.isfinite(loss.detach()).all()):
            return True
        if self.config.extreme_classification.nonfinite == "raise":
            raise FloatingPointError(f"the loss is {float(loss.detach())} at step {self.global_steps} on every rank "
                                     f"({cfg.HEAD_SECTION}.nonfinite='raise')")
        self._window_bad = True
        return False

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
        with self.in_phase("overlapped forward-backward"):
            loss = overlapped_micro_step(self, inputs, labels, batch_sizes)
        self._loss_is_finite(loss)  # the chunks' backward may have run already: step() skips the update
        return loss

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
        with self.in_phase("optimizer step"):
            self._step()

    def _step(self) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary and self._step_is_bad():
            self._skip_step()
            return
        if boundary:
            head_cfg = self.config.extreme_classification.optimizer
            if head_cfg.lr_schedule == "follow_engine" and self.base_lr:
                ratio = self.engine.get_lr()[0] / self.base_lr
                for group in self.head_optimizer.param_groups:
                    group["lr"] = head_cfg.lr * ratio
            self.head_optimizer.step()
            self.head_optimizer.zero_grad(set_to_none=True)
            if self.grad_reducer is not None:
                with self.in_phase("gradient reduction"):
                    self.grad_reducer.finish()
        self.engine.step()
        if self.schedule is not None:
            from ds_xc.overlap.run import end_micro_step
            end_micro_step(self)

    # ------------------------------------------------------------------ non-finite steps
    def _grads_finite(self) -> bool:
        """This rank's head gradient and the backbone gradients the engine's optimizer will use are finite.

        Where those live depends on the mode: ``.grad`` under ZeRO 0 (fp32, and bf16 through
        DeepSpeed's fp16-style wrapper); DeepSpeed's partitioned flat buffers under ZeRO 1/2
        (checked with the optimizer's own public overflow test, this rank's partition); the
        bf16 optimizer's fp32 gradients (``get_grads_for_norm``) with bf16 + ZeRO 1 and fp32
        accumulation."""
        head_grad = self.head.weight.grad
        if head_grad is not None and not _finite(head_grad._values() if head_grad.is_sparse else head_grad):
            return False
        opt = self.engine.optimizer
        if self.engine.zero_optimization_stage() in (1, 2) and hasattr(opt, "has_overflow_partitioned_grads_serial"):
            if getattr(opt, "cpu_offload", False):
                return not bool(getattr(opt, "local_overflow", False))
            return not bool(opt.has_overflow_partitioned_grads_serial())
        if hasattr(opt, "get_grads_for_norm") and hasattr(opt, "fp32_groups_gradients_flat"):
            grads, expert = opt.get_grads_for_norm()
            if not all(_finite(g) for g in list(grads) + [g for gs in expert.values() for g in gs]):
                return False
        return all(p.grad is None or _finite(p.grad) for p in self.engine.module.parameters())

    def _step_is_bad(self) -> bool:
        """Every rank's verdict on this accumulation window (non-finite loss or gradients), all-reduced."""
        bad = self._window_bad or not self._grads_finite()
        self._window_bad = False
        flag = torch.tensor([1.0 if bad else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flag_group)
        if not flag.item():
            return False
        if self.config.extreme_classification.nonfinite == "raise":
            raise FloatingPointError(f"NaN/Inf gradients at step {self.global_steps} (on this rank: {bad}; "
                                     f"{cfg.HEAD_SECTION}.nonfinite='raise')")
        return True

    def _skip_step(self) -> None:
        """End the window without changing a weight or an optimizer state, on every rank alike.

        The engine still steps (its counters, gradient clearing and wrappers' bookkeeping run as
        usual) but its innermost optimizer's step is a no-op and its lr scheduler does not move,
        as DeepSpeed does for an fp16 overflow. Buckets already in flight are completed first;
        their error-feedback residuals (overlap + compression) held this step's gradients and
        restart from zero.
        """
        reducer, comp = self.grad_reducer, self.compression
        if reducer is not None and reducer.armed:
            reducer.finish()  # every rank armed it: complete the collectives in flight
            if comp is not None:
                comp._restart_rank_state()
        elif comp is not None:
            comp._reduced_by_hooks = True  # skip its reduction: the residuals stay as they were
        self.head_optimizer.zero_grad(set_to_none=True)
        log.warning("step %d skipped: NaN/Inf loss or gradients on some rank (%s.nonfinite='skip'; %d skipped "
                    "so far)", self.global_steps, cfg.HEAD_SECTION, self.skipped_steps + 1)
        counted = self.engine.skipped_steps
        with _without_update(self.engine):
            self.engine.step()
        if self.engine.skipped_steps == counted:  # DeepSpeed's optimizer did not see an overflow itself
            self.engine.skipped_steps += 1
        self.skipped_steps += 1
        if self.schedule is not None:
            from ds_xc.overlap.run import end_micro_step
            end_micro_step(self)

    def stats(self) -> dict:
        """Reliability counters: optimizer steps skipped for NaN/Inf, and micro-steps whose
        embeddings were non-finite (this rank's head saw them)."""
        return {"skipped_steps": self.skipped_steps, "nonfinite_inputs": self.head.nonfinite_inputs}

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
        """Save the engine's checkpoint plus every rank's head shard, residuals and RNG states.

        Staged, so that a process killed at any point leaves the previous checkpoint and
        ``latest`` as they were: every file goes into ``save_dir/.staging_<tag>`` (head shards,
        compression residuals, RNG states, then DeepSpeed's files, with DeepSpeed told not to
        touch ``latest``); then rank 0 fsyncs the files, renames the folder to
        ``save_dir/<tag>`` and replaces ``latest`` atomically (write, fsync, rename).

        Collective: the ranks first agree on the folder and the tag (a different one on one
        rank is an error on every rank, before anything is written), and on the outcome of
        each of their own steps (a rank that cannot write its files makes every rank raise;
        nothing is published and ``latest`` keeps naming the previous checkpoint).
        """
        with self.in_phase("checkpoint save"):
            try:
                return self._save_checkpoint(save_dir, tag, client_state)
            except Exception as exc:
                if not is_comm_failure(exc):
                    raise_if_disk_full(exc, save_dir)  # torch.save says "unexpected pos", not ENOSPC
                raise

    def _save_checkpoint(self, save_dir: str, tag: Optional[str], client_state: Optional[dict]) -> str:
        group = self.flag_group
        with all_or_none("save_checkpoint (checking the tag)", group):
            tag = str(tag or f"global_step{self.global_steps}")
            if not tag or os.sep in tag or tag.startswith(".") or tag == "latest":
                raise ValueError(f"checkpoint tag {tag!r}: must be a plain folder name (no '/', not starting "
                                 "with '.', not 'latest')")
        agree((os.path.abspath(save_dir), tag), "save_checkpoint(save_dir, tag)", group)
        rank0 = _world()[0] == 0
        staging = os.path.join(save_dir, STAGING_PREFIX + tag)
        with all_or_none(f"save_checkpoint: preparing {save_dir!r}", group):
            if rank0:
                os.makedirs(save_dir, exist_ok=True)
                for name in os.listdir(save_dir):  # left by saves that were killed (one job per save_dir)
                    if name.startswith(STAGING_PREFIX):
                        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        with all_or_none(f"save_checkpoint: writing the head shards, residuals and RNG states into {staging!r}",
                         group):
            save_head_state(staging, self.head, self.head_optimizer)
            if self.compression is not None:  # per-rank residuals: DeepSpeed saves rank 0's optimizer only
                from ds_xc.compression import save_compression_state
                save_compression_state(staging, self.compression)
            atomic_save(_rng_state(), _rng_file(staging))
        state = dict(client_state or {})
        state["ds_xc"] = {"num_classes": self.head.num_classes, "world_size": self.head.world_size,
                          "skipped_steps": self.skipped_steps}
        self.engine.save_checkpoint(save_dir, tag=STAGING_PREFIX + tag, client_state=state, save_latest=False)
        write_manifest_all_ranks(staging, group)
        with all_or_none(f"save_checkpoint: publishing {os.path.join(save_dir, tag)!r} (rank 0)", group):
            if rank0:
                fsync_tree(staging)
                publish_tag(save_dir, tag, staging)
        log.info("checkpoint %s saved", os.path.join(save_dir, tag))
        return tag

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None) -> Optional[dict]:
        """Load engine + head (+ residuals, RNG states); returns the client state, or None when
        there is no checkpoint. A head of another class count or world size is refused before
        anything is loaded, with the command that reshards it.

        Collective: the ranks agree on the folder and the tag (read from ``latest`` on each
        rank), then every rank reads and checks all of its files (head shard, residuals, RNG
        state, DeepSpeed's files present and readable) and the ranks agree that all succeeded;
        a file missing or damaged on one rank raises on every rank and nothing is loaded."""
        with self.in_phase("checkpoint load"):
            return self._load_checkpoint(load_dir, tag)

    def _load_checkpoint(self, load_dir: str, tag: Optional[str]) -> Optional[dict]:
        group = self.flag_group
        with all_or_none(f"load_checkpoint: reading {os.path.join(load_dir, 'latest')!r}", group):
            if tag is None:
                latest = os.path.join(load_dir, "latest")
                if os.path.isfile(latest):
                    with open(latest) as fh:
                        tag = fh.read().strip()
        agree((os.path.abspath(load_dir), None if tag is None else str(tag)), "load_checkpoint(load_dir, tag "
              "or the tag in latest)", group)
        if tag is None:
            return None
        tag_dir = os.path.join(load_dir, str(tag))
        with all_or_none(f"load_checkpoint: locating {tag_dir!r}", group):
            if _world()[0] == 0 and not os.path.isdir(tag_dir):
                with contextlib.suppress(FileNotFoundError):
                    resolve_tag(load_dir, str(tag))  # puts back a tag whose re-save was killed between renames
        verify_manifest_all_ranks(tag_dir, group)  # a truncated or bit-flipped file: refused on every rank
        with all_or_none(f"load_checkpoint: reading {tag_dir!r}", group):  # refuse before anything loads
            head_state, comp_state, rng = self._read_checkpoint(tag_dir)
        path, client_state = self.engine.load_checkpoint(load_dir, tag=tag)
        agree(path is not None, f"load_checkpoint: DeepSpeed found a checkpoint for tag {tag!r} in {load_dir!r}",
              group)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint for tag {tag!r} in {load_dir!r}")
        with all_or_none(f"load_checkpoint: loading the head shard, residuals and RNG state of {tag_dir!r}", group):
            apply_head_state(self.head, self.head_optimizer, head_state)
            if self.compression is not None:  # absent or other world size: residuals restart (warned)
                from ds_xc.compression.checkpoint import apply_compression_state
                apply_compression_state(tag_dir, self.compression, *comp_state)
            _apply_rng_state(rng, tag_dir)
        client_state = client_state or {}
        self.skipped_steps = int(client_state.get("ds_xc", {}).get("skipped_steps", 0))
        self._window_bad = False
        return client_state

    def _read_checkpoint(self, tag_dir: str) -> tuple:
        """This rank's head shard, compression state and RNG state, read and checked; DeepSpeed's
        files checked present and readable. Changes nothing (the load happens after agreement)."""
        head_state = read_head_state(tag_dir, self.head)
        comp_state = (None, False)
        if self.compression is not None:
            from ds_xc.compression.checkpoint import read_compression_state
            comp_state = read_compression_state(tag_dir, self.compression)
        rng = _read_rng_state(tag_dir)
        _check_engine_files(tag_dir, self.engine)
        return head_state, comp_state, rng


# ---------------------------------------------------------------------- helpers
def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


@contextlib.contextmanager
def _without_update(engine):
    """engine.step() with its innermost optimizer's step a no-op and no lr-scheduler step."""
    opt = getattr(engine, "basic_optimizer", None) or engine.optimizer
    scheduler = engine.lr_scheduler
    opt.step = lambda *args, **kwargs: None  # shadows the class method on this instance only
    engine.lr_scheduler = None
    try:
        yield
    finally:
        del opt.step
        engine.lr_scheduler = scheduler


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _rng_file(tag_dir: str) -> str:
    rank, world = _world()
    return os.path.join(tag_dir, RNG_DIR, f"rank_{rank:05d}_of_{world:05d}.pt")


def _rng_state() -> dict:
    """This process's global RNG states (torch CPU and CUDA, numpy, python), as plain tensors and tuples.

    ds_xc's own random draws use private generators saved with their owners (samplers,
    compression seeds per step); these global streams serve the user's backbone (dropout,
    augmentation) and data code, which a resume must continue exactly."""
    import numpy as np
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _read_rng_state(tag_dir: str) -> Optional[dict]:
    """The RNG states saved in ``tag_dir`` (None when absent), read to the CPU: RNG states are CPU
    ByteTensors, CUDA ones included (``torch.cuda.set_rng_state`` takes a CPU tensor)."""
    path = _rng_file(tag_dir)
    return load_file(path, "RNG state file", map_location="cpu") if os.path.isfile(path) else None


def _apply_rng_state(state: Optional[dict], tag_dir: str) -> None:
    """Restore the global RNG streams read from ``tag_dir`` (None: the file was absent, warned)."""
    if state is None:
        log.warning("%s is absent (older checkpoint, or another world size): the global torch/numpy/python "
                    "RNG streams are not restored", _rng_file(tag_dir))
        return
    import numpy as np
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        saved, here = len(state["cuda"]), torch.cuda.device_count()
        if saved != here:
            log.warning("%s holds CUDA RNG states of %d device(s), this process sees %d: the first %d are "
                        "restored", _rng_file(tag_dir), saved, here, min(saved, here))
        for index, cuda_state in enumerate(state["cuda"][:here]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)


def _check_engine_files(tag_dir: str, engine) -> None:
    """DeepSpeed's files of ``tag_dir`` this rank will read exist and are complete torch zip files.

    DeepSpeed reads them with collectives around, so a rank that failed inside its load would
    leave the others waiting; checking here (the zip directory at the end of each file: a
    truncated file has none) turns a missing or cut file into an agreed error first."""
    import zipfile
    model = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    files = [model] + (sorted(glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_optim_states.pt")))
                       if engine.zero_optimization_stage() in (1, 2) else [])
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"DeepSpeed checkpoint file {path!r} is missing")
        try:
            with zipfile.ZipFile(path) as zf:
                zf.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path!r} (damaged or truncated): "
                                  f"{exc}") from None


def _agreed_config(raw: dict, head_group) -> cfg.XCConfig:
    """Validate the config on every rank, check that every rank has the same one, and that each
    rank of ``head_group`` gets at least one class; all before ``deepspeed.initialize`` runs.

    A config that is invalid on one rank only, or differs between ranks, is an error on every
    rank (naming the keys and the ranks' values) instead of a hang in DeepSpeed's first collective."""
    world = dist.group.WORLD
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


def initialize(args=None, model: torch.nn.Module = None, config=None, model_parameters=None,
               optimizer=None, lr_scheduler=None, head_group=None, **ds_kwargs) -> XCEngine:
    """Build the DeepSpeed engine for ``model`` (the backbone), the head and its optimizer.

    ``config`` is the whole DeepSpeed config (dict or path; or pass ``args.deepspeed_config``);
    its ``extreme_classification`` section describes the head. ``head_group`` is the group
    the classes are sharded over (default: the world).
    """
    raw = load_raw_config(config, args)
    deepspeed = _cpu_friendly_deepspeed()
    if not dist.is_initialized():  # single process so far: refuse a bad config before starting a group
        check_supported(raw)
        cfg.parse_config(raw)
        init_distributed()  # a plain `python script.py` becomes a one-process group
    xc_config = _agreed_config(raw, head_group)
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
    flag_group = None
    if dist.get_world_size() > 1:  # a group of its own: the verdict does not queue behind gradient buckets
        flag_group = new_group(backend="gloo")
    peers = gather_peers()
    log.info("ds_xc: engine ready (ZeRO stage %d, bf16=%s), head shard %s", engine.zero_optimization_stage(),
             engine.bfloat16_enabled(), head.extra_repr())
    xc = XCEngine(engine=engine, head=head, head_optimizer=head_optimizer, config=xc_config,
                  lr_scheduler=scheduler, base_lr=base_lr, compression=compression, schedule=schedule,
                  grad_reducer=reducer, flag_group=flag_group, peers=peers)
    _mark_phase(xc, engine, "allreduce_gradients", "gradient reduction")  # DeepSpeed's, inside engine.backward
    _mark_phase(xc, head.sampler, "rebuild", "index rebuild")  # ANN index / kNN graph, inside the forward
    return xc


def _mark_phase(xc: XCEngine, obj, method: str, phase: str) -> None:
    """Wrap ``obj.method`` (this instance only) in ``xc.in_phase(phase)``; a no-op when it has no such method."""
    inner = getattr(obj, method, None)
    if inner is None:
        return

    def marked(*args, **kwargs):
        with xc.in_phase(phase):
            return inner(*args, **kwargs)
    setattr(obj, method, marked)
