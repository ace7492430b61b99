"""Labels from a stream of word frequency ranks, shared by the text and corpus data sets.

A corpus is tokenised into ``stream``: the frequency rank of every word (0 = most
frequent, ties by byte order), documents concatenated, ``block_starts`` the sorted
positions where a document (or a block of one) begins. From it:

* ``word_labels``: next-word classes of a truncated vocabulary (rank + 1, 0 = <unk>);
  also the input ids, with the same truncation;
* ``bigram_labels``: word-pair classes: the pair (word p, word p+1) inside one block,
  classes 1.. the most frequent pairs of the whole stream, 0 = any other pair;
* ``pair_names``: the text "word word" of pair classes, for inspection.

One implementation, so that a pair class means the same thing in every data set.
"""

from __future__ import annotations

import numpy as np

UNK = "<unk>"
MODES = ("word", "bigram")  # the label modes of the text and corpus data sets


def check_label_args(num_classes, context, mode, vocab_size) -> None:
    """The argument checks both label modes share (text and corpus data sets): each error names
    the argument, its value and what is allowed."""
    if int(num_classes) != num_classes or num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r} is invalid: must be an integer >= 2")
    if int(context) != context or context < 1:
        raise ValueError(f"context={context!r} is invalid: must be an integer >= 1")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: allowed {list(MODES)}")
    if mode == "word" and vocab_size not in (None, num_classes):
        raise ValueError(f"vocab_size={vocab_size!r} is invalid in word mode: the vocabulary is "
                         f"num_classes={num_classes}; leave vocab_size unset")
    if vocab_size is not None and (int(vocab_size) != vocab_size or vocab_size < 2):
        raise ValueError(f"vocab_size={vocab_size!r} is invalid: must be an integer >= 2")


def word_labels(stream: np.ndarray, num_classes: int) -> np.ndarray:
    """Next-word labels of every position: rank + 1 inside the vocabulary, else 0."""
    return np.where(stream < num_classes - 1, stream + 1, 0).astype(np.int32)


def bigram_labels(stream: np.ndarray, block_starts: np.ndarray, num_words: int,
                  num_classes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Pair labels of every position p: the class of (word p, word p+1), 0 when the
    pair is not among the ``num_classes - 1`` most frequent or p is a block's last word.

    Classes are ranked by the pair's count over the whole stream, decreasing, ties by
    (rank_a, rank_b). Returns (labels int32 (N,), pair keys of classes 1..
    (rank_a * num_words + rank_b, int64), number of distinct pairs).
    """
    n = len(stream)
    last = np.zeros(n + 1, dtype=bool)
    last[block_starts] = True
    last[n] = True
    pos = np.flatnonzero(~last[1:])  # p + 1 lies in p's block
    keys = stream[pos].astype(np.int64) * num_words + stream[pos + 1]
    uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    order = np.lexsort((uniq, -counts))  # count decreasing, then (rank_a, rank_b)
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[order] = np.arange(len(uniq))
    class_of = np.where(rank < num_classes - 1, rank + 1, 0).astype(np.int32)
    labels = np.zeros(n, dtype=np.int32)
    labels[pos] = class_of[inverse.reshape(-1)]
    return labels, uniq[order[: num_classes - 1]], len(uniq)


def pair_names(classes: list[int], pair_keys: np.ndarray, words: list[str]) -> list[str]:
    """"word word" of each pair class (0 -> "<unk>"), from bigram_labels' pair keys and the
    words by rank."""
    out = []
    for c in classes:
        if c == 0:
            out.append(UNK)
            continue
        a, b = divmod(int(pair_keys[c - 1]), len(words))
        out.append(f"{words[a]} {words[b]}")
    return out
