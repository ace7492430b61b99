"""The checkpointed state of a CompressedOptimizer: its step counter, traffic counters, and
this rank's error-feedback residuals, momentum and thresholds.

A mixin of :class:`ds_xc.compression.optimizer.CompressedOptimizer` (it reads the
optimizer's ``_params``, ``_buffers``, ``_tally``, ``counter``, ``nodes``, ``group``); kept
apart so that the reduction and its checkpoint format each have one home.
:mod:`ds_xc.compression.checkpoint` writes these states as one file per rank.
"""
from __future__ import annotations

import logging

import torch

from ds_xc.parallel.agree import agree, all_or_none
from ds_xc.parallel.groups import group_rank

log = logging.getLogger(__name__)

__all__ = ["CompressionState", "BUFFERS", "STATE_FORMAT"]

STATE_FORMAT = 1
BUFFERS = ("residual", "momentum")  # per-tensor views into the flat buffers (copied into, never replaced)


class CompressionState:
    """``state_dict`` / ``load_state_dict`` and the compression part of them, for CompressedOptimizer."""

    def compression_state_dict(self, rank_state: bool = True) -> dict:
        """The wrapper's own state; ``rank_state`` adds this rank's residuals and thresholds."""
        out = {"format": STATE_FORMAT, "method": self.config.method, "world_size": self.world_size,
               "ranks_per_node": self.nodes.local_size if self.nodes is not None else 1,
               "rank": group_rank(self.group), "step": self._step, "resync": self._resync,
               "numels": [p.numel() for p in self._params],
               "counters": dict(self.counter.snapshot(), **self._tally)}
        if rank_state:
            out["state"] = {i: dict(self.state[p]) for i, p in enumerate(self._params) if self.state[p]}
        return out

    def load_compression_state_dict(self, state: dict) -> None:
        """Restore :meth:`compression_state_dict`; another world size restarts the residuals (warning)."""
        self._check_compatible(state)
        self._step = int(state["step"])
        self._resync = bool(state.get("resync", False))
        counters = dict(state.get("counters", {}))
        for key in self._tally:
            self._tally[key] = int(counters.pop(key, 0))
        for key, value in counters.items():
            setattr(self.counter, key, int(value))
        ranks_per_node = self.nodes.local_size if self.nodes is not None else 1
        if (state["world_size"], state["ranks_per_node"]) != (self.world_size, ranks_per_node):
            log.warning("compression state saved on %d ranks (%d per node), resumed on %d (%d per node): "
                        "error-feedback residuals and thresholds restart from zero", state["world_size"],
                        state["ranks_per_node"], self.world_size, ranks_per_node)
            self.restart_rank_state()
            return
        for i, saved in state.get("state", {}).items():
            tstate = self.state[self._params[int(i)]]
            for key, value in saved.items():
                if key in BUFFERS:
                    if key in tstate:
                        tstate[key].copy_(value)
                else:
                    tstate[key] = value.clone() if torch.is_tensor(value) else value

    def check_compression_state(self, state) -> None:
        """Raise ValueError when ``state`` is not a compression state this optimizer can load
        (format, the number and sizes of its tensors, world size and step fields); changes nothing."""
        if not isinstance(state, dict):
            raise ValueError(f"compression state is a {type(state).__name__}; expected a dict")
        missing = [k for k in ("format", "numels", "step", "world_size", "ranks_per_node") if k not in state]
        if missing:
            raise ValueError(f"compression state lacks {missing}")
        self._check_compatible(state)

    def _check_compatible(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"compression state format {state.get('format')!r}: expected {STATE_FORMAT}")
        numels = [p.numel() for p in self._params]
        if list(state["numels"]) != numels:
            raise ValueError(f"compression state holds {len(state['numels'])} tensors of sizes "
                             f"{state['numels'][:8]}...; this optimizer reduces {len(numels)} of sizes {numels[:8]}...")

    def restart_rank_state(self) -> None:
        """Zero this rank's residuals and momentum and forget its thresholds (they no longer
        describe the gradients: another world size, or a skipped step whose buckets were sent)."""
        for buf in self._buffers.values():
            buf.zero_()
        for p in self._params:
            for key in [k for k in self.state[p] if k not in BUFFERS]:
                del self.state[p][key]

    def state_dict(self) -> dict:
        """{"inner": the wrapped optimizer's state_dict, "compression": the wrapper's state}."""
        return {"inner": self.inner.state_dict(),
                "compression": self.compression_state_dict(rank_state=self.rank_state_in_state_dict)}

    def load_state_dict(self, state_dict: dict, **kwargs) -> None:
        """Load both parts; ``kwargs`` go to the wrapped optimizer (DeepSpeed passes some).

        Collective over ``self.group`` (DeepSpeed calls it on every rank): the ranks check the
        compression part and agree on the outcome and the step before anything is loaded."""
        if not ("inner" in state_dict and "compression" in state_dict):
            log.warning("optimizer state without a 'compression' part (saved uncompressed?): loading it into "
                        "the wrapped optimizer; error-feedback residuals start from zero")
            self.inner.load_state_dict(state_dict, **kwargs)
            self.param_groups = self.inner.param_groups  # torch's load installs a new list
            return
        with all_or_none("CompressedOptimizer.load_state_dict (checking the compression state)", self.group):
            self.check_compression_state(state_dict["compression"])  # before anything is loaded
        agree(int(state_dict["compression"]["step"]), "the compression step of the optimizer state being loaded",
              self.group)
        self.inner.load_state_dict(state_dict["inner"], **kwargs)
        self.param_groups = self.inner.param_groups  # torch's load installs a new list: LR schedulers see it
        self.load_compression_state_dict(state_dict["compression"])
