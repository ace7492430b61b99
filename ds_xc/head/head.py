"""ClassParallelHead: a classifier layer whose classes are sharded over a process group.

Legend: B local batch rows, N = sum of B over ranks (global batch), d embedding dim,
L = num_local classes of this rank, K active classes of this rank in a step.

One step (docs/design.md): embeddings (B, d) and labels (B,) are all-gathered to (N, d) and
(N,); the sampler picks this shard's active classes (K of L); the fused sharded loss
scores the global batch against them in row chunks and returns the global-batch mean,
identical on every rank. Backward reduce-scatters the embedding gradient, scaled by P so
that each rank gets P times the gradient of the global mean with respect to its rows
(data-parallel averaging then yields the global mean's gradient; with equal batches this
is the gradient of the local mean), while this rank's weight shard gets the gradient of
the global mean. Local batches may differ in size (and be empty): the sizes travel in the
input check's all-reduce. The shard is never averaged across ranks: keep it out of
data-parallel wrappers (see ds_xc.engine).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ds_xc import config as cfg
from ds_xc.head.checks import (BAD_INPUT, TABLE_COLS, Verdict, agree_topk, batch_sizes_length_error, decide,
                               fill_layout, fill_verdict, local_problem, options_fingerprint)
from ds_xc.head.fingerprint import weight_checksum as _checksum
from ds_xc.head.margins import TargetLoss, build_loss
from ds_xc.head.partition import init_shard, shard_range, shard_topk
from ds_xc.head.replicas import Replicas
from ds_xc.head.row_terms import LossOptions, RowTerms, mean_of
from ds_xc.head.softmax import sharded_margin_loss, stat_dtype
from ds_xc.head.workspace import Workspace, gather_rows
from ds_xc.parallel.collectives import (all_gather_no_grad, all_gather_rows, merge_topk,
                                        replicated_rows, scale_grad)
from ds_xc.parallel.agree import agree
from ds_xc.parallel.groups import group_rank, group_size, is_distributed, resolve_group
from ds_xc.parallel.node_gather import node_gather_rows
from ds_xc.sampling import ActiveSet, build_sampler
from ds_xc.sampling.base import local_targets
from ds_xc_ops.logs import log_once
from ds_xc.head.softmax_backend import SOFTMAX_BACKENDS

log = logging.getLogger(__name__)

__all__ = ["ClassParallelHead", "init_shard"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
UPDATES = ("auto",) + cfg.UPDATE_MODES  # extreme_classification.optimizer.update
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
INPUT_PARALLEL = ("data", "replicated")  # extreme_classification.input_parallel


class ClassParallelHead(nn.Module):
    """Class-sharded classifier with exact softmax / margin losses and sampled softmax.

    Args:
        embedding_dim: d.
        num_classes: C, split over ``group`` as ``C // P + (rank < C % P)`` contiguous rows.
        loss: a loss config (dict, model or name: softmax | cosface | arcface | combined | dsoftmax).
        sampler: a sampler config (dict, model or name: full | uniform).
        group: the process group the classes are sharded over (a ProcessGroup or 1-D DeviceMesh;
            None: the world, or one process).
        chunk_size: rows of the global batch per logits chunk (0: one chunk).
        dtype, init_std, seed: weight dtype and init; init is per class, independent of P.
        update: "dense" (dense weight gradients) or "lazy" / "frozen" / "lazy_exact" (sparse
            gradient rows, for the lazy head optimizers; sampled heads then cost O(K*d) per step),
            or "auto" (``config.resolve_update``: dense for the full sampler, lazy_exact for sampled
            heads, lazy for bfloat16 sampled heads; the config's default, logged once). The
            constructor's default stays "dense": a head built by hand gives dense weight gradients,
            usable with any torch optimizer. With "lazy_exact" the optimizer built by
            build_head_optimizer sets ``lazy_catch_up``, which forward, the sampler's reads of the
            weights, topk, rebuild_index, state_dict and metrics call to bring stale rows up to date.
        check_inputs: validate label range, shapes, devices and finiteness on every rank before
            the collectives (one small all-reduce, and one host sync on GPU, per checked step).
        check_interval: run that full check every N-th call (1: every call). Unchecked calls
            still exchange the batch sizes (with a label-range test) unless ``batch_sizes`` is
            passed; then they run without any sync (docs/head.md, "Input checks").
        nonfinite: "raise" (the default of a head used on its own) or "skip" (NaN/Inf embeddings:
            forward returns a NaN loss without a graph on every rank, touching neither the
            weights nor the sampler; XCEngine, whose config default is "skip", then skips the step).
        softmax_backend: "torch" | "triton" | "auto", the implementation of the exact fused
            softmax (ds_xc/head/softmax_backend.py; extreme_classification.softmax_backend).
        input_parallel: "data" (each rank passes its own rows: they are all-gathered, and the
            embedding gradient reduce-scattered) or "replicated" (every rank of ``group`` passes
            the same rows, as under tensor parallelism: no gather, the loss is the mean over the
            given rows, and every rank gets the full gradient with respect to them, the partial
            gradients all-reduced over ``group``). Every sampler works on either.
        replica_group: the ranks holding a copy of this shard (2-D layout, ds_xc/head/replicas.py;
            None: no replicas). The loss is then the mean over the union of every rank's rows and the
            shard gradient is summed over ``replica_group`` before the head optimizer steps.
        ignore_index, label_smoothing, z_loss, softcap, reduction: the loss options (docs/head.md,
            "Loss options"; ds_xc/head/row_terms.py); None keeps the value of the ``loss`` config
            (whose keys they also are; defaults -100, 0, 0, 0, "mean").

    Attribute ``last_lse``: after each forward, every row's log partition function lse (this rank's
    rows, the labels' shape, detached; the one z_loss squares; ignored rows included).

    Attribute ``node_gather``: set it to a :class:`ds_xc.parallel.node_gather.NodeGather` over ``group``
    to exchange the rows across nodes in two rank-aligned stages (``topology.head_collectives``).
    """

    def __init__(self, embedding_dim: int, num_classes: int, loss="softmax", sampler="full",
                 group=None, chunk_size: int = 0, dtype: Union[str, torch.dtype] = torch.float32,
                 init_std: float = 0.01, seed: int = 0, update: str = "dense",
                 check_inputs: bool = True, nonfinite: str = "raise", device=None,
                 softmax_backend: str = "torch", check_interval: int = 1, input_parallel: str = "data",
                 replica_group=None, ignore_index: Optional[int] = None, label_smoothing: Optional[float] = None,
                 z_loss: Optional[float] = None, softcap: Optional[float] = None, reduction: Optional[str] = None):
        super().__init__()
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.dtype: got {dtype!r}; allowed: {sorted(_DTYPES)}")
            dtype = _DTYPES[dtype]
        # the config path's rules and messages for the plain fields (field, value, what is allowed)
        cfg.validate_section(cfg.HeadConfig, {"embedding_dim": embedding_dim, "num_classes": num_classes,
                                              "init_std": init_std, "seed": seed,
                                              "dtype": _DTYPE_NAMES.get(dtype, str(dtype))}, cfg.HEAD_SECTION)
        if update not in UPDATES:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.optimizer.update: got {update!r}; allowed: "
                                  f"{', '.join(map(repr, UPDATES))}")
        sampler_config = cfg.parse_sampler(sampler)
        requested = update
        update, why = cfg.resolve_update(update, sampler_config.type, _DTYPE_NAMES.get(dtype, str(dtype)))
        if requested == "auto":
            log_once(log, logging.INFO, f"{cfg.HEAD_SECTION}.optimizer.update 'auto' runs {update!r} ({why})")
        if chunk_size < 0:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.chunk_size: got {chunk_size}; must be >= 0")
        self.group = resolve_group(group)  # None: the world, named explicitly
        self.rank, self.world_size = group_rank(group), group_size(group)
        self.replicas = Replicas(replica_group)  # the 2-D layout's second dimension (inactive: 1-D)
        self.node_gather = None  # a NodeGather over `group`: the row exchange across nodes (None: the flat gather)
        self.embedding_dim, self.num_classes = int(embedding_dim), int(num_classes)
        self.class_start, self.num_local = shard_range(self.num_classes, self.world_size, self.rank)
        self.loss_fn: TargetLoss = build_loss(loss)
        self.loss_options = LossOptions.build(None if isinstance(loss, TargetLoss) else cfg.parse_loss(loss),
                                              self.loss_fn.normalised, ignore_index=ignore_index,
                                              label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                              reduction=reduction)
        if sampler_config.type != "full":
            self.loss_options.refuse_sampled(sampler_config.type)
        if softmax_backend == "triton" and self.loss_options.softcap:  # 'auto' runs the PyTorch path for it
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.loss.softcap: got {self.loss_options.softcap}; the Triton "
                                  f"kernels ({cfg.HEAD_SECTION}.softmax_backend='triton') do not cap logits: use "
                                  "softmax_backend 'torch' or 'auto', or softcap 0")
        self.last_lse: Optional[torch.Tensor] = None  # this rank's rows' lse of the last forward (labels' shape)
        self.sampler_config = sampler_config
        if nonfinite not in ("skip", "raise"):
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.nonfinite: got {nonfinite!r}; allowed: 'skip', 'raise'")
        self.chunk_size, self.update, self.check_inputs = int(chunk_size), update, bool(check_inputs)
        if softmax_backend not in SOFTMAX_BACKENDS:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.softmax_backend: got {softmax_backend!r}; "
                                  f"allowed: {', '.join(map(repr, SOFTMAX_BACKENDS))}")
        self.softmax_backend = softmax_backend
        self.workspace = Workspace()  # the loss's logits scratch and the active rows, kept between steps when small
        if input_parallel not in INPUT_PARALLEL:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.input_parallel: got {input_parallel!r}; allowed: "
                                  f"{', '.join(map(repr, INPUT_PARALLEL))}")
        self.input_parallel = input_parallel
        self.nonfinite, self.nonfinite_inputs = nonfinite, 0  # policy; steps whose input was non-finite
        if int(check_interval) < 1:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.check_interval: got {check_interval}; must be >= 1")
        self.check_interval, self._calls = int(check_interval), 0  # full input check every N-th call
        self._unchecked_bad: Optional[torch.Tensor] = None  # () out-of-range labels of unchecked calls
        self.agreed_dtype: Optional[torch.dtype] = None  # the embeddings' dtype every rank passed at the last check
        self.seed = int(seed)
        self.weight = nn.Parameter(init_shard(self.num_classes, self.embedding_dim, self.class_start,
                                              self.num_local, init_std, seed, dtype, device))
        self.sampler = build_sampler(self.sampler_config, self.num_local, self.class_start, seed,
                                     self.replicas.sampler_rank(self.rank, self.world_size), self.weight.device)
        self.sampler.dense_updates = update == "dense"  # every row changes each step: re-encode all
        self.sampler.metric = "cosine" if self.loss_fn.normalised else "dot"  # what the logits rank by
        self.sampler.num_classes = self.num_classes  # ann: shards take their share of head-wide budgets
        self.last_active: Optional[ActiveSet] = None
        self.lazy_catch_up = None  # update lazy_exact: the optimizer's catch_up(rows or None)
        self.sampler.before_read = self._catch_up_rows  # the sampler's reads of the weights see current rows
        self.last_metrics: dict = {}
        self.options_fingerprint = options_fingerprint(self)  # agreed in the input check (ds_xc/head/checks.py)
        log.info("ClassParallelHead rank %d/%d: classes [%d, %d) of %d, d=%d, loss=%s %s, sampler=%s %s",
                 self.rank, self.world_size, self.class_start, self.class_start + self.num_local, self.num_classes,
                 self.embedding_dim, self.loss_fn.describe(), self.loss_options.describe(), self.sampler_config.type,
                 self.replicas.describe())

    @classmethod
    def from_config(cls, section, group=None, device=None, replica_group=None) -> "ClassParallelHead":
        """Build from the ``extreme_classification`` section (a plain dict or a HeadConfig)."""
        c = cfg.validate_section(cfg.HeadConfig, section, cfg.HEAD_SECTION)
        return cls(c.embedding_dim, c.num_classes, loss=c.loss, sampler=c.sampler, group=group,
                   chunk_size=c.chunk_size, dtype=c.dtype, init_std=c.init_std, seed=c.seed,
                   update=c.optimizer.update, check_inputs=c.check_inputs, nonfinite=c.nonfinite, device=device,
                   softmax_backend=c.softmax_backend, check_interval=c.check_interval,
                   input_parallel=c.input_parallel, replica_group=replica_group)

    def extra_repr(self) -> str:
        return (f"embedding_dim={self.embedding_dim}, num_classes={self.num_classes}, "
                f"shard=[{self.class_start}, {self.class_start + self.num_local}), rank={self.rank}/"
                f"{self.world_size}, sampler={self.sampler_config.type}, update={self.update}"
                + (", input_parallel=replicated" if self.input_parallel == "replicated" else ""))

    # ------------------------------------------------------------------ checks
    def check_batch(self, embeddings: Optional[torch.Tensor], labels: torch.Tensor,
                    batch_sizes: Optional[Sequence[int]] = None, num_rows: Optional[int] = None,
                    sample_weight: Optional[torch.Tensor] = None) -> Optional[Verdict]:
        """Validate this step's input on every rank and learn every rank's batch size.

        The first thing of a step, before any collective: :meth:`forward` and the overlap
        schedule (ds_xc.overlap) call it, then :meth:`flag_unchecked` on the step's loss.
        ``embeddings`` may be None with ``num_rows`` given (the overlap schedule's backbone
        mode, where the embeddings do not exist yet; their finiteness is checked later).

        Returns the step's :class:`Verdict` (every rank's row count, and whether the labels of
        this step were range-checked), or None when the step must be skipped (non-finite
        embeddings under ``nonfinite="skip"``, agreed by every rank).

        One (P, 9) int64 all-reduce carries each rank's [verdict, rows, first bad label
        position, that label, out-of-range labels of earlier unchecked steps, embedding dtype
        code, embedding width, batch_sizes fingerprint, options fingerprint]
        (ds_xc/head/checks.py), followed by
        one ``.tolist()`` (the step's only host sync of the check). It runs when a full check
        is due (``check_inputs`` and every ``check_interval``-th call: shapes, devices, label
        range, finiteness) or when ``batch_sizes`` is None (the sizes are needed to pad the
        gathers; the label-range test rides along, its cost is one compare over B labels).
        Otherwise (an unchecked step with ``batch_sizes`` given) nothing is exchanged: the
        sizes are trusted, and out-of-range labels are caught on the gathered labels by
        :meth:`flag_unchecked`. Every error is raised on every rank: the rank at fault names
        the label, position, shape or device; the others name that rank. The exchange also agrees
        on the embeddings' dtype and width (raising on every rank when they differ) and remembers
        the dtype in ``agreed_dtype``; an unchecked step whose rows come in another dtype casts
        them to it for the gather (logged), so bytes are never reinterpreted; the first call
        always exchanges (no dtype agreed yet). A forward without grad is always fully checked
        and does not advance the ``check_interval`` count.
        """
        rows = embeddings.shape[0] if embeddings is not None and embeddings.dim() > 0 else (num_rows or 0)
        training = torch.is_grad_enabled()  # a forward without grad (a validation loss) is always checked ...
        full = self.check_inputs and (self._calls % self.check_interval == 0 or not training)
        self._calls += int(training)  # ... and leaves the training steps' check cadence as it was
        error = batch_sizes_length_error(self, batch_sizes) or local_problem(self, embeddings, labels, rows,
                                                                               sample_weight)
        unknown = embeddings is not None and self.agreed_dtype is None  # the first call agrees on the dtype
        if not full and batch_sizes is not None and not unknown:  # trusted sizes: no collective, no sync
            if error is not None:  # the others wait in this step's gathers (an unchecked step: nothing exchanged)
                error.add_note(f"an unchecked step ({cfg.HEAD_SECTION}.check_interval={self.check_interval}): "
                               "nothing was exchanged, the other ranks wait in this step's all-gather of the rows")
                raise error
            if int(batch_sizes[self.rank]) != rows:
                raise ValueError(f"batch_sizes {list(batch_sizes)} gives rank {self.rank} {batch_sizes[self.rank]} "
                                 f"rows, it passed {rows}")
            return self._replicated_sizes(Verdict([int(b) for b in batch_sizes], labels_checked=False))
        table = torch.zeros((self.world_size, TABLE_COLS), dtype=torch.int64, device=self.weight.device)
        table[self.rank, 1].fill_(rows)  # a kernel argument, not host data copied up
        fill_layout(table[self.rank], embeddings, batch_sizes, self.options_fingerprint)
        ranged = full or batch_sizes is None  # else the first call's exchange, for the dtype only
        if error is not None:
            table[self.rank, 0].fill_(BAD_INPUT)
        elif ranged:
            fill_verdict(self, table[self.rank], embeddings if full else None, labels)
        if self._unchecked_bad is not None:
            table[self.rank, 4].copy_(self._unchecked_bad)
        if is_distributed(self.group):  # every rank learns of bad input: nobody hangs in a collective
            dist.all_reduce(table, op=dist.ReduceOp.SUM, group=self.group)
        rows_of = table.tolist()  # the one host sync of the check
        if self._unchecked_bad is not None:
            self._unchecked_bad.zero_()  # counted: a fresh count (in place: a captured step adds to this tensor)
        verdict = decide(self, rows_of, error, batch_sizes, full)
        if verdict is not None and not ranged:
            verdict.labels_checked = False  # flag_unchecked tests them on the gathered labels
        return self._replicated_sizes(verdict)

    def _replicated_sizes(self, verdict: Optional[Verdict]) -> Optional[Verdict]:
        """With ``input_parallel="replicated"`` every rank must pass the same number of rows (the
        sizes are the same list on every rank, so every rank raises alike)."""
        if verdict is not None and self.input_parallel == "replicated" and len(set(verdict.sizes)) > 1:
            raise ValueError(f"{cfg.HEAD_SECTION}.input_parallel='replicated': every rank of the head's group must "
                             f"pass the same rows, got row counts {verdict.sizes} (this is rank {self.rank}); use "
                             "input_parallel='data' for per-rank batches")
        return verdict

    def flag_unchecked(self, loss: torch.Tensor, y: torch.Tensor, verdict: Verdict) -> torch.Tensor:
        """An unchecked step (no exchange) never trains silently on out-of-range labels: they are
        found on the gathered labels ``y`` (N,), the same on every rank, so no collective and no
        sync is needed; the loss becomes NaN on every rank (XCEngine then skips or raises, see
        ``nonfinite``) and the count is raised on every rank at the next check."""
        if verdict.labels_checked or y.numel() == 0:
            return loss
        bad = (((y < 0) | (y >= self.num_classes)) & (y != self.loss_options.ignore_index)).sum()  # ()
        if self._unchecked_bad is None or self._unchecked_bad.device != bad.device:
            self._unchecked_bad = torch.zeros((), dtype=torch.int64, device=bad.device)
        self._unchecked_bad.add_(bad)  # in place: the count of a captured step's replays adds up too
        return loss + torch.where(bad > 0, float("nan"), 0.0).to(loss.dtype)

    def active_rows(self) -> Optional[torch.Tensor]:
        """The last step's active rows (K,), sorted and distinct, when one gather made the weight's
        gradient (one sample group; None otherwise): the head optimizer uses such a gradient as it is."""
        active = self.last_active
        if active is None or active.bounds is not None or not isinstance(active.index, torch.Tensor):
            return None
        return active.index

    # ------------------------------------------------------------------ captured steps (ds_xc/head/graphs.py)
    def host_work_due(self) -> bool:
        """Whether the next training forward does host work a replayed CUDA graph cannot: a full input
        check (one host sync), the sampler's index or graph upkeep, a quality-metrics pass."""
        check = self.check_inputs and self._calls % self.check_interval == 0
        every = getattr(self.sampler_config, "metrics_interval", 0)  # measure_sampler: after the sampler counts
        metrics = bool(every) and (getattr(self.sampler, "steps", 0) + 1) % every == 0
        return check or metrics or self.sampler.host_work_due()

    def after_replay(self) -> None:
        """The host side of a replayed training forward: the counters an eager forward advances."""
        self._calls += 1
        self.sampler.after_replay()

    # ------------------------------------------------------------------ forward
    def gather(self, embeddings: torch.Tensor, labels: torch.Tensor,
               batch_sizes: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather embeddings (differentiable) and labels: (B, d), (B,) -> (N, d), (N,); with
        ``input_parallel="replicated"`` the rows as they are (N = B), their gradient all-reduced.

        ``batch_sizes``: every rank's B (None: all equal to this rank's). The embedding
        gradient is scaled by P: each rank receives P * d(global mean)/d(its rows), so that
        the data-parallel average of the backbone gradients is the global mean's gradient and
        every sample weighs the same whatever its rank's batch size (equal batches: the
        gradient of the local mean, as before).
        """
        dp = self.replicas.size  # 2-D: the data-parallel ranks are the class group times the replicas
        embeddings = self.agreed_rows(embeddings)
        if self.input_parallel == "replicated":  # the rows are the global batch already: (B, d), (B,)
            return replicated_rows(scale_grad(embeddings, float(dp)), self.group), labels.to(torch.int64)
        sizes = None if batch_sizes is None or len(set(batch_sizes)) <= 1 else list(batch_sizes)
        if self.node_gather is not None:  # two rank-aligned stages across nodes (ds_xc/parallel/node_gather.py)
            x = node_gather_rows(embeddings, self.node_gather, sizes, grad_scale=float(self.world_size * dp))
            return x, self.node_gather.gather(labels.to(torch.int64), sizes)
        x = all_gather_rows(embeddings, self.group, sizes, grad_scale=float(self.world_size * dp))
        y = all_gather_no_grad(labels.to(torch.int64), self.group, sizes)
        return x, y

    def agreed_rows(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``embeddings`` in the dtype every rank agreed on, for a gather: as they are when they match; cast
        (logged once) when an unchecked step brings another dtype (no bytes reinterpreted, no sync); agreed
        now, raising on every rank when the ranks differ (one small all-gather, once), when no check saw rows
        yet (the overlap schedule's backbone mode, whose check runs before the rows exist)."""
        if self.agreed_dtype is None:
            agree(str(embeddings.dtype), "embeddings.dtype (allowed: one floating-point dtype on every rank)",
                  self.group)
            self.agreed_dtype = embeddings.dtype
        if embeddings.dtype == self.agreed_dtype:
            return embeddings
        log_once(log, logging.WARNING, f"rank {self.rank}: embeddings of dtype {embeddings.dtype} in a step without "
                 f"a check, the ranks agreed on {self.agreed_dtype} at the last one: they are cast to "
                 f"{self.agreed_dtype} for the gather (no bytes reinterpreted); the next check agrees anew")
        return embeddings.to(self.agreed_dtype)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, sample_weight: Optional[torch.Tensor] = None,
                batch_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The loss of the global batch (the same on every rank; ``reduction`` none: this rank's rows').

        embeddings (B, d) and labels (B,), or sequences (B, T, d) and (B, T), are this rank's share
        of the global batch; B may differ between ranks and may be 0. ``sample_weight`` (labels'
        shape, floating point; None: 1): each row's weight, the mean becoming sum_i v_i row_i /
        sum_i v_i over the global batch (v_i = 0 where the label is ``ignore_index``); no gradient
        flows into it. ``reduction`` (the loss option): "mean", "sum", or "none" (v_i row_i of this
        rank's rows, the labels' shape; backward then runs a second pass over the rows, with the
        upstream gradient of every rank's rows as their weights). A batch whose rows are all ignored
        returns NaN under "mean", as torch, with exact-zero gradients (XCEngine skips such a step); an
        empty global batch (no rows anywhere) returns 0. ``batch_sizes``
        lists every rank's B (rows; for sequences B T); None has them exchanged in the input check's
        all-reduce. When given, they are checked against the exchanged ones in checked steps and trusted
        (no sync) in unchecked ones (a non-tensor third argument is taken as ``batch_sizes``, the
        argument's earlier place). After the call ``last_lse`` holds every row's lse.

        Under ``torch.no_grad()`` or ``torch.inference_mode()`` (a validation loss) the loss is
        the exact one over every class, whatever the sampler, and the forward leaves the training
        state alone: no sampler step (counters, random streams, index upkeep), no check-interval
        count, and no tensor made in inference mode is kept (it runs with inference mode off, so
        later training steps can use the workspace). With update lazy_exact the shard is caught up
        first (every row read current; the trajectory of the training steps is unchanged).
        A step where every rank has 0 rows (N = 0 over the whole 2-D batch) is a no-op: no
        sampler step, no check-interval count, and a zero loss with no path to the weight (its
        ``.grad`` stays None, so the head optimizers, like torch's, neither step nor decay it).
        """
        if sample_weight is not None and not isinstance(sample_weight, torch.Tensor):
            sample_weight, batch_sizes = None, sample_weight  # the earlier signature forward(x, y, batch_sizes)
        shape = labels.shape
        embeddings, labels, sample_weight = self._flatten(embeddings, labels, sample_weight)
        if not torch.is_grad_enabled():
            with torch.inference_mode(False), torch.no_grad():  # normal tensors only: nothing cached is poisoned
                return self._forward(embeddings, labels, sample_weight, batch_sizes, shape, training=False)
        return self._forward(embeddings, labels, sample_weight, batch_sizes, shape, training=True)

    def _forward(self, embeddings: torch.Tensor, labels: torch.Tensor, sample_weight: Optional[torch.Tensor],
                 batch_sizes, shape: torch.Size, training: bool) -> torch.Tensor:
        try:
            verdict = self.check_batch(embeddings, labels, batch_sizes, sample_weight=sample_weight)
        except Exception:
            self.replicas.agree_rows(None, failed=True, device=self.weight.device)  # other class groups raise too
            raise
        rows = None if verdict is None else (verdict.sizes[0] if self.input_parallel == "replicated"
                                             else sum(verdict.sizes))
        total_rows = self.replicas.agree_rows(rows, device=self.weight.device)  # N of the 2-D global batch
        if total_rows is None:  # non-finite input, nonfinite="skip": agreed by every rank (and replica)
            return torch.full(shape if self.loss_options.reduction == "none" else (), float("nan"),
                              device=embeddings.device)
        if total_rows == 0:  # every rank empty: agreed (the sizes are the same list on every rank)
            return self._empty_step(embeddings, training, shape)
        x, y = self.gather(embeddings, labels, verdict.sizes)  # (N, d), (N,)
        opts = self.loss_options
        terms = self._row_terms(x, y, sample_weight, verdict.sizes)
        y_active = opts.positives(y)  # ignored rows: nobody's positives
        if training:
            active = self.sampler.sample(y_active, x.detach() if self.sampler.needs_embeddings else None,
                                         self.weight)
            self.last_active = active
            self.measure_sampler(x, active)
        else:  # every class: the exact loss, no sampler state touched
            self.catch_up()
            local, mine = local_targets(y_active, self.class_start, self.num_local)
            active = ActiveSet(index=None, targets=torch.where(mine, local, torch.full_like(local, -1)))
        n = x.shape[0]
        per_row = opts.reduction == "none"
        parts = []
        for rows, index in active.groups():  # one group unless the sampler splits the batch
            if self.lazy_catch_up is not None and training:  # lazy_exact: the rows this step reads, up to date
                self.lazy_catch_up(index, active=True)
            if index is None:
                w = self.weight  # (L, d)
            else:  # (K, d); a row-sparse gradient for lazy updates
                w = gather_rows(self.weight, index, self.update != "dense", self.workspace, distinct=True)
            parts.append(sharded_margin_loss(
                x[rows], w, active.targets[rows], self.loss_fn, self.group, self.chunk_size, self.softmax_backend,
                self.workspace, terms.slice(rows.start or 0, rows.stop if rows.stop is not None else n),
                "none" if per_row else "sum", sum_grad_rows=self.input_parallel == "data"))
        self.last_lse = self.own_rows(terms.lse_out, verdict.sizes).reshape(shape)
        if per_row:  # (N,) -> this rank's rows, the labels' shape
            out = self.own_rows(torch.cat(parts) if len(parts) > 1 else parts[0], verdict.sizes).reshape(shape)
            return self.flag_unchecked(out, y, verdict)
        total = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
        total = self.flag_unchecked(total, y, verdict)
        weight_sum = terms.weight.sum()
        if opts.reduction == "sum":
            return self.replicas.global_sum(total)
        if self.replicas.active:
            return self.replicas.global_mean(total, weight_sum)
        return mean_of(total, weight_sum)

    def _flatten(self, embeddings, labels, sample_weight):
        """Sequences (B, T, d) / (B, T) -> rows (B T, d) / (B T,); a shape that does not match is left for the
        input check (which raises on every rank)."""
        if embeddings.dim() == 3 and labels.dim() == 2 and tuple(embeddings.shape[:2]) == tuple(labels.shape):
            embeddings, labels = embeddings.reshape(-1, embeddings.shape[-1]), labels.reshape(-1)  # (B T, d), (B T,)
            if sample_weight is not None and sample_weight.dim() == 2:
                sample_weight = sample_weight.reshape(-1)
        return embeddings, labels, sample_weight

    def _row_terms(self, x, y, sample_weight, sizes) -> RowTerms:
        """The rows' weights v (N,) (sample weights, all-gathered; 0 where ignored) and the loss options."""
        sd = stat_dtype(self.weight.dtype)
        sw = None
        if sample_weight is not None:
            sw = sample_weight.detach().to(sd)
            if self.input_parallel != "replicated":  # (N,), in the rows' rank order
                uneven = sizes if len(set(sizes)) > 1 else None
                sw = all_gather_no_grad(sw, self.group, uneven) if self.node_gather is None \
                    else self.node_gather.gather(sw, uneven)
        lse = torch.empty(x.shape[0], dtype=sd, device=x.device)  # (N,)
        return self.loss_options.row_terms(y, self.num_classes, sd, sw, lse_out=lse)

    def own_rows(self, t: torch.Tensor, sizes) -> torch.Tensor:
        """This rank's rows of a gathered (N,) tensor (all of them with replicated input); detached for lse."""
        if self.input_parallel == "replicated":
            return t
        start = sum(sizes[: self.rank])
        return t[start: start + sizes[self.rank]]

    def empty_step(self, training: bool = True) -> None:
        """Book a step where every rank had 0 rows (agreed by the input check) as not made: the check_interval
        count goes back, nothing else of the head's state moved; logged at debug level. The callers (forward,
        the overlap schedule) then skip the sampler and the weight gradient."""
        self._calls -= int(training)
        log.debug("rank %d: every rank passed 0 rows; the head's step is a no-op (no sampler step, no weight "
                  "gradient)", self.rank)

    def _empty_step(self, embeddings: torch.Tensor, training: bool, shape: torch.Size) -> torch.Tensor:
        """The loss of a step where every rank has 0 rows: 0 (reduction none: zeros of the labels'
        shape), in the loss's dtype, differentiable (through the empty embeddings when they need a
        gradient) but with no path to the weight; the call is not counted (as if it was not made)."""
        self.empty_step(training)
        dtype = stat_dtype(self.weight.dtype)
        zero = torch.zeros(shape if self.loss_options.reduction == "none" else (),  # none: this rank's (empty) rows
                           dtype=dtype, device=self.weight.device)
        if training and embeddings.requires_grad:
            return zero + embeddings.sum().to(dtype) * 0.0  # (0, d): a zero gradient for the backbone
        return zero.requires_grad_(training)

    # ------------------------------------------------------------------ sampler upkeep and metrics
    def rebuild_index(self) -> None:
        """Rebuild the sampler's index (ANN) or graph (kNN) from the current weights now."""
        if hasattr(self.sampler, "rebuild"):
            self.catch_up()
            with torch.inference_mode(False), torch.no_grad():  # an index made of inference tensors breaks training
                self.sampler.rebuild(self.weight)

    def catch_up(self) -> None:
        """With update lazy_exact: bring every row of the shard up to date (a no-op otherwise).
        Call before anything reads the whole shard; topk, rebuild_index, the sampler's rebuilds and
        dense re-encodes, the quality metrics and state_dict do."""
        if self.lazy_catch_up is not None:
            with torch.inference_mode(False), torch.no_grad():  # any caller's mode: the state stays normal tensors
                self.lazy_catch_up(None)

    def _catch_up_rows(self, rows: Optional[torch.Tensor]) -> None:
        """The sampler's ``before_read``: local rows (R,) (None: all) up to date before it reads them."""
        if self.lazy_catch_up is not None:
            self.lazy_catch_up(rows)

    def sampler_stats(self) -> dict:
        """Active-set counts of the last step (active, positives, retrieved, kept, cut, fill,
        staleness) and the last quality metrics, for logging."""
        return dict(getattr(self.sampler, "last_stats", {}), **self.last_metrics)

    def measure_sampler(self, x: torch.Tensor, active: ActiveSet) -> None:
        """Every ``metrics_interval``-th training step: the quality of the active set (recall of the
        exact top classes, ...) for the gathered batch ``x`` (N, d), into ``last_metrics``; collective
        over the head's group, so every rank calls it at the same steps (forward and the overlap
        schedule do)."""
        every = getattr(self.sampler_config, "metrics_interval", 0)
        steps = getattr(self.sampler, "steps", 0)
        if not every or not torch.is_grad_enabled() or steps % every:
            return
        from ds_xc.sampling.metrics import active_set_quality
        self.catch_up()  # the exact pass reads every row
        self.last_metrics = active_set_quality(
            x, self.weight, self.class_start, active, self.loss_fn.normalised, self.loss_fn.scale,
            getattr(self.sampler, "last_retrieved", None), group=self.group)
        log.info("sampler quality at step %d: %s", steps, self.last_metrics)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def topk(self, embeddings: torch.Tensor, k: int = 5, batch_sizes: Optional[Sequence[int]] = None,
             chunk_size: Optional[int] = None) -> torch.Tensor:
        """Global class ids of the k best classes over ALL classes for this rank's rows: (B, k).

        Class-parallel: every rank scores the gathered batch against its shard (cosine for
        margin losses, x.w for softmax), in row chunks, and the per-shard top-k are merged.
        Every rank of the group must call it with its own batch (B may differ, and be 0; when
        every rank has 0 rows the result is an empty (0, k) on every rank, nothing gathered).
        k is capped at num_classes; a shard with fewer than k classes pads its candidates
        with (-inf, -1), so every rank sends the same (N, k) block. The ranks first agree (one
        small all-gather, ds_xc/head/checks.py ``agree_topk``) on k, the embeddings' dtype and
        width, and their row counts (``batch_sizes``, if given, is checked against them): any
        difference or bad input raises on every rank. A row holding NaN or Inf gets ids -1 in
        all k places (no class is ranked for it; logged as a warning naming the ranks).
        Runs with inference mode off (under no_grad): the lazy_exact catch-up it triggers keeps
        no inference tensor in the optimizer's state, whatever mode the caller is in.
        """
        with torch.inference_mode(False), torch.no_grad():
            return self._topk(embeddings, k, batch_sizes, chunk_size)

    def _topk(self, embeddings: torch.Tensor, k: int, batch_sizes, chunk_size) -> torch.Tensor:
        sizes, nonfinite = agree_topk(self, embeddings, k, batch_sizes)
        k = min(int(k), self.num_classes)
        replicated = self.input_parallel == "replicated"
        if replicated:
            self._replicated_sizes(Verdict(sizes, labels_checked=False))
        if sum(sizes) == 0:  # every rank empty (agreed): nothing to gather or rank
            return torch.empty((0, k), dtype=torch.int64, device=embeddings.device)
        if any(nonfinite):
            log.warning("topk: rank(s) %s passed rows holding NaN or Inf (%s rows); their ids are -1 (rank %d)",
                        [r for r, c in enumerate(nonfinite) if c], [c for c in nonfinite if c], self.rank)
        uneven = sizes if len(set(sizes)) > 1 else None
        self.catch_up()
        x = embeddings if replicated else all_gather_no_grad(embeddings, self.group, uneven)
        x = x.to(self.weight.dtype)  # (N, d); replicated: N = B
        w = self.weight
        if self.loss_fn.normalised:
            w = F.normalize(w.float(), dim=1).to(w.dtype)
            x = F.normalize(x.float(), dim=1).to(w.dtype)
        n = x.shape[0]
        step = max(chunk_size or self.chunk_size or n, 1)
        kl = min(k, self.num_local)
        vals = torch.full((n, k), float("-inf"), dtype=torch.float32, device=x.device)  # (N, k), padded
        ids = torch.full((n, k), -1, dtype=torch.int64, device=x.device)
        for a in range(0, n if kl else 0, step):
            v, i = shard_topk(x[a: a + step], w, kl)  # (n, kl)
            vals[a: a + step, :kl], ids[a: a + step, :kl] = v, i + self.class_start
        ids = merge_topk(vals, ids, k, self.group)  # (N, k); k <= C real candidates: never a pad
        if any(nonfinite):  # the rows' scores are NaN: no class is ranked for them
            ids = ids.masked_fill(~torch.isfinite(x).all(dim=1, keepdim=True), -1)
        if replicated:
            return ids
        start = sum(sizes[: self.rank])
        return ids[start: start + sizes[self.rank]]

    # ------------------------------------------------------------------ state
    def get_extra_state(self) -> dict:
        return {"num_classes": self.num_classes, "class_start": self.class_start,
                "num_local": self.num_local, "world_size": self.world_size, "rank": self.rank,
                "embedding_dim": self.embedding_dim, "sampler": self.sampler.state_dict(),
                "weight_checksum": _checksum(self.weight)}

    def set_extra_state(self, state: dict) -> None:
        mine = (self.num_classes, self.class_start, self.num_local, self.embedding_dim)
        theirs = (state["num_classes"], state["class_start"], state["num_local"], state["embedding_dim"])
        if mine != theirs:
            raise RuntimeError(
                f"head shard mismatch on rank {self.rank}: the checkpoint holds classes "
                f"[{theirs[1]}, {theirs[1] + theirs[2]}) of {theirs[0]} (d={theirs[3]}, world size "
                f"{state['world_size']}), this head expects [{mine[1]}, {mine[1] + mine[2]}) of {mine[0]} "
                f"(d={mine[3]}, world size {self.world_size}); reshard the checkpoint to this world size")
        self.sampler.load_state_dict(state["sampler"])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.catch_up()  # lazy_exact: the saved rows (and the checksum of the extra state) are current
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.catch_up()  # lazy_exact: no stale row left to be caught up over the loaded weights
        # check the shard's identity before torch reports a bare size mismatch of the weight
        extra = state_dict.get(prefix + "_extra_state")
        if isinstance(extra, dict):
            self.set_extra_state(extra)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # an index saved with other weights than the ones now loaded is never used silently
        if isinstance(extra, dict) and hasattr(self.sampler, "invalidate"):
            if extra.get("weight_checksum") != _checksum(self.weight):
                log.info("rank %d: loaded weights differ from the ones the saved index describes; "
                         "the index is rebuilt at the next forward", self.rank)
                self.sampler.invalidate()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.sampler.to(self.weight.device)
        self.options_fingerprint = options_fingerprint(self)  # head.double() and the like change the dtype
        return out
