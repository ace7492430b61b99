"""Next-word (or next-word-pair) prediction over the Python standard library's sources:
a real, skewed label distribution with 10^4 to 10^5+ classes that every machine already
has on disk.

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

Bigram mode (``mode="bigram"``): the label is the pair (next word, the word after it)
inside one file, by ds_xc.data.labels.bigram_labels over the word ranks of the whole
corpus: class 0 = other pairs, classes ``1..num_classes-1`` the most frequent pairs (the
stdlib of Python 3.11 has about 9.0e5 distinct pairs, 3.2e5 of them seen twice or more).
Samples whose pair is "other", and each file's last word, are dropped. Inputs use a
word vocabulary of ``vocab_size`` entries (the most frequent words, <unk> = 0, pad id
``vocab_size``).

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
from ds_xc.data.labels import MODES, bigram_labels, check_label_args, pair_names, word_labels

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
UNK = "<unk>"
_WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
DEFAULT_BIGRAM_VOCAB = 20_000  # bigram mode's input vocabulary: the word mode job's 20,000 words
_ARRAYS = {"word": ("stream", "train_pos", "eval_pos", "vocab_bytes", "stats"),
           "bigram": ("stream", "labels", "train_pos", "eval_pos", "words_bytes", "pair_keys", "stats")}
_STATS = ("num_files", "num_heldout_files", "num_tokens", "num_unk_dropped", "num_distinct_pairs")


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


def _layout(rel_paths: list[str], held: set[str], ids: list[np.ndarray], labels: list[np.ndarray],
            context: int, pad: int) -> dict:
    """Files' input ids and labels -> padded ``stream`` and ``labels`` (each file preceded by
    ``context`` pad ids / 0 labels) and the positions of the kept labels (not 0) of the
    training and held-out files, the held-out ones in a fixed pseudo-random order."""
    chunks, label_chunks, train_pos, eval_pos, offset = [], [], [], [], 0
    for rel, ids_f, labels_f in zip(rel_paths, ids, labels):
        chunks += [np.full(context, pad, dtype=np.int32), ids_f]
        label_chunks += [np.zeros(context, dtype=np.int32), labels_f]
        pos = offset + context + np.flatnonzero(labels_f != 0)  # drop <unk> (other) labels
        (eval_pos if rel in held else train_pos).append(pos.astype(np.int64))
        offset += context + len(ids_f)
    eval_all = np.concatenate(eval_pos)
    # Fixed pseudo-random order, so that max_samples picks a sample of all held-out files.
    order = np.argsort(hash_words(torch.arange(len(eval_all)), derive_salt("text-eval"), 1)[:, 0])
    return {"stream": np.concatenate(chunks), "labels": np.concatenate(label_chunks),
            "train_pos": np.concatenate(train_pos), "eval_pos": eval_all[order]}


def tokenise(root: Path, files: list[Path], num_classes: int, context: int, heldout_fraction: float,
             mode: str = "word", vocab_size: int | None = None) -> dict:
    """Read and tokenise the corpus into the cached arrays.

    Returns ``stream`` (int32: each file's input ids preceded by ``context`` pad ids,
    files concatenated), ``train_pos`` / ``eval_pos`` (int64 positions in stream of
    labels that are kept; inputs are the ``context`` entries before) and ``stats``
    (int64, see ``_STATS``). Word mode: the labels are ``stream`` itself, and
    ``vocab_bytes`` holds the newline-joined vocabulary (uint8). Bigram mode: ``labels``
    (int32, aligned with stream), ``pair_keys`` (ds_xc.data.labels.bigram_labels) and
    ``words_bytes`` (every word by rank; the input vocabulary is its first
    ``vocab_size - 1``).
    """
    rel_paths = [p.relative_to(root).as_posix() for p in files]
    held = heldout_files(rel_paths, heldout_fraction)
    words = [_WORD.findall(p.read_bytes()) for p in files]
    counts: collections.Counter = collections.Counter()
    for ws in words:
        counts.update(ws)  # per-file update runs in C
    num_tokens = sum(len(ws) for ws in words)
    if mode == "bigram":
        return _tokenise_pairs(rel_paths, held, words, counts, num_classes, context, vocab_size, num_tokens)
    vocab = build_vocabulary(counts, num_classes)
    lookup = {w.encode("ascii"): i for i, w in enumerate(vocab) if i > 0}
    ids = [np.array(list(map(lookup.get, ws, itertools.repeat(0, len(ws)))), dtype=np.int32) for ws in words]
    arrays = _layout(rel_paths, held, ids, ids, context, pad=len(vocab))
    del arrays["labels"]  # the stream itself
    stats = [len(files), len(held), num_tokens, int((arrays["stream"] == 0).sum())]
    return dict(arrays, vocab_bytes=np.frombuffer("\n".join(vocab).encode("ascii"), dtype=np.uint8),
                stats=np.array(stats, dtype=np.int64))


def _tokenise_pairs(rel_paths, held, words, counts, num_classes, context, vocab_size, num_tokens) -> dict:
    """Bigram mode of ``tokenise``: every word by frequency rank, the pair labels of
    ds_xc.data.labels over the whole stream (pairs never cross a file), inputs truncated to
    the ``vocab_size`` input vocabulary."""
    ranked = build_vocabulary(counts, len(counts) + 1)[1:]  # every word, most frequent first
    rank_of = {w.encode("ascii"): r for r, w in enumerate(ranked)}
    ranks = [np.array(list(map(rank_of.__getitem__, ws)), dtype=np.int32) for ws in words]
    starts = np.cumsum([0] + [len(r) for r in ranks])  # (files + 1,)
    rank_stream = np.concatenate(ranks) if ranks else np.zeros(0, np.int32)
    labels, pair_keys, num_pairs = bigram_labels(rank_stream, starts[:-1], len(ranked), num_classes)
    vocab = min(vocab_size or DEFAULT_BIGRAM_VOCAB, 1 + len(ranked))
    ids = word_labels(rank_stream, vocab)
    split = starts[1:-1]
    arrays = _layout(rel_paths, held, np.split(ids, split), np.split(labels, split), context, pad=vocab)
    stats = [len(rel_paths), len(held), num_tokens, int((labels == 0).sum()), num_pairs]
    return dict(arrays, pair_keys=pair_keys, stats=np.array(stats, dtype=np.int64),
                words_bytes=np.frombuffer("\n".join(ranked).encode("ascii"), dtype=np.uint8))


def _cache_key(root: Path, files: list[Path], num_classes: int, context: int, heldout_fraction: float,
               mode: str = "word", vocab_size: int | None = None) -> str:
    """Directory name covering everything the arrays depend on, sources included (word
    mode: the key it always had, so existing caches stay valid)."""
    stats = [p.stat() for p in files]
    fields = {
        "format": FORMAT_VERSION, "python": platform.python_version(), "root": str(root),
        "num_classes": num_classes, "context": context, "heldout_fraction": heldout_fraction,
        "sources": [len(files), sum(s.st_size for s in stats),
                    max((s.st_mtime_ns for s in stats), default=0)],
    }
    tag = ""
    if mode != "word":
        fields.update(mode=mode, vocab_size=vocab_size or DEFAULT_BIGRAM_VOCAB)
        tag = f"-{mode}{vocab_size or DEFAULT_BIGRAM_VOCAB}"
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return f"v{FORMAT_VERSION}-c{num_classes}-k{context}{tag}-{digest}"


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


def _load(path: Path, mode: str) -> dict | None:
    """The cached arrays of ``mode``, or None when missing or unreadable."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in _ARRAYS[mode]}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        logger.warning("ignoring unreadable text cache %s (%s); rebuilding", path, err)
        return None


