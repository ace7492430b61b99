"""CUDA graphs of the head's step: forward, the head's backward and the head optimizer step, captured once
and replayed (``extreme_classification.cuda_graphs``).

Legend: B rows of the step, d embedding dim.

A sampled head's step launches a hundred or more small kernels; on a GPU the host's launch time, not the
arithmetic, sets the step time (docs/head.md, "The GPU step"). A CUDA graph replays all of them with one
launch. What a graph needs, the step gives (the CPU proxies of tests/test_step_counts.py and the replay
check of tests/test_graphs.py hold it there):

* no host sync and static shapes: the input check only on every ``check_interval``-th step, the active set
  of a fixed size, retrieval and catch-up without data-dependent sizes;
* the same kernels with the same arguments and addresses at every replay: every per-step scalar is a
  device tensor in a captured step (``graphed``): the learning rates (filled by the optimizer's
  ``prepare_graphed_step`` before each step or replay), the lazy_exact step count and AdamW's, the
  lazy_exact products updated in place, the rows to re-encode and the unchecked-label count kept at one
  address; the uniform fill's generator is seeded for the step before it (fill.py) and registered with
  the graph, as is the bf16 updates' stochastic-rounding generator (its stream advances per replay as
  per eager step);
* the host side of a step (counters that decide checks, rebuilds and the periodic catch-up) advanced by
  ``after_replay`` of the head, its sampler and its optimizer.

Steps with host work run eagerly, in the same (graphed) code path: a full input check, an index or graph
(re)build and its adoption, a metrics pass, lazy_exact's catch-up of every row every 1,024 steps. A graph
whose buffers such a step replaced (an index rebuild) is captured again at the next plain step.

:class:`HeadStepGraph` takes this rank's rows ``(B, d)`` and labels ``(B,)`` and returns the loss and the
gradient of the loss with respect to the rows, for the backbone's backward (``rows.backward(grad)``),
torchtitan's ChunkedLossWrapper pattern. It captures on CUDA; elsewhere it runs the same graphed code
eagerly, step by step (which is what tests compare against the plain eager head).

What it cannot capture, it refuses with an error naming ``extreme_classification.cuda_graphs``: more than
one rank in the head's group (collectives of a gloo group cannot be captured; NCCL capture is not done
here), a 2-D layout or a node gather, the Triton softmax backend, every step checked (``check_interval`` 1 with ``check_inputs``), and for the ANN
sampler sample groups, ``encode_interval`` other than 1, background rebuilds and the scan backends with
data-dependent sizes (torch, faiss).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ds_xc import config as cfg

log = logging.getLogger(__name__)

__all__ = ["HeadStepGraph", "KEY", "refusal"]

KEY = f"{cfg.HEAD_SECTION}.cuda_graphs"


def refusal(head, optimizer) -> Optional[str]:
    """Why this head's step cannot be captured (None: it can); the error of :class:`HeadStepGraph`."""
    from ds_xc.head.optim import HeadAdamW, HeadSGD
    if head.world_size > 1 or head.replicas.active or head.node_gather is not None:
        return (f"the head's group has {head.world_size} rank(s) (replicas: {head.replicas.size}); a graph is captured "
                "on one rank (gloo collectives cannot be captured)")
    if head.softmax_backend != "torch":
        return f"softmax_backend {head.softmax_backend!r} is not captured; use softmax_backend 'torch'"
    if head.check_inputs and head.check_interval == 1:
        return ("every step runs the full input check (check_interval 1), a host sync; set check_interval > 1 "
                "(the checked steps run eagerly)")
    if not isinstance(optimizer, (HeadSGD, HeadAdamW)):
        return f"the head optimizer is a {type(optimizer).__name__}; graphs capture ds_xc's HeadSGD and HeadAdamW"
    c = head.sampler_config
    if c.type == "ann" and (c.groups != 1 or c.encode_interval != 1 or c.background_rebuild):
        return (f"the ann sampler with groups {c.groups}, encode_interval {c.encode_interval}, background_rebuild "
                f"{c.background_rebuild}; captured steps need groups 1, encode_interval 1, background_rebuild false")
    if c.type == "ann" and c.backend in ("torch", "faiss"):
        return (f"the ann sampler's backend {c.backend!r} scans with data-dependent sizes; captured steps need "
                "backend 'auto', 'cuda' or 'triton'")
    return None


