"""The uniform fill's random stream: one uniform score per class, drawn on the device, counter-based.

Legend: L classes of the shard.

Every sampled head fills its active set with uniformly drawn classes (active.py): each class of
the shard gets a uniform score in [0, 1) and the highest scores win, so the fill is a uniform
sample without replacement, of a fixed size, in one ``torch.rand`` and one ``topk`` on the device
(Partial FC's pattern). No draw is made on the host and copied up.

The stream is counter-based: draw number t of a stream is made by a generator on the sampler's
device seeded with ``mix(seed, stream, t)`` (a 64-bit mixing of the three integers), so the
state is three integers. It is

* reproducible: the same seed, stream and draw count give the same scores on the same kind of
  device, in any process, after any resume;
* checkpoint-portable: the state (seed, stream, draws) loads on any device and world size;
* different between device kinds: a CPU generator is an mt19937 and a CUDA generator a Philox, so
  one (seed, stream, t) draws other classes on a CPU than on a GPU (docs/head.md says so); a run
  resumed on the other kind continues with the other kind's draws from there on.

``stream`` separates the ranks (and the replicas of a 2-D layout): ranks draw independently.

Captured steps (``graphed``, ds_xc/head/graphs.py): a CUDA graph replays the ``torch.rand`` it
captured with whatever seed its generator holds at replay time, so the step's runner seeds the
generator for the step (:meth:`prepare`) before the step or its replay, and :meth:`scores` only draws.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

__all__ = ["FillStream", "mix_seed"]

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(*values: int) -> int:
    """A generator seed in [0, 2^63) from integers (splitmix64 chained over them)."""
    h = 0
    for v in values:
        h = _splitmix64(h ^ (int(v) & _M64))
    return h >> 1


class FillStream:
    """Uniform scores per class, one draw per training step (see the module docstring)."""

    def __init__(self, seed: int, stream: int, device=None):
        self.seed, self.stream, self.draws = int(seed), int(stream), 0
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._gen: Optional[torch.Generator] = None
        self.graphed = False  # set by HeadStepGraph: prepare() seeds each draw, scores() only draws

    def to(self, device) -> "FillStream":
        """Draw on ``device`` from now on (the counters stay)."""
        device = torch.device(device)
        if device != self.device:
            self.device, self._gen = device, None
        return self

    def _generator(self) -> Optional[torch.Generator]:
        if self.device.type == "meta":
            return None
        if self._gen is None:
            self._gen = torch.Generator(device=self.device)
        return self._gen

    def generator(self) -> Optional[torch.Generator]:
        """The device generator the draws come from (None on the meta device)."""
        return self._generator()

    def prepare(self, draw: Optional[int] = None) -> None:
        """Seed the generator for draw number ``draw`` (default: the next, and count it): host work."""
        if draw is None:
            draw, self.draws = self.draws, self.draws + 1
        gen = self._generator()
        if gen is not None:
            gen.manual_seed(mix_seed(self.seed, self.stream, draw))

    def scores(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (L,) float32 on the stream's device <- draw number ``draws`` of uniform [0, 1)
        scores; advances the counter. Host work only (a seed), no host sync. (``graphed``: the
        runner has seeded the draw with :meth:`prepare`; this only draws.)"""
        if not self.graphed:
            self.prepare()
        return torch.rand(out.shape, generator=self._generator(), out=out)

    def derive(self, salt: int) -> None:
        """A new stream from this one and ``salt`` (a replica that has no saved stream of its own)."""
        self.stream = mix_seed(self.seed, self.stream, self.draws, salt)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "stream": self.stream, "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        """Load a saved stream. A checkpoint of an older revision holds a generator state instead
        (the CPU mt19937 draws of that revision): the stream is then derived from a hash of its
        bytes (deterministic: the same checkpoint resumes with the same draws), and logged."""
        if "draws" in state:
            self.seed, self.stream, self.draws = int(state["seed"]), int(state["stream"]), int(state["draws"])
            return
        raw = state["generator"].detach().to("cpu", torch.uint8).numpy().tobytes()
        digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
        self.stream, self.draws = mix_seed(self.seed, digest), 0
        log.info("sampler fill stream loaded from a generator state of an older checkpoint: a counter-based "
                 "stream is derived from it (stream %d); the negatives drawn from here on differ from that "
                 "revision's", self.stream)
