"""ds_xc's compressed gradient reduction as a DDP communication hook.

``DistributedDataParallel.register_comm_hook(state, hook)`` lets DDP hand each gradient
bucket to a function instead of its all-reduce (torch ships PowerSGD that way). Here the
state is a :class:`CompressedDDPHook` and the hook is :func:`compressed_ddp_hook`: they run
the same reduction as :meth:`CompressedOptimizer.reduce_gradients` on the DDP module's
parameters, bucket by bucket::

    hook = ds_xc.CompressedDDPHook(ddp_model, optimizer, config={"method": "topk", ...})
    ddp_model.register_comm_hook(hook, ds_xc.compressed_ddp_hook)
    ...  loss.backward(); optimizer.step()    # DDP called the hook; step as usual

Granularity. DDP flattens several parameters into one bucket, and after its first step
it may regroup them in the order their gradients became ready. CompressedOptimizer's
rule is per parameter (``granularity: tensor``): each tensor has its own threshold,
statistics and random stream, seeded by (seed, step, tensor, rank), and the mean is
element-wise. The hook therefore never selects over DDP's flat bucket: it finds the
bucket's tensors (``bucket.parameters()``) in the optimizer's layout and applies the
per-tensor rule to each, through CompressedOptimizer's public reducers' interface
(ds_xc/compression/steps.py), exactly as the overlapped reducer does for its own
buckets. Gradients and error-feedback residuals equal those of ``reduce_gradients()``
on the same gradients (tests/test_ddp_hook.py). Differences: ``granularity: bucket`` (one
threshold over all tensors), the node ``hierarchy`` and ``method: powersgd`` (its P
all-reduce spans every tensor; torch ships a PowerSGD comm hook for DDP) need every
gradient at once and are refused; the traffic counters count one dense all-reduce per bucket where
``reduce_gradients()`` counts one over all dense tensors.

DDP's bucket buffer is a copy of the gradients: the hook returns the mean in it, and DDP
writes it into ``.grad``. The hook's collectives run synchronously on the hook's group
and it returns a completed future.
"""
import logging
from typing import Optional

import torch
import torch.distributed as dist

from ds_xc.compression.config import COMPRESSION_SECTION
from ds_xc.compression.optimizer import CompressedOptimizer
from ds_xc.compression.transport import dense_allreduce_mean_, sparse_allgather_mean, values_allreduce_mean
from ds_xc.config import ConfigError
from ds_xc.parallel.agree import agree, all_or_none
from ds_xc.parallel.groups import group_size

log = logging.getLogger(__name__)

__all__ = ["CompressedDDPHook", "compressed_ddp_hook"]


