"""CompressedOptimizer: a torch optimizer wrapper that reduces gradients compressed.

``step()`` first replaces each parameter's local gradient by the mean over the
data-parallel group, computed from a compressed exchange, then steps the wrapped
optimizer. Per step, for the compressed parameters (numel >= ``min_numel``), viewed
as one flat fp32 bucket:

    x = local gradient                (with a hierarchy: node mean of this rank's slice)
    u = m u + x; v = e + u            (DGC momentum correction, m: Adam's beta1 or SGD's momentum by default,
                                       which then steps the reduced tensors without it; momentum.py)
    v = e + x                         (plain error feedback; v = x without it)
    S = compressor.select(score(v))   (per tensor; score: v, or v / sqrt(Adam's v-hat), see score.py;
                                       bayes_prior syncs the score's statistics first)
    mean over ranks of v[S]           (sparse all-gather, or a values all-reduce for random-k)
    e = v - sent; u[S] = 0            (what was not sent waits for the next step)

``method: powersgd`` replaces the selection and exchange by a low-rank approximation
per tensor (ds_xc/compression/powersgd.py: M = e + x, P = M Q and Q = M^T P all-reduced,
e = M - P Q^T). Small tensors, the first ``warmup_steps`` steps and ``method: none`` use a dense
all-reduce. Every rank rebuilds the mean from the same gathered data in the same
order, so replicas stay bit-identical. The residuals, momentum, thresholds and the
step counter (which seeds all random draws) live in ``self.state`` and round-trip
through ``state_dict()`` (ds_xc/compression/state.py). ``param_groups`` is the wrapped
optimizer's list, so LR schedulers and DeepSpeed's ``get_lr`` see the real learning rates.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.distributed as dist

from ds_xc.compression.compressors import allocate_densities, build_compressor
from ds_xc.compression.config import (ADAM_WARMUP_STEPS, COMPRESSION_SECTION, ConfigError, GradientCompressionConfig,
                                     parse_compression)
from ds_xc.compression.exact import exact_mean_
from ds_xc.compression.frozen_adam import frozen_variance_step, unsupported_reason
from ds_xc.compression.layout import gather_flat, plan_layout, scatter_flat
from ds_xc.compression.momentum import MomentumCorrection
from ds_xc.compression.pays import StepCheck, check_config, exchange
from ds_xc.compression.powersgd import LowRankSteps
from ds_xc.compression.score import build_update_score
from ds_xc.compression.seeds import mix_seed, seeded_generator
from ds_xc.compression.state import CompressionState
from ds_xc.compression.steps import ReductionSteps
from ds_xc.compression.transport import (DTYPES, NodeGroups, WireCounter, all_gather_slices,
                                         build_node_groups, dense_allreduce_mean_, reduce_scatter_sum,
                                         sparse_allgather_mean, values_allreduce_mean)
from ds_xc.parallel.collectives import allreduce_bytes
from ds_xc.parallel.groups import group_rank, group_size, is_distributed, resolve_group

log = logging.getLogger(__name__)

__all__ = ["CompressedOptimizer"]

_RESYNC = 1.5  # bayes_prior: a global density off by this factor triggers a statistics sync


class CompressedOptimizer(CompressionState, ReductionSteps, LowRankSteps, torch.optim.Optimizer):
    """Wraps ``optimizer`` (replicated over ``group``): compressed gradient mean, then its step.

    Args:
        optimizer: any torch optimizer; its parameters must be identical on every rank.
        config: the ``gradient_compression`` section (dict or GradientCompressionConfig).
        group: the data-parallel process group (a ProcessGroup or 1-D DeviceMesh; None: the world).
        seed_rank: this rank's index in the random streams of the compressors (default: its rank
            in ``group``), so that the draws depend on the rank within the group, not in the world.
        params: the tensors whose gradients are reduced (default: the optimizer's). Inside
            DeepSpeed these are the engine module's parameters, which the bf16 wrapper's
            fp32 master copies take their gradients from.
        node_groups: explicit node groups for ``hierarchy`` (default: built from
            ``hierarchy.ranks_per_node``, a collective call).
        rank_state_in_state_dict: include the per-rank state (residuals, thresholds) in
            ``state_dict()``. DeepSpeed saves the optimizer state of rank 0 only, so its
            integration turns this off and saves it per rank (compression/checkpoint.py).
        steps_optimizer: whether ``step()`` is how the wrapped optimizer steps (False: the DDP hook,
            which only reduces); only then can ``adam_variance`` freeze an Adam's variance.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config=None, group=None, *, params=None,
                 node_groups: Optional[NodeGroups] = None, rank_state_in_state_dict: bool = True,
                 seed_rank: Optional[int] = None, steps_optimizer: bool = True):
        self.__dict__["_ready"] = False
        cfg: GradientCompressionConfig = parse_compression(config if config is not None else {})
        params = params if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
        seen, unique = set(), []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        if not unique:
            raise ValueError("CompressedOptimizer: no parameters with requires_grad=True to reduce")
        super().__init__([{"params": unique}], {})
        self._params: list[torch.Tensor] = self.param_groups[0]["params"]
        self.inner, self.param_groups = optimizer, optimizer.param_groups
        self.defaults = getattr(optimizer, "defaults", {})  # DeepSpeed's bf16 wrapper has none
        group = resolve_group(group)  # None: the world, named explicitly
        self.config, self.group = cfg, group
        self.world_size = group_size(group)
        self.rank_state_in_state_dict = rank_state_in_state_dict
        self._seed_rank = group_rank(group) if seed_rank is None else int(seed_rank)
        self.nodes = node_groups
        if self.nodes is None and cfg.hierarchy.ranks_per_node > 1 and cfg.enabled:
            self.nodes = build_node_groups(cfg.hierarchy.ranks_per_node, group)
        self.comm_group = self.nodes.inter if self.nodes is not None else group
        self.compressor = build_compressor(cfg) if cfg.enabled else None
        if self.nodes is not None and cfg.method == "powersgd":
            raise ConfigError(f"{COMPRESSION_SECTION}.method='powersgd' with node_groups (a hierarchy of "
                              f"{self.nodes.local_size} ranks per node): not supported; allowed: node_groups=None")
        local = (self.nodes.local_rank, self.nodes.local_size) if self.nodes is not None else (0, 1)
        self.layout = plan_layout(self._params, cfg.min_numel, cfg.enabled, *local,
                                  per_tensor=cfg.granularity == "tensor",
                                  min_dim=self.compressor.min_dim if self.compressor is not None else 1)
        self._update_score = build_update_score(cfg, optimizer, self._params, self.layout, self.state, group)
        self.momentum_correction = MomentumCorrection(  # the velocity u, and who applies the momentum
            cfg.momentum_correction, optimizer, [self._params[i] for i in self.layout.sparse], self._params,
            self.compressor is not None and cfg.error_feedback and not self.compressor.low_rank)
        if not steps_optimizer:  # the user's loop steps the optimizer (the DDP hook): its step hooks
            self.momentum_correction.hook_into(lambda: bool(self._last.get("compressed")))
        self._value_dtype = DTYPES[cfg.value_dtype]
        self._buffers = self._make_buffers()
        self._work: dict = {}  # reused scratch buffers (see _scratch)
        self.counter = WireCounter()
        self._step = 0
        self._resync = False  # set when the global density strayed: sync statistics next step
        self._nnz: dict = {}  # allocation nonzero: this step's nonzero count per compressed tensor (0-dim)
        self._reduced_by_hooks = False  # an overlapped reducer did this step's reduction
        self._tally = dict(compressed_steps=0, sent=0, offered=0, global_sent=0, global_offered=0, dense_bytes=0)
        self._last: dict = {}
        self._skip_next = False  # skip_reduction(): this step's optimizer step is the engine's no-op
        self.frozen_variance = steps_optimizer and self._resolve_adam_variance(cfg, optimizer)
        self.warmup_steps = (cfg.warmup_steps if cfg.warmup_steps is not None
                             else ADAM_WARMUP_STEPS if self.frozen_variance else 0)  # dense steps first
        self._frozen_cache: dict = {}  # frozen_adam's denominators (derived, never saved)
        numel_bytes = sum(p.numel() * p.element_size() for p in self._params)
        self._dense_step_bytes = allreduce_bytes(numel_bytes, self.world_size)
        self.__dict__["_ready"] = True
        log.info("CompressedOptimizer: method=%s density=%g ranked by %s, %d of %d tensors compressed (%d elements), "
                 "%d ranks%s", cfg.method, cfg.density, "update" if self._update_score is not None else "magnitude",
                 len(self.layout.sparse), len(self._params),
                 self.layout.numel, self.world_size,
                 f", {self.nodes.num_nodes} nodes x {self.nodes.local_size}" if self.nodes is not None else "")
        if cfg.method == "bayes_prior" and cfg.prior.form == "dirichlet" and cfg.prior.strength == 0.0:
            log.warning("%s.prior.form='dirichlet' with prior.strength=0.0 (preset 'tuned''s default): no budget is "
                        "spent on exploration, so the form changes nothing; set prior.strength in (0, 1) (e.g. 0.1, "
                        "or preset 'paper') to explore", COMPRESSION_SECTION)  # not an error: each value is valid alone
        where = exchange(optimizer, group)  # ZeRO-1's parameter all-gather and the backend, in both checks
        self.pays_verdict = check_config(cfg, self.layout.numel, self.world_size, self.nodes is not None, **where)
        self.step_check = StepCheck(cfg, [self._params[i] for i in self.layout.sparse], self.world_size,  # the step
                                    self.warmup_steps + cfg.density_warmup_steps, self.nodes is not None, **where)

    @staticmethod
    def _resolve_adam_variance(cfg: GradientCompressionConfig, optimizer) -> bool:
        """Whether the wrapper takes the optimizer's compressed steps with a frozen second moment."""
        why = unsupported_reason(optimizer)
        if cfg.adam_variance == "frozen" and why is not None:
            raise ConfigError(f"{COMPRESSION_SECTION}.adam_variance='frozen': {why}; allowed: 'frozen' with a "
                              "torch.optim.Adam or AdamW (no amsgrad, no maximize), else 'auto' or 'live'")
        if cfg.adam_variance != "auto":
            return cfg.adam_variance == "frozen"
        on = (why is None and cfg.warmup_steps != 0 and cfg.error_feedback and cfg.method not in ("none", "powersgd"))
        log.info("CompressedOptimizer: adam_variance auto -> %s", "frozen after the warm-up" if on else
                 f"live ({why or 'no warm-up, no error feedback or not an element-selecting method'})")
        return on

    # ------------------------------------------------------------------ plumbing
    def __getattr__(self, name):
        """Attributes the wrapper lacks come from the wrapped optimizer (DeepSpeed reads a few)."""
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return (f"CompressedOptimizer(method={self.config.method}, density={self.config.density}, "
                f"inner={type(self.inner).__name__})")

    def add_param_group(self, param_group: dict) -> None:
        if not self.__dict__.get("_ready"):  # torch.optim.Optimizer.__init__ registering our tensors
            return super().add_param_group(param_group)
        raise RuntimeError("CompressedOptimizer: add parameter groups before wrapping (the compressed "
                           "bucket is laid out once)")

    def _make_buffers(self) -> dict:
        """Flat fp32 residual (and momentum) over the padded bucket; per-parameter views go in state."""
        cfg, lay = self.config, self.layout
        names = []
        if self.compressor is not None and cfg.error_feedback:
            names.append("residual")
            if self.momentum_correction.enabled:
                names.append("momentum")
        buffers = {}
        device = self._params[0].device
        for name in names:
            buf = torch.zeros(lay.padded, dtype=torch.float32, device=device)
            for i, start in zip(lay.sparse, lay.starts):
                p = self._params[i]
                self.state[p][name] = buf[start: start + p.numel()].view_as(p)
            buffers[name] = buf
        return buffers

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        """Reduce the gradients (compressed mean over the group), then step the wrapped optimizer.

        When an overlapped reducer (:meth:`overlapped_reducer`) already reduced this step's
        gradients from backward hooks, only the wrapped optimizer steps."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skipped, self._skip_next = self._skip_next, False
        if self._reduced_by_hooks:
            self._reduced_by_hooks = False
        else:
            self.reduce_gradients()
        compressed = bool(self._last.get("compressed"))
        with self.momentum_correction.first_moment_off(compressed):  # the velocity u is the momentum
            if self.frozen_variance and compressed and not skipped:
                frozen_variance_step(self.inner, self._frozen_cache)  # Adam with v-hat fixed after the warm-up
            else:
                self.inner.step()  # (a skipped step: the engine made it a no-op)
        return loss

    def overlapped_reducer(self, timeline=None, bucket_bytes: int = 4 << 20, comm_group=None):
        """A reducer that runs this wrapper's compressed reduction in buckets from backward hooks
        (ds_xc.overlap); its ``finish()`` leaves the same gradients and state as ``reduce_gradients()``."""
        from ds_xc.compression.overlapped import OverlappedCompressedReducer
        return OverlappedCompressedReducer(self, timeline=timeline, bucket_bytes=bucket_bytes, comm_group=comm_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Replace every parameter's gradient by its (compressed) mean over the group, in place."""
        grads = []
        for p in self._params:
            if p.grad is None:  # every rank must take part in every collective
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        before = self.begin_reduction()
        if not self.compresses_this_step():  # the exact mean: nonzeros as pairs where that moves fewer bytes
            lay = self.layout
            if self.compressor is not None and self.nodes is None:
                exact_mean_(grads, lay.sparse, lay.starts, lay.padded, self.group, self.counter, self._scratch)
            else:
                dense_allreduce_mean_(grads, self.group, self.counter)
            return self.close_step(before)
        dense_allreduce_mean_([grads[i] for i in self.layout.dense], self.group, self.counter)
        reduce = self._reduce_low_rank if self.compressor.low_rank else self._reduce_bucket  # powersgd.py
        self.close_step(before, reduce(grads) if self.layout.numel else None)

    def _reduce_bucket(self, grads: list[torch.Tensor]) -> tuple:
        """The compressed exchange of the flat bucket; returns (sent, global_sent, comm) for close_step."""
        lay = self.layout
        flat = gather_flat(grads, lay.sparse, lay.starts,
                           self._scratch("flat", lay.padded, grads[0].device))  # (n_pad,), padding stays zero
        if self.nodes is not None:  # dense inside the node: node mean of this rank's slice (s,)
            x = reduce_scatter_sum(flat, self.nodes, self.counter).div_(self.nodes.local_size)
        else:
            x = flat
        idx, vals = self.select_region(x, sync_stats=self.stats_sync_due())  # (m,), (m,)
        comm_size = group_size(self.comm_group)
        if self.compressor.shared_indices:
            reduced = torch.zeros_like(x)
            reduced[idx] = values_allreduce_mean(vals, self.comm_group, self._value_dtype, self.counter)
            global_sent = idx.numel() * comm_size
        else:
            reduced, counts = sparse_allgather_mean(idx, vals, x.numel(), self.comm_group, self._value_dtype,
                                                    self.counter, out=self._scratch("reduced", x.numel(), x.device))
            global_sent = int(counts.sum())
        if self.nodes is not None:
            reduced = all_gather_slices(reduced, self.nodes, self.counter)  # (n_pad,)
        scatter_flat(reduced, grads, lay.sparse, lay.starts)
        return idx.numel(), global_sent, self.comm_group

    def _close_compressed_step(self, sent: int, global_sent: int, comm=None) -> None:
        """After a compressed exchange (this step path and the overlapped reducer alike): the
        resync decision, the tallies and the step's stats, and the allocation when it is due.
        ``sent``: elements this rank sent; ``global_sent``: all ranks of the exchange ``comm``."""
        comm = self.comm_group if comm is None else comm
        comm_size = group_size(comm)
        offered = self.layout.region_numel if self.nodes is not None else self.layout.numel
        expected = self.config.density * self.compressor.scale * offered * comm_size
        if self.compressor.uses_stats and not 1 / _RESYNC <= global_sent / max(expected, 1.0) <= _RESYNC:
            self._resync = True  # every rank of the exchange saw the same counts: same decision
        t = self._tally
        t["compressed_steps"] += 1
        t["sent"] += sent
        t["offered"] += offered
        t["global_sent"] += global_sent
        t["global_offered"] += offered * comm_size
        self._last = {"compressed": True, "sent": sent, "density": sent / max(offered, 1),
                      "global_density": global_sent / max(offered * comm_size, 1)}
        if self._allocation_due():
            self._refresh_allocation(comm)

    def _scratch(self, name: str, numel: int, device) -> torch.Tensor:
        """A float32 work buffer reused across steps (not state: never saved). Fresh 10^7-element
        buffers every step cost more in page faults than the selection itself."""
        buf = self._work.get(name)
        if buf is None or buf.numel() != numel or buf.device != torch.device(device):
            buf = self._work[name] = torch.zeros(numel, dtype=torch.float32, device=device)
        return buf

    def _accumulate(self, x: torch.Tensor, a: int = 0, b: Optional[int] = None) -> torch.Tensor:
        """v = e + x (or e + (u = m u + x)), in the residual buffer; v = x without error feedback.

        ``x`` is the region's (s,) gradient; only its positions [a, b) are accumulated (the
        overlapped reducer's buckets; default all). Returns the whole region's v (s,)."""
        if "residual" not in self._buffers:
            return x
        lo, hi = self.layout.region
        b = hi - lo if b is None else b
        e = self._buffers["residual"][lo:hi]
        if "momentum" in self._buffers:
            u = self._buffers["momentum"][lo:hi]
            u[a:b].mul_(self.momentum_correction.factor()).add_(x[a:b])
            e[a:b].add_(u[a:b])
            return e
        e[a:b].add_(x[a:b])
        return e

    def _feedback(self, v: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
        """e = v - sent (exact: what the rounding to value_dtype lost stays); u = 0 where sent."""
        if "residual" not in self._buffers:
            return
        sent = vals.to(self._value_dtype).to(vals.dtype)
        v.index_copy_(0, idx, vals - sent)  # v is the residual buffer's region
        if "momentum" in self._buffers:
            lo, hi = self.layout.region
            self._buffers["momentum"][lo:hi].index_fill_(0, idx, 0.0)

    def _select(self, v: torch.Tensor, segments=None) -> torch.Tensor:
        """Sorted region positions to send, per segment (``segments``: a subset, default all)."""
        comp, seed = self.compressor, self.config.seed
        parts = []
        for seg in (self.layout.segments if segments is None else segments):
            sv = v[seg.start: seg.end]
            gen = (seeded_generator(mix_seed(seed, self._step, seg.index, self._seed_rank), v.device)
                   if comp.uses_stats else None)
            shared = (seeded_generator(mix_seed(seed, self._step, seg.index, -1), v.device)
                      if comp.shared_indices else None)
            tstate = self.state[self._params[seg.index]]
            idx = comp.select(sv, tstate, gen, shared)
            comp.after_select(tstate, idx.numel(), seg.numel)
            parts.append(idx + seg.start)
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=v.device)
        return torch.cat(parts)

    def _allocation_due(self) -> bool:
        """``allocation: nonzero``: measure at the first compressed step, then on the step before
        each interval's statistics sync (so bayes_prior's thresholds follow the new densities)."""
        cfg = self.config
        if cfg.resolved_allocation != "nonzero" or cfg.granularity != "tensor" or self.compressor is None:
            return False
        c = self._step - self.warmup_steps
        return c == 0 or (c > 0 and (c + 1) % cfg.stats_sync_interval == 0)

    def _count_nonzero(self, x: torch.Tensor, segments=None) -> None:
        """Record the nonzero elements of each segment of the fresh gradient ``x`` (s,) (before the
        residual), as device tensors: no host sync inside the overlapped reducer's hooks."""
        for seg in (self.layout.segments if segments is None else segments):
            self._nnz[seg.index] = torch.count_nonzero(x[seg.start: seg.end])

    def _refresh_allocation(self, comm=None) -> None:
        """Sum the nonzero counts over the exchange group and give each tensor its share of the
        budget (:func:`allocate_densities`); every rank of the exchange computes the same densities."""
        segs, nnz = self.layout.segments, self._nnz
        self._nnz = {}
        if not segs:  # every rank of the exchange shares this region: all return here together
            return
        comm = self.comm_group if comm is None else comm
        zero = torch.zeros((), dtype=torch.int64, device=self._params[0].device)
        counts = torch.stack([nnz.get(s.index, zero) for s in segs]).to(torch.float64)  # (S,)
        if is_distributed(comm):
            dist.all_reduce(counts, group=comm)
            nbytes = allreduce_bytes(counts.numel() * 8, group_size(comm))
            self.counter.add(nbytes, nbytes)
        # a tensor weighs at least its plain share (density x size per rank), so one whose gradient
        # happened to be all zero at the measurement still sends a little until the next one
        floor = self.config.density * group_size(comm)
        weights = [max(c, floor * s.numel) for c, s in zip(counts.tolist(), segs)]
        densities = allocate_densities([s.numel for s in segs], weights, self.config.density)
        for seg, d in zip(segs, densities):
            self.state[self._params[seg.index]]["density"] = d
        log.debug("allocation nonzero: densities %s", [round(d, 5) for d in densities])

    def _stats_due(self) -> bool:
        """At compressed steps 0, 1, 2, 4, 8, ... (the residuals build up then), then every interval,
        and on the step after the global density left [1/1.5, 1.5] x the target."""
        c, interval = self._step - self.warmup_steps, self.config.stats_sync_interval
        if c % interval == 0 or (c < interval and c & (c - 1) == 0) or self._resync:
            return True
        return any("tau" not in self.state[self._params[s.index]] for s in self.layout.segments)

    def _sync_stats(self, v: torch.Tensor, segments=None, comm=None) -> None:
        """All-reduce the per-tensor max |v|, then the log-histograms; set each tensor's threshold.

        Element-wise over segments, with one random stream per segment, so syncing a subset
        (the overlapped reducer's buckets, ``segments``) gives the same thresholds."""
        comp = self.compressor
        segs = self.layout.segments if segments is None else segments
        comm = self.comm_group if comm is None else comm
        if not segs and not is_distributed(comm):
            return
        world = group_size(comm)
        maxes = torch.tensor([comp.local_max(v[s.start: s.end]) for s in segs] or [0.0], device=v.device)
        hist_bytes = maxes.numel() * self.config.bins * 4
        if is_distributed(comm):
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=comm)
        tops = [math.ceil(math.log2(m)) if m > 0 else -math.inf for m in maxes.tolist()]
        hists = torch.stack([comp.local_histogram(v[s.start: s.end], top, seeded_generator(
            mix_seed(self.config.seed, self._step, -2, s.index, self._seed_rank), v.device))
            for s, top in zip(segs, tops)]
            or [torch.zeros(self.config.bins, device=v.device)])  # (S, B)
        if is_distributed(comm):
            dist.all_reduce(hists, op=dist.ReduceOp.SUM, group=comm)
            nbytes = allreduce_bytes(maxes.numel() * 4, world) + allreduce_bytes(hist_bytes, world)
            self.counter.add(nbytes, nbytes)
        for s, h, top in zip(segs, hists, tops):
            comp.update(self.state[self._params[s.index]], h, top)
        self._resync = False

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        """Cumulative traffic and density of this rank (bytes as the ring algorithms move them).

        ``density``: elements this rank sent / elements it compressed; ``global_density``: the
        same over all ranks of the exchange; ``dense_bytes``: what a dense all-reduce of
        every gradient would have sent; ``last``: the latest step alone.
        """
        t = self._tally
        out = dict(self.counter.snapshot(), steps=self._step, compressed_steps=t["compressed_steps"],
                   method=self.config.method, dense_bytes=t["dense_bytes"],
                   density=t["sent"] / t["offered"] if t["offered"] else 1.0,
                   global_density=t["global_sent"] / t["global_offered"] if t["global_offered"] else 1.0,
                   last=dict(self._last))
        out["compression_ratio"] = out["dense_bytes"] / max(out["bytes_sent"], 1)
        return out
