"""Next-word (or next-word-pair) prediction over real English and technical prose taken
from Debian packages: a Zipfian label distribution with 10^4 to 10^6+ classes and about
10^7 training samples.

Sources (``SOURCES``; fetched by ``ds_xc.data.debian``, unpacked under ``root/KEY``):

* ``gcide``: ``usr/share/dictd/gcide.dict.dz`` of dict-gcide (dictzip = gzip), the
  GNU Collaborative International Dictionary of English; the pronunciation fields
  ``\\Ab*do"men\\`` are removed (their stress marks would split words into syllables).
* ``linux-doc``: ``usr/share/doc/linux-doc-*/html/_sources/**/*.rst.txt`` of
  linux-doc-X.Y, the reStructuredText of the kernel documentation.
* ``python-doc``: ``usr/share/doc/python3.X/html/_sources/**/*.rst.txt`` of
  python3.X-doc, the reStructuredText of the Python documentation.

Words: ``[a-z_][a-z0-9_]*`` on the lowercased bytes (text.py's pattern, lowercased;
non-ASCII letters split words). Every word gets its frequency rank over the whole
corpus (ties by byte order); the tokenised corpus (ranks, file starts, words, counts)
is cached once and every vocabulary size and mode is derived from it in seconds.

Documents and split: each file is cut into blocks of ``block_words`` words; a block is
a document (the input context never reaches back before its start: pad ids). The
held-out blocks are the ``round(heldout_fraction * num_blocks)`` blocks with the
smallest hash of (file path, block number); they do not depend on the seed.

Modes:

* ``word``: vocabulary = id 0 ``<unk>`` + the ``num_classes - 1`` most frequent words;
  the label is the next word's id, in ``[1, V)``.
* ``bigram``: the label is the pair (next word, the word after it) inside one block;
  class 0 = other pairs, classes ``1..num_classes-1`` the most frequent pairs over the
  whole corpus (ties by the pair of word ranks). Inputs use a word vocabulary of
  ``vocab_size`` entries.

In both modes samples whose label is ``<unk>`` / other are **dropped** (from both
splits): labels lie in ``[1, num_label_classes)``. Inputs may hold ``<unk>`` (0) and the
pad id ``V_in`` (``input_dim = V_in + 1``).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
import logging
import os
import re
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from torch import Tensor

from ds_xc.data import debian
from ds_xc.data.base import (
    PositionDataset,
    derive_salt,
    hash_words,
    mix64,
)
from ds_xc.data.labels import MODES, bigram_labels, check_label_args, pair_names, word_labels
from ds_xc.data.text import save_arrays_atomic

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
UNK = "<unk>"
DEFAULT_BIGRAM_VOCAB = 100_000
_WORD = re.compile(rb"[a-z_][a-z0-9_]*")
_PRONUNCIATION = re.compile(rb"\\[^\\\n]{1,80}\\")  # gcide: \Ab*do"men\ after the headword
_ARRAYS = ("stream", "doc_starts", "doc_names", "words", "counts")


def read_plain(path: Path) -> bytes:
    return path.read_bytes()


def read_gcide(path: Path) -> bytes:
    """The dictionary text without its pronunciation fields (dictzip is gzip-compatible)."""
    with gzip.open(path, "rb") as f:
        return _PRONUNCIATION.sub(b" ", f.read())


@dataclasses.dataclass(frozen=True)
class CorpusSource:
    """Which files of an unpacked package are text, and how to read them."""

    package: str  # key in debian.PACKAGES, also the folder under root
    globs: tuple[str, ...]
    reader: Callable[[Path], bytes]
    licence: str


SOURCES: dict[str, CorpusSource] = {
    "gcide": CorpusSource("gcide", ("usr/share/dictd/gcide.dict.dz",), read_gcide, "GPL-2.0-or-later"),
    "linux-doc": CorpusSource(
        "linux-doc", ("usr/share/doc/linux-doc-*/html/_sources/**/*.rst.txt",), read_plain,
        "GPL-2.0 (package); per-file SPDX tags: some GFDL-1.1-or-later, a few dual BSD"),
    # Not python3.*: usr/share/doc/python3.X-doc/html is a symlink to the same files.
    "python-doc": CorpusSource(
        "python-doc", ("usr/share/doc/python3.[0-9]/html/_sources/**/*.rst.txt",
                       "usr/share/doc/python3.[0-9][0-9]/html/_sources/**/*.rst.txt"), read_plain,
        "PSF-2.0 (Python Software Foundation License Version 2)"),
}
DEFAULT_SOURCES = tuple(SOURCES)


def default_cache_dir() -> Path:
    """Tokenised corpora: ``$DS_XC_CACHE/corpus``, else ``~/.cache/ds_xc/corpus`` (XDG aware)."""
    return debian.default_cache_dir().parent / "corpus"


def default_root() -> Path:
    """Unpacked packages: ``extracted/`` of ``debian.default_cache_dir()``."""
    return debian.default_cache_dir() / "extracted"


def list_files(root: Path, sources: Iterable[str]) -> list[tuple[str, Path]]:
    """(name "SOURCE/relative/path", path) of every text file, in source then path order;
    a file reached twice through symlinks counts once (its first path)."""
    found, seen = [], set()
    for key in sources:
        base = root / SOURCES[key].package
        paths = sorted({Path(p) for g in SOURCES[key].globs
                        for p in glob.glob(str(base / g), recursive=True) if os.path.isfile(p)})
        if not paths:
            raise ValueError(f"source {key!r}: no file matches {SOURCES[key].globs} under {base}")
        for p in paths:
            real = os.path.realpath(p)
            if real not in seen:
                seen.add(real)
                found.append((f"{key}/{p.relative_to(base).as_posix()}", p))
    return found


# -------------------------------------------------------------------- tokenising
def tokenise_corpus(files: list[tuple[str, Path]], readers: dict[str, Callable]) -> dict:
    """Words of every file as frequency ranks (see the module doc).

    Returns ``stream`` (int32 ranks, files concatenated), ``doc_starts`` (int64, one
    per file plus the total), ``doc_names`` and ``words`` (newline-joined uint8) and
    ``counts`` (int64, per rank, decreasing).
    """
    index: dict[bytes, int] = {}  # word -> id in order of first appearance
    setdefault = index.setdefault
    chunks, starts, total = [], [0], 0
    for name, path in files:
        words = _WORD.findall(readers[name.split("/", 1)[0]](path).lower())
        # len(index) is evaluated before setdefault runs: a new word gets the next id.
        chunks.append(np.fromiter((setdefault(w, len(index)) for w in words),
                                  dtype=np.int32, count=len(words)))
        total += len(words)
        starts.append(total)
    first_seen = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
    counts = np.bincount(first_seen, minlength=len(index))
    vocab = list(index)
    order = sorted(range(len(vocab)), key=lambda i: (-counts[i], vocab[i]))
    rank_of = np.empty(len(vocab), dtype=np.int32)
    rank_of[order] = np.arange(len(vocab), dtype=np.int32)
    return {
        "stream": rank_of[first_seen],
        "doc_starts": np.array(starts, dtype=np.int64),
        "doc_names": np.frombuffer("\n".join(n for n, _ in files).encode(), dtype=np.uint8),
        "words": np.frombuffer(b"\n".join(vocab[i] for i in order), dtype=np.uint8),
        "counts": counts[order].astype(np.int64),
    }


def _fingerprint(root: Path, sources: tuple[str, ...], files: list[tuple[str, Path]]) -> str:
    """Cache key of the tokenised corpus: format, sources, their packages and files."""
    stats = [p.stat() for _, p in files]
    fields = {
        "format": FORMAT_VERSION, "sources": sources,
        "packages": [debian.read_marker(root / SOURCES[k].package) for k in sources],
        "files": [len(files), sum(s.st_size for s in stats), max(s.st_mtime_ns for s in stats)],
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def load_tokens(root: Path, sources: tuple[str, ...], cache_dir: Path) -> tuple[dict, Path]:
    """The tokenised corpus, from ``cache_dir/tokens-<key>.npz`` or built and cached."""
    files = list_files(root, sources)
    path = cache_dir / f"tokens-v{FORMAT_VERSION}-{_fingerprint(root, sources, files)}.npz"
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in _ARRAYS}
            logger.info("loaded the tokenised corpus from %s", path)
            return arrays, path
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            logger.warning("ignoring unreadable corpus cache %s (%s); rebuilding", path, err)
    start = time.perf_counter()
    logger.info("tokenising %d files of %s", len(files), ", ".join(sources))
    arrays = tokenise_corpus(files, {k: SOURCES[k].reader for k in sources})
    save_arrays_atomic(path, arrays)
    logger.info("tokenised %d words (%d distinct) in %.1f s, cached at %s", len(arrays["stream"]),
                len(arrays["counts"]), time.perf_counter() - start, path)
    return arrays, path


# --------------------------------------------------------------- blocks and labels
def split_blocks(doc_starts: np.ndarray, block_words: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block starts (int64, sorted), the file of each block, its number in the file."""
    starts, docs, numbers = [], [], []
    for d, (s, e) in enumerate(zip(doc_starts[:-1].tolist(), doc_starts[1:].tolist())):
        first = np.arange(s, e, block_words, dtype=np.int64)
        starts.append(first)
        docs.append(np.full(len(first), d, dtype=np.int64))
        numbers.append(np.arange(len(first), dtype=np.int64))
    return np.concatenate(starts), np.concatenate(docs), np.concatenate(numbers)


