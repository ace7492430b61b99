"""The global RNG streams of a process (torch CPU and CUDA, numpy, python) in a checkpoint.

ds_xc's own random draws use private generators saved with their owners (samplers,
compression seeds per step); these global streams serve the user's backbone (dropout,
augmentation) and data code, which a resume must continue exactly. One file per rank:
``<tag>/ds_xc_rng/rank_RRRRR_of_WWWWW.pt``.
"""
from __future__ import annotations

import logging
import os
import random
from typing import Optional

import torch

from ds_xc.checkpoint import load_file
from ds_xc.parallel.groups import group_rank, group_size, world_rank_and_size

log = logging.getLogger(__name__)

__all__ = ["RNG_DIR", "rng_file", "rng_state", "read_rng_state", "apply_rng_state"]

RNG_DIR = "ds_xc_rng"


def rng_file(tag_dir: str, group=None) -> str:
    """This rank's RNG state file inside the checkpoint tag ``tag_dir``, named by its rank in ``group``
    (the engine's group; None: the world, or one process)."""
    rank, world = world_rank_and_size() if group is None else (group_rank(group), group_size(group))
    return os.path.join(tag_dir, RNG_DIR, f"rank_{rank:05d}_of_{world:05d}.pt")


def rng_state() -> dict:
    """This process's global RNG states (torch CPU and CUDA, numpy, python), as plain tensors and tuples."""
    import numpy as np
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def read_rng_state(tag_dir: str, group=None) -> Optional[dict]:
    """The RNG states saved in ``tag_dir`` (None when absent), read to the CPU: RNG states are CPU
    ByteTensors, CUDA ones included (``torch.cuda.set_rng_state`` takes a CPU tensor)."""
    path = rng_file(tag_dir, group)
    return load_file(path, "RNG state file", map_location="cpu") if os.path.isfile(path) else None


def apply_rng_state(state: Optional[dict], tag_dir: str, group=None) -> None:
    """Restore the global RNG streams read from ``tag_dir`` (None: the file was absent, warned)."""
    if state is None:
        log.warning("%s is absent (older checkpoint, or another world size): the global torch/numpy/python "
                    "RNG streams are not restored", rng_file(tag_dir, group))
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
                        "restored", rng_file(tag_dir, group), saved, here, min(saved, here))
        for index, cuda_state in enumerate(state["cuda"][:here]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)