class TextDataset(PositionDataset):
    """Predict a word (or the pair of the next two words) of the Python standard library
    from the ``context`` words before it.

    Args:
        num_classes: word mode: vocabulary size including <unk> (labels lie in [1, V),
            V <= num_classes); bigram mode: pair classes including "other" (labels in
            [1, num_label_classes)).
        context: number of previous words given as input.
        seed: selects the training sample order (not the data or the split).
        root: folder of ``.py`` files (default: the standard library).
        heldout_fraction: fraction of files held out for evaluation, in (0, 1).
        cache_dir: parent folder of the cache (default: see ``default_cache_dir``).
        mode: ``"word"`` (next word) or ``"bigram"`` (next word pair, ds_xc.data.labels).
        vocab_size: bigram mode: input vocabulary with <unk> (default
            ``DEFAULT_BIGRAM_VOCAB``); word mode: None or ``num_classes``.
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
        mode: str = "word",
        vocab_size: int | None = None,
    ) -> None:
        _check_args(num_classes, context, heldout_fraction, mode, vocab_size)
        self.root = Path(root).resolve() if root is not None else default_root()
        if not self.root.is_dir():
            raise ValueError(f"root={str(root)!r} is invalid: not a directory")
        self.num_classes, self.context, self.seed = int(num_classes), int(context), int(seed)
        self.heldout_fraction, self.mode = float(heldout_fraction), mode
        vocab_size = None if mode == "word" or vocab_size is None else int(vocab_size)
        files = list_sources(self.root)
        key = _cache_key(self.root, files, self.num_classes, self.context, self.heldout_fraction, mode, vocab_size)
        self.cache_path = Path(cache_dir or default_cache_dir()) / key / "data.npz"
        arrays = _load(self.cache_path, mode)
        if arrays is None:
            start = time.perf_counter()
            arrays = tokenise(self.root, files, self.num_classes, self.context, self.heldout_fraction,
                              mode, vocab_size)
            save_arrays_atomic(self.cache_path, arrays)
            logger.info("tokenised %s in %.1f s, cached at %s",
                        self.root, time.perf_counter() - start, self.cache_path)
        else:
            logger.info("loaded tokenised %s from %s", self.root, self.cache_path)
        self._stream = torch.from_numpy(arrays["stream"])  # int32: half the memory
        self._stats = dict(zip(_STATS, (int(v) for v in arrays["stats"])))
        if mode == "word":
            self.vocab = arrays["vocab_bytes"].tobytes().decode("ascii").split("\n")
            self._labels, self._pair_keys, self._words = self._stream, None, self.vocab[1:]
            self.num_label_classes = len(self.vocab)
        else:
            self._words = arrays["words_bytes"].tobytes().decode("ascii").split("\n") if arrays["words_bytes"].size else []
            self.vocab = [UNK] + self._words[: min(vocab_size or DEFAULT_BIGRAM_VOCAB, 1 + len(self._words)) - 1]
            self._labels, self._pair_keys = torch.from_numpy(arrays["labels"]), arrays["pair_keys"]
            self.num_label_classes = min(self.num_classes, 1 + self._stats["num_distinct_pairs"])
        self.pad_id = len(self.vocab)
        self.input_dim = self.pad_id + 1
        self._train_pos = torch.from_numpy(arrays["train_pos"])
        self._eval_pos = torch.from_numpy(arrays["eval_pos"])
        self._salt = derive_salt("ds_xc.text", self.seed, "train")
        if self.num_label_classes < self.num_classes:
            what = "distinct words" if mode == "word" else "distinct word pairs"
            logger.warning("text corpus has only %d %s: labels use %d of %d classes",
                           self.num_label_classes - 1, what, self.num_label_classes, self.num_classes)
        if len(self._train_pos) == 0 or len(self._eval_pos) == 0:
            raise ValueError(f"root={str(self.root)!r} gives an empty split: "
                             f"{len(self._train_pos)} train, {len(self._eval_pos)} held-out samples")

    def _gather(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(N,) label positions -> inputs (N, context) int64, labels (N,) int64."""
        window = torch.arange(-self.context, 0, dtype=torch.int64)  # (K,)
        inputs_NK = self._stream[pos[:, None] + window[None, :]]
        return inputs_NK.long(), self._labels[pos].long()

    def decode(self, ids: Tensor) -> list[str]:
        """Word of each input id (pad id -> "<pad>"), for inspection."""
        return [self.vocab[i] if i < self.pad_id else "<pad>" for i in ids.tolist()]

    def decode_labels(self, labels: Tensor) -> list[str]:
        """Text of each label: a word, or "word word" in bigram mode (0 -> "<unk>")."""
        if self._pair_keys is None:
            return self.decode(labels)
        return pair_names(labels.tolist(), self._pair_keys, self._words)

    def describe(self) -> dict:
        """Mode, sizes, split and drop statistics (num_unk_dropped: labels dropped as <unk>
        words, or in bigram mode as other pairs and files' last words)."""
        return {
            "name": self.name, "mode": self.mode, "num_classes": self.num_classes,
            "num_label_classes": self.num_label_classes, "vocab_size": len(self.vocab),
            "input_kind": self.input_kind, "input_dim": self.input_dim, "pad_id": self.pad_id,
            "context": self.context, "seed": self.seed, "root": str(self.root),
            "heldout_fraction": self.heldout_fraction, "num_distinct_pairs": None, **self._stats,
            "unk_rate": self._stats["num_unk_dropped"] / max(1, self._stats["num_tokens"]),
            "num_train": len(self._train_pos), "num_eval": len(self._eval_pos),
            "cache_path": str(self.cache_path),
        }


def _check_args(num_classes, context, heldout_fraction, mode, vocab_size) -> None:
    """TextDataset's argument checks: each error names the argument, its value and what is allowed."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction!r} is invalid: must be in (0, 1)")
    check_label_args(num_classes, context, mode, vocab_size)
