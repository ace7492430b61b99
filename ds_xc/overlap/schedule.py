"""The chunked head schedule: the head's all-gather and reduce-scatter run under computation.

Legend: P ranks, B this rank's rows, N = sum of B over ranks, C micro-chunks, d embedding
dim, K active classes of this shard.

The local batch is split into C chunks (``torch.tensor_split`` sizes, on every rank).
Per step:

0. the head's input check runs before any collective of the step (one small all-reduce
   that also exchanges the batch sizes; ClassParallelHead.check_batch); in the backbone mode
   the embeddings' finiteness is checked on the gathered rows instead;
1. labels are all-gathered at once (small), the sampler picks the active set from them
   (samplers that look at the embeddings, ann, first wait for every chunk's gather);
2. chunk c's embeddings are all-gathered asynchronously as soon as they exist (with
   :meth:`ChunkedHeadSchedule.run_backbone` the backbone runs per chunk, so the gather
   of chunk c overlaps the backbone forward of chunk c+1);
3. the head computes chunk c (fused loss and gradients, softmax statistics all-reduced
   per row as in the serial path) while later gathers are in flight, then issues the
   reduce-scatter of chunk c's embedding gradient and goes on with chunk c+1;
4. the backbone backward of a chunk starts as soon as its gradient has arrived
   (``backward(i, embeddings, grad, last)``); the weight gradient of the active rows is
   delivered once at the end, through autograd, exactly as the serial path delivers it.

Every row's softmax is normalised over all classes of all ranks, as in the serial
path: rows are independent, so splitting rows into chunks changes no value, only the
order of float additions (the loss and all gradients equal the serial path within
float rounding; tests/test_overlap_dist.py checks 1e-6). Communication for the head
runs on its own process group (a copy of the head's group) so that in-flight gathers
never queue in front of the small softmax all-reduces.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ds_xc import config as cfg
from ds_xc.head.row_terms import mean_of
from ds_xc.head.softmax import finish_weight_grad, fused_loss_and_grads, inverse_row_norms, stat_dtype
from ds_xc.overlap.comm import PendingGather, PendingReduceScatter, split_sizes
from ds_xc.parallel.timeline import Timeline
from ds_xc.parallel.groups import copy_group

log = logging.getLogger(__name__)

__all__ = ["ChunkedHeadSchedule", "side_group"]

Backward = Callable[[int, torch.Tensor, torch.Tensor, bool], None]


side_group = copy_group  # the overlap package's name for it (kept: tests and users import it)


def _default_backward(index: int, embeddings: torch.Tensor, grad: torch.Tensor, last: bool) -> None:
    embeddings.backward(grad)


class ChunkedHeadSchedule:
    """Runs a ClassParallelHead step in C micro-chunks with its communication overlapped.

    Args:
        head: the ClassParallelHead (its sampler, loss, chunk_size and group are used).
        num_chunks: C, micro-chunks of the local batch.
        overlap: False waits for every collective at once (the serial schedule, timed the
            same way: its exposed communication is all of its communication).
        timeline: where waits are recorded (default: a new Timeline).
        comm_group: the group for the head's gathers and reduce-scatters (default: a new
            copy of the head's group, built here: every rank must construct the schedule).
    """

    def __init__(self, head, num_chunks: int = 2, overlap: bool = True, timeline: Optional[Timeline] = None,
                 comm_group=None):
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        if head.input_parallel != "data":  # nothing to overlap: the replicated head has no gather
            raise ValueError(f"ChunkedHeadSchedule: the head has input_parallel={head.input_parallel!r}; the overlap "
                             "schedule hides the gathers and reduce-scatters of input_parallel='data' only")
        if getattr(head, "replicas", None) is not None and head.replicas.active:  # not wired for 2-D yet
            raise ValueError("ChunkedHeadSchedule: the head has a replica group (2-D layout); the overlap schedule "
                             "runs 1-D heads only (replica_group=None); run the 2-D head's own forward")
        if head.loss_options.reduction == "none":  # per-row losses need the rows' upstream gradient: no schedule
            raise ValueError(f"ChunkedHeadSchedule: {cfg.HEAD_SECTION}.loss.reduction='none' is not supported by the "
                             "overlap schedule (it hands the backbone its gradient itself); use 'mean' or 'sum', or "
                             "the head's own forward")
        self.head, self.num_chunks, self.overlap = head, int(num_chunks), bool(overlap)
        self.timeline = timeline if timeline is not None else Timeline(head.weight.device)
        self.comm_group = comm_group if comm_group is not None else side_group(head.group)

    # ------------------------------------------------------------------ entry points
    def run(self, embeddings: Union[torch.Tensor, Sequence[torch.Tensor]], labels: torch.Tensor,
            batch_sizes: Optional[Sequence[int]] = None, backward: Optional[Backward] = None,
            weight_grad_scale: float = 1.0) -> torch.Tensor:
        """One step from embeddings already computed; returns the global-batch mean loss (detached).

        ``embeddings``: one (B, d) tensor (one backbone graph: its backward runs once, with
        the whole gradient, after the last chunk) or a list of C chunk tensors whose row
        counts are ``split_sizes(B, C)`` (one graph each: chunk i's backward runs as soon
        as its gradient arrives). ``backward(i, emb, grad, last)`` runs the backbone
        backward (default ``emb.backward(grad)``); ``weight_grad_scale`` multiplies the
        head weight's gradient (1 / gradient-accumulation steps inside an engine).
        """
        if isinstance(embeddings, torch.Tensor):
            parts = list(torch.tensor_split(embeddings, self.num_chunks))
            return self._step(iter(parts), embeddings.shape[0], labels, batch_sizes, backward,
                              weight_grad_scale, whole=embeddings, known=embeddings.detach())
        parts = list(embeddings)
        if len(parts) != self.num_chunks:
            raise ValueError(f"got {len(parts)} embedding chunks, the schedule has num_chunks={self.num_chunks}")
        total = sum(p.shape[0] for p in parts)
        if [p.shape[0] for p in parts] != split_sizes(total, self.num_chunks):
            raise ValueError(f"embedding chunks have {[p.shape[0] for p in parts]} rows; with {total} rows in "
                             f"{self.num_chunks} chunks they must have {split_sizes(total, self.num_chunks)} "
                             "(torch.tensor_split sizes, the same rule on every rank)")
        return self._step(iter(parts), total, labels, batch_sizes, backward, weight_grad_scale,
                          known=torch.cat([p.detach() for p in parts]) if parts else None)

    def run_backbone(self, embed: Callable, inputs: torch.Tensor, labels: torch.Tensor,
                     batch_sizes: Optional[Sequence[int]] = None, backward: Optional[Backward] = None,
                     weight_grad_scale: float = 1.0) -> torch.Tensor:
        """One step that also runs the backbone per chunk: ``embed(inputs_chunk) -> (b, d)``.

        Chunk c's all-gather is issued as soon as its embeddings exist, while the backbone
        computes chunk c+1. The backbone's rows must be independent (no BatchNorm over the batch).
        """
        parts = torch.tensor_split(inputs, self.num_chunks)
        return self._step((embed(p) for p in parts), inputs.shape[0], labels, batch_sizes, backward,
                          weight_grad_scale)

    # ------------------------------------------------------------------ the step
    def _layout(self, sizes: list):
        """Per-chunk row counts of every rank and the chunk rows' positions in the serial global batch."""
        C = self.num_chunks
        splits = [split_sizes(s, C) for s in sizes]  # [rank][chunk]
        offsets = [sum(sizes[:r]) for r in range(len(sizes))]
        per_chunk, positions = [], []
        for c in range(C):
            per_chunk.append([splits[r][c] for r in range(len(sizes))])
            pos = [torch.arange(offsets[r] + sum(splits[r][:c]), offsets[r] + sum(splits[r][:c + 1]))
                   for r in range(len(sizes))]
            positions.append(torch.cat(pos))  # (N_c,) on the host: no device sync to select rows
        return per_chunk, positions

    def _begin(self, chunks, local_rows: int, labels: torch.Tensor, batch_sizes, known: Optional[torch.Tensor]):
        """The step's prologue: the input check (and the size exchange) before any collective of
        the step, the labels' gather, then every chunk's gather issued as soon as the chunk exists.
        Returns None when the step is skipped (non-finite embeddings, nonfinite="skip"), else
        (verdict, per_chunk, positions, y (N,), embeds, gathers, gathered)."""
        head = self.head
        verdict = head.check_batch(known, labels, batch_sizes, num_rows=local_rows)
        if verdict is None:  # every rank agrees: nothing is sent
            return None
        per_chunk, positions = self._layout(verdict.sizes)
        y = PendingGather(labels.to(torch.int64), verdict.sizes, self.comm_group, self.timeline, "labels",
                          blocking=True).wait()  # (N,)
        embeds, gathers = [], []
        for c, emb in enumerate(chunks):
            embeds.append(emb)
            rows = head.agreed_rows(emb.detach())  # backbone mode: the dtype agreed (first call) or cast
            gathers.append(PendingGather(rows, per_chunk[c], self.comm_group, self.timeline, "gather",
                                         blocking=not self.overlap) if sum(per_chunk[c]) else None)
        gathered: list = [None] * self.num_chunks
        if known is None and verdict.full:  # backbone mode: the embeddings only exist now
            if not self._gathered_finite(gathers, gathered, verdict.sizes):
                return None
        return verdict, per_chunk, positions, y, embeds, gathers, gathered

    def _step(self, chunks, local_rows: int, labels: torch.Tensor, batch_sizes, backward, weight_grad_scale,
              whole: Optional[torch.Tensor] = None, known: Optional[torch.Tensor] = None) -> torch.Tensor:
        head, tl, C = self.head, self.timeline, self.num_chunks
        backward = backward or _default_backward
        own_step = not tl.in_step
        if own_step:
            tl.begin_step()
        blocking = not self.overlap
        device = head.weight.device
        begun = self._begin(chunks, local_rows, labels, batch_sizes, known)
        if begun is None:  # non-finite input, nonfinite="skip" (every rank agrees): no backward
            if own_step:
                tl.end_step()
            return torch.full((), float("nan"), dtype=torch.float64, device=device)
        verdict, per_chunk, positions, y, embeds, gathers, gathered = begun
        n = sum(verdict.sizes)
        loss_dtype = stat_dtype(head.weight.dtype)
        if n == 0:  # every rank empty (agreed): a no-op for the head, as in ClassParallelHead.forward
            head.empty_step(torch.is_grad_enabled())
            if own_step:
                tl.end_step()
            return torch.zeros((), dtype=loss_dtype, device=device)
        need_gx = any(e.requires_grad for e in embeds)
        need_gw = head.weight.requires_grad and torch.is_grad_enabled()

        x_serial = None
        sampler = head.sampler
        if sampler.needs_embeddings:  # the active set depends on every row's embedding: wait for all
            x_serial = self._assemble(gathers, gathered, positions, n)
        terms, lse_all, denom = self._row_terms(y, n)
        active = sampler.sample(head.loss_options.positives(y), x_serial, head.weight)  # ignored: no positives
        head.last_active = active
        if head.lazy_catch_up is not None:  # update lazy_exact: the rows read below, up to date
            for _, index in active.groups():
                head.lazy_catch_up(index, active=True)
        groups = [(rows, index, head.weight.detach() if index is None else head.weight.detach()[index])
                  for rows, index in active.groups()]  # (K, d) active rows, gathered once per step
        norms = [inverse_row_norms(w, head.loss_fn) for _, _, w in groups]  # (K,) once per step, not per chunk
        gw_sum: list = [None] * len(groups)  # (K, d) accumulators, normalisation backward applied at the end
        total = torch.zeros((), dtype=torch.float64, device=device)
        safe = torch.where(denom != 0, denom, torch.ones_like(denom))  # all ignored: NaN loss, zero gradients
        inv_local = head.world_size / safe  # P * d(global mean)/d(own rows), as the serial path
        last_local = max((c for c in range(C) if per_chunk[c][head.rank] > 0), default=-1)

        pending: list = []  # (chunk, PendingReduceScatter) not yet consumed by the backbone
        for c in range(C):
            if sum(per_chunk[c]) == 0:  # the same on every rank: nobody calls a collective for it
                continue
            xc = gathered[c] if gathered[c] is not None else gathers[c].wait()  # (N_c, d)
            gathered[c] = xc if x_serial is None and self._keep_for_metrics() else None
            gx = self._chunk(xc, positions[c].to(device), active, groups, norms, gw_sum, need_gx, need_gw, total,
                             terms, lse_all)
            if need_gx:
                pending.append((c, PendingReduceScatter(gx, per_chunk[c], head.rank, self.comm_group, tl,
                                                        blocking=blocking)))
            if whole is None and len(pending) > 1:  # chunk c-1's backbone backward while chunk c's gradient travels
                self._backward_chunk(*pending.pop(0), embeds, backward, inv_local, last_local)
        if whole is None:
            while pending:
                self._backward_chunk(*pending.pop(0), embeds, backward, inv_local, last_local)
        elif pending:
            grad = torch.cat([p.wait() for _, p in pending]) * inv_local  # (B, d)
            backward(0, whole, grad.to(whole.dtype), True)

        if need_gw:
            self._finish_weight_grads(groups, norms, gw_sum, weight_grad_scale / safe)
        if self._keep_for_metrics():
            if x_serial is None:
                x_serial = self._assemble(gathers, gathered, positions, n)
            head.measure_sampler(x_serial, active)
        loss = mean_of(total, denom.to(total.dtype)) if head.loss_options.reduction == "mean" else total
        loss = loss.to(loss_dtype)
        head.last_lse = head.own_rows(lse_all, verdict.sizes)  # (B,) this rank's rows
        loss = head.flag_unchecked(loss, y, verdict)
        if own_step:
            tl.end_step()
        return loss

    def _finish_weight_grads(self, groups, norms, gw_sum, scale) -> None:
        """Apply the normalisation backward to each group's accumulated (K, d) gradient, then deliver them."""
        for (_, _, w), rw, gw in zip(groups, norms, gw_sum):
            if gw is not None:
                finish_weight_grad(gw, w, rw, self.head.loss_fn)
        self._deliver_weight_grad(groups, gw_sum, scale)

    def _gathered_finite(self, gathers, gathered, sizes) -> bool:
        """Backbone mode: the embeddings' finiteness, checked on the gathered rows (the same on every
        rank, so no collective; one host sync). Waits for every chunk's gather first, so in a
        checked step the head's compute no longer overlaps the later gathers. False: skip."""
        head = self.head
        bad_rows = []
        for c, pg in enumerate(gathers):
            if pg is not None:
                gathered[c] = pg.wait()  # (N_c, d)
                bad_rows.append((~torch.isfinite(gathered[c]).all(dim=1)).sum())
        if not bad_rows or not bool(torch.stack(bad_rows).sum()):
            return True
        per_chunk, _ = self._layout(sizes)
        ranks = sorted({r for c, pg in enumerate(gathers) if pg is not None
                        for r in self._bad_ranks(gathered[c], per_chunk[c])})
        if head.nonfinite == "raise":
            raise FloatingPointError(f"embeddings of rank(s) {ranks} contain NaN or Inf (found on the gathered rows; "
                                     f"this is rank {head.rank}; {cfg.HEAD_SECTION}.nonfinite='raise')")
        head.nonfinite_inputs += 1
        log.warning("rank %d: rank(s) %s sent NaN or Inf embeddings; the step is skipped on every rank "
                    "(%s.nonfinite='skip')", head.rank, ranks, cfg.HEAD_SECTION)
        for pg in gathers:
            if pg is not None:
                pg.wait()
        return False

    @staticmethod
    def _bad_ranks(xc: torch.Tensor, counts: list) -> list:
        """Ranks whose rows of the gathered chunk xc (N_c, d) hold NaN/Inf (counts: rows per rank)."""
        bad = (~torch.isfinite(xc).all(dim=1)).tolist()
        out, a = [], 0
        for r, b in enumerate(counts):
            if any(bad[a: a + b]):
                out.append(r)
            a += b
        return out

    def _row_terms(self, y: torch.Tensor, n: int):
        """The loss options of the step: RowTerms with the rows' weights (N,) (0 where ignored), the (N,)
        lse buffer, and the mean's denominator (the non-ignored rows; 1 for reduction 'sum')."""
        head = self.head
        opts = head.loss_options
        sd = stat_dtype(head.weight.dtype)
        terms = opts.row_terms(y, head.num_classes, sd)
        v = terms.weight  # (N,)
        denom = v.sum() if opts.reduction == "mean" and n else torch.ones((), dtype=sd, device=v.device)
        return terms, torch.empty(n, dtype=sd, device=v.device), denom

    def _chunk(self, xc, pos, active, groups, norms, gw_sum, need_gx, need_gw, total, terms, lse_all):
        """Loss rows and gradients of one chunk; returns the chunk's embedding gradient (N_c, d) (row sums).
        The active rows' gradients accumulate in ``gw_sum`` (one (K, d) buffer per group)."""
        head = self.head
        targets = active.targets[pos]  # (N_c,)
        gx_all = None
        for g, (rows, _, w) in enumerate(groups):
            if len(groups) == 1:
                sel = None
                xs, ts = xc, targets
            else:
                pos_host = pos.cpu()
                sel = ((pos_host >= rows.start) & (pos_host < rows.stop)).nonzero().squeeze(1)  # same on all ranks
                if sel.numel() == 0:
                    continue
                sel = sel.to(xc.device)
                xs, ts = xc[sel], targets[sel]
            rows_at = pos if sel is None else pos[sel]  # (n,) the rows' places in the global batch
            lse = torch.empty(rows_at.shape[0], dtype=lse_all.dtype, device=lse_all.device)
            part = terms.but(weight=terms.weight[rows_at], lse_out=lse)
            rows_total, gx, gw = fused_loss_and_grads(xs, w, ts, head.loss_fn, head.group, head.chunk_size,
                                                      need_gx, need_gw, rw=norms[g], gw=gw_sum[g],
                                                      accumulate=gw_sum[g] is not None, finish=False,
                                                      backend=head.softmax_backend, terms=part)
            lse_all[rows_at] = lse
            total += rows_total.to(total.dtype)
            gw_sum[g] = gw
            if sel is None:
                gx_all = gx
            elif need_gx:
                if gx_all is None:
                    gx_all = gx.new_zeros((xc.shape[0], xc.shape[1]))
                gx_all[sel] = gx
        return gx_all

    def _backward_chunk(self, c, rs, embeds, backward, inv_local, last_local) -> None:
        grad = rs.wait() * inv_local  # (b_c, d)
        if grad.shape[0]:
            emb = embeds[c]
            backward(c, emb, grad.to(emb.dtype), c == last_local)

    def _deliver_weight_grad(self, groups, gw_sum, scale: float) -> None:
        """Hand the active rows' gradients to the weight as the serial path's backward would: a dense
        ``.grad`` (the accumulator itself becomes it, no (L, d) copy) or, for an active subset, through
        autograd (dense rows or a sparse row gradient with lazy updates). Accumulates like backward."""
        head = self.head
        weight = head.weight
        for (rows, index, w), gw in zip(groups, gw_sum):
            if gw is None:
                gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            g = gw.mul_(scale) if gw.dtype == weight.dtype else (gw * scale).to(weight.dtype)
            if index is None:
                if weight.grad is None:
                    weight.grad = g
                else:
                    weight.grad.add_(g)
            else:
                F.embedding(index, weight, sparse=head.update != "dense").backward(g)

    def _keep_for_metrics(self) -> bool:
        cfg, sampler = self.head.sampler_config, self.head.sampler
        every = getattr(cfg, "metrics_interval", 0)
        return bool(every) and torch.is_grad_enabled() and getattr(sampler, "steps", 0) % every == 0

    def _assemble(self, gathers, gathered, positions, n) -> torch.Tensor:
        """The gathered chunks put back in the serial row order: (N, d)."""
        x = None
        for c, pg in enumerate(gathers):
            if pg is None:
                continue
            xc = gathered[c] if gathered[c] is not None else pg.wait()
            gathered[c] = xc
            if x is None:
                x = xc.new_empty((n, xc.shape[1]))
            x[positions[c].to(xc.device)] = xc
        if x is None:  # an empty global batch
            x = torch.empty((0, self.head.embedding_dim), device=self.head.weight.device)
        return x