class CompressedDDPHook:
    """The state of :func:`compressed_ddp_hook`: a CompressedOptimizer over the DDP module's parameters.

    Args:
        ddp_model: the ``DistributedDataParallel`` module (its ``module.parameters()`` order is
            the layout order, and its ``process_group`` the default group).
        optimizer: the optimizer that steps the module's parameters. The hook only reduces;
            call ``optimizer.step()`` (or ``hook.optimizer.step()``, which then only steps it).
        config: the ``gradient_compression`` section (dict or model).
        group: the data-parallel group (default: the DDP module's process group).
    """

    def __init__(self, ddp_model, optimizer: torch.optim.Optimizer, config=None, group=None):
        group = group if group is not None else getattr(ddp_model, "process_group", None)
        params = [p for p in ddp_model.module.parameters() if p.requires_grad]
        self.optimizer = CompressedOptimizer(optimizer, config, group, params=params, steps_optimizer=False)
        cfg = self.optimizer.config
        if cfg.method == "powersgd":
            raise ConfigError(f"{COMPRESSION_SECTION}.method: got 'powersgd' with the DDP comm hook; allowed: "
                              "'none', 'topk', 'randomk', 'bayes_prior'. For PowerSGD inside DDP use torch's own "
                              "hook (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook), or use "
                              "CompressedOptimizer.reduce_gradients() without DDP")
        if cfg.adam_variance == "frozen":
            raise ConfigError(f"{COMPRESSION_SECTION}.adam_variance: got 'frozen' with the DDP comm hook; allowed: "
                              "'auto' or 'live' (the hook only reduces: the optimizer's steps stay the user's)")
        if cfg.enabled and cfg.granularity != "tensor":
            raise ConfigError(f"{COMPRESSION_SECTION}.granularity: got {cfg.granularity!r} with the DDP comm hook; "
                              "allowed: 'tensor' (DDP's buckets split the one-threshold bucket)")
        if self.optimizer.nodes is not None:
            raise ConfigError(f"{COMPRESSION_SECTION}.hierarchy.ranks_per_node: got {self.optimizer.nodes.local_size} "
                              "with the DDP comm hook; allowed: 1 (the hierarchy needs every gradient at once)")
        lay = self.optimizer.layout
        self._index = {id(p): i for i, p in enumerate(self.optimizer.params)}
        self._start = dict(zip(lay.sparse, lay.starts))
        self._segments = {s.index: s for s in lay.segments}
        self._step_open: Optional[dict] = None  # this step's counters snapshot and tallies

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """This rank's compression state (step, residuals, momentum, thresholds, counters)."""
        return self.optimizer.compression_state_dict(rank_state=True)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. Collective over the group: every rank checks its state and the
        ranks agree on the outcome and the step before anything is loaded."""
        opt = self.optimizer
        with all_or_none("CompressedDDPHook.load_state_dict (checking the compression state)", opt.group):
            opt.check_compression_state(state)
        agree(int(state["step"]), "the compression step of the DDP hook state being loaded", opt.group)
        opt.load_compression_state_dict(state)

    def stats(self) -> dict:
        """Traffic and density so far (:meth:`CompressedOptimizer.stats`)."""
        return self.optimizer.stats()

    # ------------------------------------------------------------------ one bucket
    @torch.no_grad()
    def reduce_bucket(self, bucket) -> torch.Tensor:
        """Replace the bucket's flat gradients by their (compressed) mean; return the buffer."""
        opt = self.optimizer
        if self._step_open is None:
            self._step_open = {"before": opt.counter.snapshot(), "compress": opt.compresses_this_step(),
                               "sent": 0, "global_sent": 0}
            if self._step_open["compress"]:
                self._step_open["stats"] = opt.stats_sync_due()
        step = self._step_open
        buf = bucket.buffer()  # (n_bucket,) the bucket's gradients, flat, in bucket.parameters() order
        views, idx = [], []
        offset = 0
        for p in bucket.parameters():
            views.append(buf[offset: offset + p.numel()])
            idx.append(self._param_index(p))
            offset += p.numel()
        if not step["compress"]:
            dense_allreduce_mean_([buf], opt.group, opt.counter)
        else:
            dense = [v for v, i in zip(views, idx) if i not in self._start]
            dense_allreduce_mean_(dense, opt.group, opt.counter)  # in place, into the bucket's views
            sparse = sorted(((i, v) for i, v in zip(idx, views) if i in self._start), key=lambda t: t[0])
            for run in _contiguous_runs(sparse, self._start, opt.params):
                self._reduce_run(run)
        if bucket.is_last():
            self._close_step()
        return buf

    def _param_index(self, p: torch.Tensor) -> int:
        i = self._index.get(id(p))
        if i is None:
            raise ValueError(f"DDP bucket holds a parameter of shape {tuple(p.shape)} that CompressedDDPHook "
                             "does not reduce: build the hook from the same DDP module")
        return i

    def _reduce_run(self, run: list[tuple[int, torch.Tensor]]) -> None:
        """Compress and exchange tensors adjacent in the flat layout ``run`` [(index, flat view)]."""
        opt, step = self.optimizer, self._step_open
        a = self._start[run[0][0]]
        e = self._start[run[-1][0]] + run[-1][1].numel()
        flat = opt.scratch("flat", opt.layout.padded, run[0][1].device)  # (n_pad,)
        for i, v in run:
            flat[self._start[i]: self._start[i] + v.numel()].copy_(v)
        segs = [self._segments[i] for i, _ in run if i in self._segments]
        idx, vals = opt.select_region(flat, a, e, segs, comm=opt.comm_group, sync_stats=step["stats"])  # (m,)
        if opt.compressor.shared_indices:
            reduced = torch.zeros(e - a, dtype=torch.float32, device=flat.device)
            reduced[idx - a] = values_allreduce_mean(vals, opt.comm_group, opt.value_dtype, opt.counter)
            step["global_sent"] += idx.numel() * group_size(opt.comm_group)
        else:
            reduced, counts = sparse_allgather_mean(idx - a, vals, e - a, opt.comm_group, opt.value_dtype,
                                                    opt.counter)  # (e - a,)
            step["global_sent"] += int(counts.sum())
        step["sent"] += idx.numel()
        for i, v in run:
            start = self._start[i] - a
            v.copy_(reduced[start: start + v.numel()])

    def _close_step(self) -> None:
        opt, step = self.optimizer, self._step_open
        self._step_open = None
        exchange = None
        if step["compress"] and opt.layout.numel:
            exchange = (step["sent"], step["global_sent"], opt.comm_group)
        opt.close_step(step["before"], exchange, by_hooks=True)


def _contiguous_runs(sparse: list, start: dict, params: list) -> list:
    """Split [(index, view)] sorted by index into runs adjacent in the flat layout."""
    runs: list = []
    for i, v in sparse:
        if runs and start[runs[-1][-1][0]] + params[runs[-1][-1][0]].numel() == start[i]:
            runs[-1].append((i, v))
        else:
            runs.append([(i, v)])
    return runs


def compressed_ddp_hook(state: CompressedDDPHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's compressed mean over ``state``'s group (a done future).

    No ``from __future__ import annotations`` in this module: DDP checks these annotations."""
    fut = torch.futures.Future()
    fut.set_result(state.reduce_bucket(bucket))
    return fut