def heldout_blocks(doc_names: list[str], block_doc: np.ndarray, block_number: np.ndarray,
                   heldout_fraction: float) -> np.ndarray:
    """Boolean mask of the held-out blocks: the smallest hashes of (file name, number)."""
    num_blocks = len(block_doc)
    if num_blocks < 2:
        raise ValueError(f"need at least 2 blocks for a train/held-out split, got {num_blocks}")
    doc_hash = np.array([derive_salt("corpus-block", n) for n in doc_names], dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = mix64(doc_hash[block_doc] ^ mix64(block_number.astype(np.uint64) + np.uint64(1)))
    num = min(max(1, round(heldout_fraction * num_blocks)), num_blocks - 1)
    held = np.zeros(num_blocks, dtype=bool)
    held[np.argsort(h, kind="stable")[:num]] = True
    return held


def ensure_packages(root: Path, sources: tuple[str, ...], download: bool) -> None:
    """Fetch the packages of ``sources`` missing under ``root`` (into ``root.parent``)."""
    missing = [SOURCES[k].package for k in sources if debian.read_marker(root / SOURCES[k].package) is None]
    if not missing:
        return
    if not download:
        raise ValueError(f"root={str(root)!r} lacks the unpacked packages {missing} (no "
                         f"{debian.MARKER}); run `python -m ds_xc.data.prepare corpus` or pass download=True")
    logger.info("fetching the Debian packages %s into %s", missing, root.parent)
    debian.fetch_packages(missing, cache_dir=root.parent)


class CorpusDataset(PositionDataset):
    """Predict the next word (or pair of words) of Debian's dictionary and documentation
    from the ``context`` words before it (see the module doc).

    Args:
        num_classes: classes of the head. ``word`` mode: the vocabulary size including
            <unk>; ``bigram`` mode: number of pair classes including "other".
        context: number of previous words given as input.
        seed: selects the training sample order (not the data or the split).
        mode: ``"word"`` or ``"bigram"``.
        vocab_size: input word vocabulary (with <unk>); ``word`` mode: None or
            ``num_classes``; ``bigram`` mode: default ``DEFAULT_BIGRAM_VOCAB``.
        sources: keys of ``SOURCES`` to use.
        heldout_fraction: fraction of blocks held out for evaluation, in (0, 1).
        block_words: words per block (the unit of the split; contexts stay inside one).
        root: folder of the unpacked packages (default: ``default_root()``).
        cache_dir: folder of the tokenised corpus (default: ``default_cache_dir()``).
        download: fetch missing packages into ``root.parent`` (else ValueError).
    """

    name = "corpus"
    input_kind = "tokens"

    def __init__(
        self,
        num_classes: int,
        context: int = 4,
        seed: int = 0,
        mode: str = "word",
        vocab_size: int | None = None,
        sources: Iterable[str] = DEFAULT_SOURCES,
        heldout_fraction: float = 0.01,
        block_words: int = 1000,
        root: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        download: bool = True,
    ) -> None:
        self._check_args(num_classes, context, mode, vocab_size, sources, heldout_fraction, block_words)
        self.num_classes, self.context, self.seed, self.mode = int(num_classes), int(context), int(seed), mode
        self.sources = tuple(sources)
        self.heldout_fraction, self.block_words = float(heldout_fraction), int(block_words)
        self.root = Path(root) if root is not None else default_root()
        ensure_packages(self.root, self.sources, download)
        arrays, self.cache_path = load_tokens(
            self.root, self.sources, Path(cache_dir) if cache_dir is not None else default_cache_dir())
        start = time.perf_counter()
        self._derive(arrays, vocab_size)
        logger.info("derived %s samples in %.1f s", self.mode, time.perf_counter() - start)

    @staticmethod
    def _check_args(num_classes, context, mode, vocab_size, sources, heldout_fraction, block_words) -> None:
        check_label_args(num_classes, context, mode, vocab_size)
        bad = [s for s in sources if s not in SOURCES]
        if bad or not list(sources):
            raise ValueError(f"sources={list(sources)!r} is invalid: a non-empty subset of {list(SOURCES)}")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={heldout_fraction!r} is invalid: must be in (0, 1)")
        if int(block_words) != block_words or block_words < 2:
            raise ValueError(f"block_words={block_words!r} is invalid: must be an integer >= 2")

    def _derive(self, arrays: dict, vocab_size: int | None) -> None:
        """Vocabulary, labels, split and sample positions from the tokenised corpus."""
        stream, counts = arrays["stream"], arrays["counts"]
        num_words = len(counts)
        self.doc_names = arrays["doc_names"].tobytes().decode().split("\n")
        all_words = arrays["words"].tobytes().decode("ascii").split("\n") if num_words else []
        block_starts, block_doc, block_number = split_blocks(arrays["doc_starts"], self.block_words)
        held_block = heldout_blocks(self.doc_names, block_doc, block_number, self.heldout_fraction)
        if self.mode == "word":
            vocab = min(self.num_classes, 1 + num_words)
            labels, self._pair_keys, num_pairs = word_labels(stream, vocab), None, None
            self.num_label_classes = vocab
        else:
            vocab = min(vocab_size or DEFAULT_BIGRAM_VOCAB, 1 + num_words)
            labels, self._pair_keys, num_pairs = bigram_labels(
                stream, block_starts, num_words, self.num_classes)
            self.num_label_classes = min(self.num_classes, 1 + num_pairs)
        self.vocab = [UNK] + all_words[: vocab - 1]
        self._all_words, self.pad_id, self.input_dim = all_words, vocab, vocab + 1
        block_len = np.diff(np.append(block_starts, len(stream)))
        held_pos = np.repeat(held_block, block_len)
        keep = labels != 0
        eval_pos = np.flatnonzero(keep & held_pos)
        order = np.argsort(hash_words(torch.arange(len(eval_pos)), derive_salt("corpus-eval"), 1)[:, 0])
        self._ids = torch.from_numpy(word_labels(stream, vocab))  # input ids: same truncation
        self._labels = torch.from_numpy(labels)
        self._train_pos = torch.from_numpy(np.flatnonzero(keep & ~held_pos))
        self._eval_pos = torch.from_numpy(eval_pos[order])
        self._block_starts = torch.from_numpy(block_starts)
        self._salt = derive_salt("ds_xc.corpus", self.seed, "train")
        self._stats = {
            "num_files": len(self.doc_names), "num_tokens": len(stream), "num_distinct_words": num_words,
            "num_distinct_pairs": num_pairs, "num_blocks": len(block_starts),
            "num_heldout_blocks": int(held_block.sum()), "num_dropped": int((~keep).sum()),
        }
        if self.num_label_classes < self.num_classes:
            logger.warning("corpus has only %d label classes in %s mode: labels use %d of %d classes",
                           self.num_label_classes - 1, self.mode, self.num_label_classes, self.num_classes)
        if len(self._train_pos) == 0 or len(self._eval_pos) == 0:
            raise ValueError(f"root={str(self.root)!r} gives an empty split: "
                             f"{len(self._train_pos)} train, {len(self._eval_pos)} held-out samples")

    def _gather(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(N,) label positions -> inputs (N, context) int64, labels (N,) int64.

        Context positions before the start of the sample's block hold the pad id.
        """
        window = torch.arange(-self.context, 0, dtype=torch.int64)  # (K,)
        wpos_NK = pos[:, None] + window[None, :]
        block = torch.searchsorted(self._block_starts, pos, right=True) - 1
        inside_NK = wpos_NK >= self._block_starts[block][:, None]
        inputs_NK = torch.where(inside_NK, self._ids[wpos_NK.clamp(min=0)].long(), self.pad_id)
        return inputs_NK, self._labels[pos].long()

    def decode(self, ids: Tensor) -> list[str]:
        """Word of each input id (pad id -> "<pad>")."""
        return [self.vocab[i] if i < self.pad_id else "<pad>" for i in ids.tolist()]

    def decode_labels(self, labels: Tensor) -> list[str]:
        """Text of each label: a word, or "word word" in bigram mode (0 -> "<unk>")."""
        if self._pair_keys is None:
            return self.decode(labels)
        return pair_names(labels.tolist(), self._pair_keys, self._all_words)

    def label_counts(self, split: str = "train") -> np.ndarray:
        """Samples per class (int64, length num_label_classes) of ``split`` ("train"/"eval")."""
        pos = {"train": self._train_pos, "eval": self._eval_pos}[split]
        return np.bincount(self._labels[pos].numpy(), minlength=self.num_label_classes)

    def describe(self) -> dict:
        """Mode, sizes, split and drop statistics."""
        return {
            "name": self.name, "mode": self.mode, "num_classes": self.num_classes,
            "num_label_classes": self.num_label_classes, "vocab_size": len(self.vocab),
            "input_kind": self.input_kind, "input_dim": self.input_dim, "pad_id": self.pad_id,
            "context": self.context, "seed": self.seed,
            "sources": {k: SOURCES[k].licence for k in self.sources},
            "heldout_fraction": self.heldout_fraction, "block_words": self.block_words, **self._stats,
            "num_train": len(self._train_pos), "num_eval": len(self._eval_pos),
            "root": str(self.root), "cache_path": str(self.cache_path),
        }
