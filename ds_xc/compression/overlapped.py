"""The compressed reduction run in buckets from backward hooks (the overlap pipeline's path).

CompressedOptimizer.reduce_gradients() compresses and exchanges all gradients in
``step()``, after the backward. This reducer does the same work bucket by bucket while the
backward is still running: once a bucket's gradients are final (see
ds_xc.parallel.buckets), its compressed tensors are accumulated into the error-feedback
residual, their thresholds synced when due, their entries selected, and the sparse
payload's all-gather issued asynchronously; small tensors of the bucket go in an
async dense all-reduce. ``finish()`` waits, decodes the means into ``.grad`` and
closes the step's bookkeeping, after which ``CompressedOptimizer.step()`` only steps
the wrapped optimizer.

Selection, statistics and random draws are per tensor (segment) and seeded by (step,
tensor, rank), and the means are element-wise, so the gradients, residuals and
thresholds equal those of ``reduce_gradients()`` (tests/test_overlap_compression.py).
Not supported: the node hierarchy (its intra-node reduce-scatter needs the whole
bucket); ``granularity: bucket`` (one threshold over all tensors) runs as a single bucket.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds_xc.compression.config import COMPRESSION_SECTION
from ds_xc.compression.transport import allreduce_bytes, start_sparse_allgather_mean
from ds_xc.config import ConfigError, HEAD_SECTION
from ds_xc.parallel.buckets import BucketedGradReducer
from ds_xc.parallel.timeline import wait_work

__all__ = ["OverlappedCompressedReducer"]



class OverlappedCompressedReducer(BucketedGradReducer):
    """Buckets of a CompressedOptimizer's parameters, compressed and exchanged from backward hooks."""

    def __init__(self, opt, timeline=None, bucket_bytes: int = 4 << 20, comm_group=None):
        if opt.nodes is not None:
            raise ConfigError(f"{HEAD_SECTION}.overlap.overlap_grad_reduce=true with "
                              f"{COMPRESSION_SECTION}.hierarchy.ranks_per_node={opt.nodes.local_size}: the "
                              "hierarchical reduction needs the whole bucket at once; set overlap_grad_reduce=false "
                              "or ranks_per_node=1")
        super().__init__(opt._params, opt.comm_group, bucket_bytes, timeline, comm_group)
        self.opt = opt
        lay = opt.layout
        if opt.config.granularity != "tensor" and lay.sparse:  # one threshold over all: one bucket
            self.buckets = [list(reversed(range(len(self.params))))]
            self._bucket_of = {i: 0 for i in range(len(self.params))}
            self._buffers, self._works = [None], [None]
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
            self._plan.append({"sparse": sparse, "dense": dense, "range": (a, b), "segments": segs})
        self._state: list = [None] * len(self.buckets)

    # ------------------------------------------------------------------ per step
    def arm(self) -> None:
        super().arm()
        opt = self.opt
        self.compress = opt.compressor is not None and opt._step >= opt.config.warmup_steps
        self.stats_due = self.compress and opt.compressor.uses_stats and opt._stats_due()
        self._state = [None] * len(self.buckets)
        self._before = opt.counter.snapshot()
        device = self.params[0].device
        if self.compress and opt.layout.numel:
            self._flat = opt._scratch("flat", opt.layout.padded, device)
            self._reduced = opt._scratch("reduced", opt.layout.numel, device)

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        opt, plan = self.opt, self._plan[b]
        if not self.compress:  # warm-up or method none: the whole bucket dense
            super()._launch(b)
            buf = self._buffers[b]
            nbytes = allreduce_bytes(buf.numel() * buf.element_size(), self.world)
            opt.counter.add(nbytes, nbytes)
            return
        state = {}
        if plan["dense"]:
            grads = [self._grad(i) for i in plan["dense"]]
            flat = torch.cat([g.reshape(-1) for g in grads])
            state["dense"] = flat
            if self.active:
                state["dense_work"] = dist.all_reduce(flat, group=self.comm_group, async_op=True)
                nbytes = allreduce_bytes(flat.numel() * flat.element_size(), self.world)
                opt.counter.add(nbytes, nbytes)
                if self.timeline is not None:
                    self.timeline.issued("grad_reduce", flat.numel() * flat.element_size())
        if plan["sparse"]:
            a, e = plan["range"]
            for i in plan["sparse"]:
                start = opt.layout.starts[opt.layout.sparse.index(i)]
                self._flat[start: start + self.params[i].numel()].copy_(self._grad(i).reshape(-1))
            # NaN/Inf would break the thresholds and selection on this rank only (its peers then wait
            # in the next collective): compress them as 0. The .grad keeps them, so XCEngine sees them
            # and skips the step (restarting these residuals) on every rank.
            torch.nan_to_num_(self._flat[a:e], nan=0.0, posinf=0.0, neginf=0.0)
            if opt._allocation_due():
                opt._count_nonzero(self._flat, plan["segments"])
            v = opt._accumulate(self._flat, a, e)  # (n,) the region; [a, e) updated
            if self.stats_due:
                opt._sync_stats(v, plan["segments"], comm=self.comm_group)
            idx = opt._select(v, plan["segments"])  # (m,) sorted region positions in [a, e)
            vals = v[idx]
            if opt.compressor.shared_indices:
                buf = vals.to(opt._value_dtype)
                work = dist.all_reduce(buf, group=self.comm_group, async_op=True) if self.active else None
                nbytes = allreduce_bytes(buf.numel() * buf.element_size(), self.world)
                opt.counter.add(nbytes, nbytes)
                state["values"] = (buf, work)
            else:
                state["sparse"] = start_sparse_allgather_mean(idx - a, vals, e - a, self.comm_group, opt._value_dtype,
                                                              opt.counter, out=self._reduced[a:e], async_op=True)
            if self.timeline is not None:
                self.timeline.issued("grad_reduce", vals.numel() * (2 + opt._value_dtype.itemsize))
            opt._feedback(v, idx, vals)
            state["idx"] = idx
        self._state[b] = state
        self._next = b + 1

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
        while self._next < len(self.buckets):
            self._launch(self._next)
        opt = self.opt
        if not self.compress:
            BucketedGradReducer.finish(self)
            opt._last = {"compressed": False}
            self._close(0, 0)
            return
        sent = global_sent = 0
        for b, plan in enumerate(self._plan):
            state = self._state[b]
            if "dense" in state:
                flat = state["dense"]
                if state.get("dense_work") is not None:
                    self._wait(state["dense_work"])
                    flat.div_(self.world)
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
                    self._wait(work)
                reduced = self._reduced[a:e].zero_()
                reduced[idx - a] = buf.float().div_(self.world)
                global_sent += idx.numel() * self.world
            else:
                reduced, counts = state["sparse"].wait(self.timeline)
                global_sent += int(counts.sum())
            sent += idx.numel()
            for i in plan["sparse"]:
                start = opt.layout.starts[opt.layout.sparse.index(i)] - a
                g = self._grad(i)
                g.copy_(reduced[start: start + g.numel()].view_as(g))
        self.armed = False
        self._state = [None] * len(self.buckets)
        self._close(sent, global_sent)

    def _wait(self, work) -> None:
        wait_work(work, self.timeline, "grad_reduce")

    def _close(self, sent: int, global_sent: int) -> None:
        """The bookkeeping of CompressedOptimizer.reduce_gradients / _reduce_bucket for this step."""
        opt = self.opt
        if self.compress and opt.layout.numel:
            opt._close_compressed_step(sent, global_sent, comm=self.comm_group)
        elif self.compress:
            opt._last = {"compressed": False}
        opt._tally["dense_bytes"] += opt._dense_step_bytes
        now = opt.counter.snapshot()
        opt._last.update(step=opt._step, bytes_sent=now["bytes_sent"] - self._before["bytes_sent"],
                         bytes_received=now["bytes_received"] - self._before["bytes_received"])
        opt._step += 1
        opt._reduced_by_hooks = True
