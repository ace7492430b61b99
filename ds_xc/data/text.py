"""Next-word prediction over the Python standard library's sources: a real, skewed,
moderately large label distribution that every machine already has on disk.

Corpus: every ``*.py`` file under ``root`` (default: ``sysconfig.get_paths()['stdlib']``),
recursively, skipping anything under ``site-packages`` / ``dist-packages``, in sorted
path order. Words are the matches of ``[A-Za-z_][A-Za-z0-9_]*`` (on bytes; non-ASCII
identifiers split into their ASCII pieces).

Vocabulary: id 0 = ``<unk>``, then the ``num_classes - 1`` most frequent words of the
whole corpus, ties broken by byte (ASCII) order. It has ``V = min(num_classes, 1 +
distinct words)`` entries. Inputs are the ``context`` previous word ids; positions
before the start of a file hold the padding id ``V``, so the input vocabulary has
``input_dim = V + 1`` entries. Labels are the next word id, in ``[1, V)``: samples
whose label is ``<unk>`` are dropped (from both splits), so accuracy is about real
words; ``describe()`` reports how many.

Held-out split: whole files, chosen by a hash of their path relative to ``root``
(the ``round(heldout_fraction * num_files)`` files with the smallest hash, at least
one, never all). Tokenised arrays are cached in ``cache_dir/<key>/data.npz``, written
atomically (temporary file + ``os.replace``), so concurrent ranks never read a
half-written file.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import logging
import os
import platform
import re
import sysconfig
import time
import uuid
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ds_xc.data.base import (
    PositionDataset,
    derive_salt,
    hash_words,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
UNK = "<unk>"
_WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_ARRAYS = ("stream", "train_pos", "eval_pos", "vocab_bytes", "stats")
_STATS = ("num_files", "num_heldout_files", "num_tokens", "num_unk_dropped")


def default_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ds_xc/text``, else ``~/.cache/ds_xc/text``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds_xc" / "text"


def list_sources(root: Path) -> list[Path]:
    """Sorted ``*.py`` files under root, not descending into site-packages / dist-packages
    (pruning them keeps the walk at ~25 ms; symlinked folders are not followed)."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(p for p in found if p.is_file())


def heldout_files(rel_paths: list[str], heldout_fraction: float) -> set[str]:
    """The held-out files: those with the smallest sha1 of their relative path."""
    if len(rel_paths) < 2:
        raise ValueError(f"need at least 2 source files for a train/held-out split, got {len(rel_paths)}")
    num = min(max(1, round(heldout_fraction * len(rel_paths))), len(rel_paths) - 1)
    ordered = sorted(rel_paths, key=lambda r: hashlib.sha1(r.encode()).hexdigest())
    return set(ordered[:num])


