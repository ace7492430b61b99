"""The compressed reduction run in buckets from backward hooks (the overlap pipeline's path).

CompressedOptimizer.reduce_gradients() compresses and exchanges all gradients in
``step()``, after the backward. This reducer does the same work bucket by bucket while the
backward is still running: once a bucket's gradients are final (see
ds_xc.parallel.buckets), its compressed tensors are accumulated into the error-feedback
residual, their thresholds synced when due, their entries selected, and the sparse
payload's all-gather issued asynchronously; small tensors of the bucket go in an
async dense all-reduce. ``finish()`` waits, decodes the means into ``.grad`` and
closes the step's bookkeeping, after which ``CompressedOptimizer.step()`` only steps
the wrapped optimizer. The optimizer is driven through its public reducers' interface
(ds_xc/compression/steps.py: ``compresses_this_step``, ``select_region``, ``close_step``).

Selection, statistics and random draws are per tensor (segment) and seeded by (step,
tensor, rank), and the means are element-wise, so the gradients, residuals and
thresholds equal those of ``reduce_gradients()`` (tests/test_overlap_compression.py).
Not supported: the node hierarchy (its intra-node reduce-scatter needs the whole
bucket) and ``method: powersgd`` (refused: its two all-reduces span every tensor);
``granularity: bucket`` (one threshold over all tensors) runs as a single bucket.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds_xc.compression.config import COMPRESSION_SECTION
from ds_xc.compression.layout import gather_flat, scatter_flat
from ds_xc.compression.transport import start_sparse_allgather_mean
from ds_xc.config import ConfigError, HEAD_SECTION
from ds_xc.parallel.buckets import BucketedGradReducer
from ds_xc.parallel.collectives import all_reduce_mean_, allreduce_bytes

__all__ = ["OverlappedCompressedReducer"]



class OverlappedCompressedReducer(BucketedGradReducer):
    """Buckets of a CompressedOptimizer's parameters, compressed and exchanged from backward hooks."""

    def __init__(self, opt, timeline=None, bucket_bytes: int = 4 << 20, comm_group=None):
        if opt.nodes is not None:
            raise ConfigError(f"{HEAD_SECTION}.overlap.overlap_grad_reduce=true with "
                              f"{COMPRESSION_SECTION}.hierarchy.ranks_per_node={opt.nodes.local_size}: the "
                              "hierarchical reduction needs the whole bucket at once; set overlap_grad_reduce=false "
                              "or ranks_per_node=1")
        if opt.compressor is not None and opt.compressor.low_rank:
            raise ConfigError(f"{HEAD_SECTION}.overlap.overlap_grad_reduce=true with {COMPRESSION_SECTION}.method="
                              f"{opt.config.method!r}: the low-rank reduction all-reduces every tensor's P before "
                              "any Q, so it cannot run bucket by bucket from backward hooks; set "
                              "overlap_grad_reduce=false, or method 'none', 'topk', 'randomk' or 'bayes_prior'")
        lay = opt.layout
        one = opt.config.granularity != "tensor" and lay.sparse  # one threshold over all: one bucket
        super().__init__(opt.params, opt.comm_group, bucket_bytes, timeline, comm_group,
                         buckets=[list(reversed(range(len(opt.params))))] if one else None)
        self.opt = opt
        start_of = dict(zip(lay.sparse, lay.starts))
        self._plan = []
        for idx in self.buckets:
            sparse = sorted(i for i in idx if i in start_of)
            dense = [i for i in idx if i not in start_of]
            a = min((start_of[i] for i in sparse), default=0)
            b = max((start_of[i] + self.params[i].numel() for i in sparse), default=0)
            if sparse and b - a != sum(self.params[i].numel() for i in sparse):
                raise AssertionError("bucket's compressed tensors are not contiguous in the flat layout")
            members = set(sparse)
            segs = [s for s in lay.segments if s.index in members]
            self._plan.append({"sparse": sparse, "starts": [start_of[i] for i in sparse], "dense": dense,
                               "range": (a, b), "segments": segs})
        self._state: list = [None] * len(self.buckets)

    # ------------------------------------------------------------------ per step
    def arm(self) -> None:
        super().arm()
        opt = self.opt
        self.compress = opt.compresses_this_step()
        self.stats_due = self.compress and opt.stats_sync_due()
        self._state = [None] * len(self.buckets)
        self._before = opt.counter.snapshot()
        device = self.params[0].device
        if self.compress and opt.layout.numel:
            self._flat = opt.scratch("flat", opt.layout.padded, device)
            self._reduced = opt.scratch("reduced", opt.layout.numel, device)

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        opt, plan = self.opt, self._plan[b]
        if not self.compress:  # warm-up or method none: the whole bucket dense
            super()._launch(b)
            idx = self.buckets[b]  # the bucket's flat buffer has the dtype of its first parameter
            numel = sum(self.params[i].numel() for i in idx)
            nbytes = allreduce_bytes(numel * self.params[idx[0]].element_size(), self.world)
            opt.counter.add(nbytes, nbytes)
            return
        state = {}
        if plan["dense"]:
            grads = [self._grad(i) for i in plan["dense"]]
            flat = torch.cat([g.reshape(-1) for g in grads])
            state["dense"] = flat
            if self.active:  # the mean in flight; divided after the wait in finish()
                state["dense_work"] = all_reduce_mean_(flat, self.comm_group, async_op=True)
                nbytes = allreduce_bytes(flat.numel() * flat.element_size(), self.world)
                opt.counter.add(nbytes, nbytes)
                if self.timeline is not None:
                    self.timeline.issued("grad_reduce", flat.numel() * flat.element_size())
        if plan["sparse"]:
            a, e = plan["range"]
            gather_flat(self._grads(plan["sparse"]), plan["sparse"], plan["starts"], self._flat)
            # NaN/Inf would break the thresholds and selection on this rank only (its peers then wait
            # in the next collective): compress them as 0. The .grad keeps them, so XCEngine sees them
            # and skips the step (restarting these residuals) on every rank.
            torch.nan_to_num_(self._flat[a:e], nan=0.0, posinf=0.0, neginf=0.0)
            idx, vals = opt.select_region(self._flat, a, e, plan["segments"], comm=self.comm_group,
                                          sync_stats=self.stats_due)  # (m,) sorted region positions in [a, e)
            if opt.compressor.shared_indices:
                buf = vals.to(opt.value_dtype)
                work = dist.all_reduce(buf, group=self.comm_group, async_op=True) if self.active else None
                nbytes = allreduce_bytes(buf.numel() * buf.element_size(), self.world)
                opt.counter.add(nbytes, nbytes)
                state["values"] = (buf, work)
            else:
                state["sparse"] = start_sparse_allgather_mean(idx - a, vals, e - a, self.comm_group, opt.value_dtype,
                                                              opt.counter, out=self._reduced[a:e], async_op=True)
            if self.timeline is not None:
                self.timeline.issued("grad_reduce", vals.numel() * (2 + opt.value_dtype.itemsize))
            state["idx"] = idx
        self._state[b] = state

    def _grads(self, idx: list[int]) -> dict[int, torch.Tensor]:
        """{i: .grad of parameter i} for i in ``idx`` (zeros where there is none)."""
        return {i: self._grad(i) for i in idx}

    def _grad(self, i: int) -> torch.Tensor:
        p = self.params[i]
        if p.grad is None:  # every rank takes part in every collective
            p.grad = torch.zeros_like(p)
        return p.grad

    @torch.no_grad()
    def finish(self) -> None:
        """Launch what is left, wait, write the means into ``.grad``; close the wrapper's step."""
        if not self.armed:
            self.arm()
        self.launch_remaining()
        opt = self.opt
        if not self.compress:
            BucketedGradReducer.finish(self)
            opt.close_step(self._before, by_hooks=True)
            return
        sent = global_sent = 0
        for b, plan in enumerate(self._plan):
            state = self._state[b]
            if "dense" in state:
                flat = state["dense"]
                if state.get("dense_work") is not None:
                    state["dense_work"].wait(self.wait_comm)
                offset = 0
                for i in plan["dense"]:
                    g = self._grad(i)
                    g.copy_(flat[offset: offset + g.numel()].view_as(g))
                    offset += g.numel()
            if not plan["sparse"]:
                continue
            a, e = plan["range"]
            idx = state["idx"]
            if "values" in state:
                buf, work = state["values"]
                if work is not None:
                    self.wait_comm(work)
                reduced = self._reduced[a:e].zero_()
                reduced[idx - a] = buf.float().div_(self.world)
                global_sent += idx.numel() * self.world
            else:
                reduced, counts = state["sparse"].wait(self.timeline)
                global_sent += int(counts.sum())
            sent += idx.numel()
            scatter_flat(reduced, self._grads(plan["sparse"]), plan["sparse"], [s - a for s in plan["starts"]])
        self.armed = False
        self._state = [None] * len(self.buckets)
        opt.close_step(self._before, (sent, global_sent, self.comm_group) if opt.layout.numel else None, by_hooks=True)