class HeadStepGraph:
    """The head's training step (forward, backward, optimizer step) as a CUDA graph (module docstring).

    Args:
        head: a :class:`ds_xc.ClassParallelHead` on one rank.
        optimizer: its :class:`HeadSGD` / :class:`HeadAdamW` (``build_head_optimizer``).
        rows: B, the rows of every step (fixed: a graph has static shapes).
        warmup: eager steps before the first capture (allocator and cuBLAS warm-up; also what a fresh
            index or graph needs).
    """

    def __init__(self, head, optimizer, rows: int, warmup: int = 3):
        why = refusal(head, optimizer)
        if why is not None:
            raise cfg.ConfigError(f"{KEY}: {why}")
        if rows < 1:
            raise cfg.ConfigError(f"{KEY}: the step needs at least one row, got rows={rows}")
        self.head, self.optimizer, self.rows = head, optimizer, int(rows)
        self.cuda = head.weight.is_cuda
        optimizer.graphed = head.sampler.graphed = head.sampler.fill.graphed = True
        dev = head.weight.device
        self.x = torch.zeros((self.rows, head.embedding_dim), dtype=head.weight.dtype, device=dev, requires_grad=True)
        self.y = torch.zeros(self.rows, dtype=torch.int64, device=dev)
        self.warmup = int(warmup)
        self.graph = None
        self._buffers = None  # data pointers of the head's upkeep state when the graph was captured
        self.replays = self.eager_steps = self.captures = 0
        self.loss: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None

    def step(self, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One training step: (loss (), d loss / d embeddings (B, d)); the head's weights updated."""
        if tuple(embeddings.shape) != tuple(self.x.shape) or tuple(labels.shape) != (self.rows,):
            raise ValueError(f"{KEY}: the captured step takes embeddings {tuple(self.x.shape)} and labels "
                             f"({self.rows},), got {tuple(embeddings.shape)} and {tuple(labels.shape)}")
        with torch.no_grad():
            self.x.copy_(embeddings)
            self.y.copy_(labels)
        self.optimizer.prepare_graphed_step()
        self.head.sampler.fill.prepare()
        if not self.cuda or self.warmup > 0 or self.head.host_work_due() or self.optimizer.exact_host_work_due():
            self.warmup = max(0, self.warmup - 1)
            return self._eager()
        if self.graph is None or self._buffers != self._upkeep_buffers():
            self._capture()  # the capture runs the step's host side once; its kernels run in the replay below
        else:
            self.head.after_replay()
            self.optimizer.after_replay()
        self.graph.replay()
        self.replays += 1
        return self.loss, self.grad

    def _eager(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step run eagerly (the same graphed code path), e.g. when it does host work."""
        self.eager_steps += 1
        self.x.grad = None
        loss = self.head(self.x, self.y, batch_sizes=[self.rows])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), self.x.grad

    def _upkeep_buffers(self) -> tuple:
        """Addresses of the tensors index or graph upkeep replaces (a rebuild): a graph that read the old ones
        is captured again."""
        s = self.head.sampler
        tensors = [getattr(s, "graph", None)]
        index = getattr(s, "index", None)
        if index is not None:
            tensors += [index.projection, index.centroids, index.list_offsets, index.list_ids, index.list_codes,
                        index.position]
        return tuple(None if t is None else t.data_ptr() for t in tensors)

    def _capture(self) -> None:
        self.captures += 1
        head, opt = self.head, self.optimizer
        graph = torch.cuda.CUDAGraph()
        gen = head.sampler.fill.generator()
        register = getattr(graph, "register_generator_state", None)
        if register is None:
            raise cfg.ConfigError(f"{KEY}: this torch ({torch.__version__}) cannot register a private generator with "
                                  "a CUDA graph (CUDAGraph.register_generator_state); use a newer torch or "
                                  "cuda_graphs false")
        register(gen)
        rounding = opt.rounding_generator()
        if rounding is not None:  # bf16 stochastic rounding: made at the warm-up steps
            register(rounding)
        self.x.grad = None
        head.weight.grad = None
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            loss = head(self.x, self.y, batch_sizes=[self.rows])
            loss.backward()
            opt.step()
        self.graph, self.loss, self.grad = graph, loss.detach(), self.x.grad
        self._held = (head.weight.grad,)  # the captured gradient's memory stays the graph's
        head.weight.grad = None
        self._buffers = self._upkeep_buffers()
        head.sampler.fill.prepare(head.sampler.fill.draws - 1)  # the capture's draw, seeded again for its replay
        log.info("%s: the head's step captured (%d rows; capture %d)", KEY, self.rows, self.captures)