def build_vocabulary(counts: collections.Counter, num_classes: int) -> list[str]:
    """[<unk>] + the num_classes - 1 most frequent words, ties broken by byte order."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: num_classes - 1]
    return [UNK] + [w.decode("ascii") for w, _ in ranked]


def tokenise(
    root: Path, files: list[Path], num_classes: int, context: int, heldout_fraction: float
) -> dict:
    """Read and tokenise the corpus into the cached arrays.

    Returns ``stream`` (int32: each file's ids preceded by ``context`` pad ids, files
    concatenated), ``train_pos`` / ``eval_pos`` (int64 positions in stream of labels
    that are not <unk>; inputs are the ``context`` entries before), ``vocab_bytes``
    (newline-joined vocabulary, uint8) and ``stats`` (int64, see ``_STATS``).
    """
    rel_paths = [p.relative_to(root).as_posix() for p in files]
    held = heldout_files(rel_paths, heldout_fraction)
    words = [_WORD.findall(p.read_bytes()) for p in files]
    counts: collections.Counter = collections.Counter()
    for ws in words:
        counts.update(ws)  # per-file update runs in C
    vocab = build_vocabulary(counts, num_classes)
    lookup = {w.encode("ascii"): i for i, w in enumerate(vocab) if i > 0}
    pad = len(vocab)
    chunks, train_pos, eval_pos, offset = [], [], [], 0
    for rel, ws in zip(rel_paths, words):
        ids = np.array(list(map(lookup.get, ws, itertools.repeat(0, len(ws)))), dtype=np.int32)
        chunks += [np.full(context, pad, dtype=np.int32), ids]
        pos = offset + context + np.flatnonzero(ids != 0)  # drop <unk> labels
        (eval_pos if rel in held else train_pos).append(pos.astype(np.int64))
        offset += context + len(ids)
    stream = np.concatenate(chunks)
    eval_all = np.concatenate(eval_pos)
    # Fixed pseudo-random order, so that max_samples picks a sample of all held-out files.
    order = np.argsort(hash_words(torch.arange(len(eval_all)), derive_salt("text-eval"), 1)[:, 0])
    num_tokens = sum(len(ws) for ws in words)
    stats = [len(files), len(held), num_tokens, int((stream == 0).sum())]
    return {
        "stream": stream,
        "train_pos": np.concatenate(train_pos),
        "eval_pos": eval_all[order],
        "vocab_bytes": np.frombuffer("\n".join(vocab).encode("ascii"), dtype=np.uint8),
        "stats": np.array(stats, dtype=np.int64),
    }


def _cache_key(
    root: Path, files: list[Path], num_classes: int, context: int, heldout_fraction: float
) -> str:
    """Directory name covering everything the arrays depend on, sources included."""
    stats = [p.stat() for p in files]
    fields = {
        "format": FORMAT_VERSION, "python": platform.python_version(), "root": str(root),
        "num_classes": num_classes, "context": context, "heldout_fraction": heldout_fraction,
        "sources": [len(files), sum(s.st_size for s in stats),
                    max((s.st_mtime_ns for s in stats), default=0)],
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return f"v{FORMAT_VERSION}-c{num_classes}-k{context}-{digest}"


def save_arrays_atomic(path: Path, arrays: dict) -> None:
    """np.savez to a unique temporary file in the same directory, then os.replace (the data sets' caches)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> dict | None:
    """The cached arrays, or None when missing or unreadable."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in _ARRAYS}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        logger.warning("ignoring unreadable text cache %s (%s); rebuilding", path, err)
        return None


class TextDataset(PositionDataset):
    """Predict a word of the Python standard library from the ``context`` words before it.

    Args:
        num_classes: vocabulary size including <unk> (labels lie in [1, V), V <= num_classes).
        context: number of previous words given as input.
        seed: selects the training sample order (not the data or the split).
        root: folder of ``.py`` files (default: the standard library).
        heldout_fraction: fraction of files held out for evaluation, in (0, 1).
        cache_dir: parent folder of the cache (default: see ``default_cache_dir``).
    """

    name = "text"
    input_kind = "tokens"

    def __init__(
        self,
        num_classes: int,
        context: int = 4,
        seed: int = 0,
        root: str | os.PathLike | None = None,
        heldout_fraction: float = 0.02,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        if int(num_classes) != num_classes or num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} is invalid: must be an integer >= 2")
        if int(context) != context or context < 1:
            raise ValueError(f"context={context!r} is invalid: must be an integer >= 1")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={heldout_fraction!r} is invalid: must be in (0, 1)")
        self.root = Path(root).resolve() if root is not None else default_root()
        if not self.root.is_dir():
            raise ValueError(f"root={str(root)!r} is invalid: not a directory")
        self.num_classes, self.context, self.seed = int(num_classes), int(context), int(seed)
        self.heldout_fraction = float(heldout_fraction)
        files = list_sources(self.root)
        key = _cache_key(self.root, files, self.num_classes, self.context, self.heldout_fraction)
        self.cache_path = Path(cache_dir or default_cache_dir()) / key / "data.npz"
        arrays = _load(self.cache_path)
        if arrays is None:
            start = time.perf_counter()
            arrays = tokenise(
                self.root, files, self.num_classes, self.context, self.heldout_fraction)
            save_arrays_atomic(self.cache_path, arrays)
            logger.info("tokenised %s in %.1f s, cached at %s",
                        self.root, time.perf_counter() - start, self.cache_path)
        else:
            logger.info("loaded tokenised %s from %s", self.root, self.cache_path)
        self.vocab = arrays["vocab_bytes"].tobytes().decode("ascii").split("\n")
        self.pad_id = len(self.vocab)
        self.input_dim = self.pad_id + 1
        self._stream = torch.from_numpy(arrays["stream"])  # int32: half the memory
        self._train_pos = torch.from_numpy(arrays["train_pos"])
        self._eval_pos = torch.from_numpy(arrays["eval_pos"])
        self._stats = dict(zip(_STATS, (int(v) for v in arrays["stats"])))
        self._salt = derive_salt("ds_xc.text", self.seed, "train")
        if len(self.vocab) < self.num_classes:
            logger.warning("text corpus has only %d distinct words: labels use %d of %d classes",
                           len(self.vocab) - 1, len(self.vocab), self.num_classes)
        if len(self._train_pos) == 0 or len(self._eval_pos) == 0:
            raise ValueError(f"root={str(self.root)!r} gives an empty split: "
                             f"{len(self._train_pos)} train, {len(self._eval_pos)} held-out samples")

    def _gather(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(N,) label positions -> inputs (N, context) int64, labels (N,) int64."""
        window = torch.arange(-self.context, 0, dtype=torch.int64)  # (K,)
        inputs_NK = self._stream[pos[:, None] + window[None, :]]
        return inputs_NK.long(), self._stream[pos].long()

    def decode(self, ids: Tensor) -> list[str]:
        """Word of each id (pad id -> "<pad>"), for inspection."""
        return [self.vocab[i] if i < self.pad_id else "<pad>" for i in ids.tolist()]

    def describe(self) -> dict:
        """Sizes, split and <unk> statistics."""
        return {
            "name": self.name, "num_classes": self.num_classes, "vocab_size": len(self.vocab),
            "input_kind": self.input_kind, "input_dim": self.input_dim, "pad_id": self.pad_id,
            "context": self.context, "seed": self.seed, "root": str(self.root),
            "heldout_fraction": self.heldout_fraction, **self._stats,
            "unk_rate": self._stats["num_unk_dropped"] / max(1, self._stats["num_tokens"]),
            "num_train": len(self._train_pos), "num_eval": len(self._eval_pos),
            "cache_path": str(self.cache_path),
        }
