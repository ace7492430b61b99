"""Word-pair labels (ds_xc.data.labels) and the text data set's bigram mode: pair classes
against a plain Counter re-implementation, exact samples on a written fixture, the input
vocabulary's truncation, the cache key, argument and config checks."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest
import torch

from ds_xc.config import ConfigError, parse_config
from ds_xc.data import TextDataset, build_dataset
from ds_xc.data import text as text_module
from ds_xc.data.labels import bigram_labels, pair_names, word_labels


# ------------------------------------------------------------------ reference
def _reference_pairs(stream: list[int], block_starts: list[int], num_words: int, num_classes: int):
    """Pair classes by counting pairs inside blocks with a Counter, ranked by (-count, a, b)."""
    ends = sorted(set(block_starts[1:]) | {len(stream)})
    pairs = [(p, (stream[p], stream[p + 1])) for p in range(len(stream) - 1) if p + 1 not in ends]
    counts = collections.Counter(pair for _, pair in pairs)
    ranked = sorted(counts, key=lambda ab: (-counts[ab], ab))
    class_of = {ab: i + 1 for i, ab in enumerate(ranked[: num_classes - 1])}
    labels = [0] * len(stream)
    for p, pair in pairs:
        labels[p] = class_of.get(pair, 0)
    keys = [a * num_words + b for a, b in ranked[: num_classes - 1]]
    return labels, keys, len(counts)


@pytest.mark.parametrize("num_classes", [2, 7, 40, 10**6])
def test_bigram_labels_match_counter_reference(num_classes):
    rng = np.random.default_rng(num_classes)
    num_words = 9
    stream = np.minimum(rng.geometric(0.35, 600) - 1, num_words - 1).astype(np.int32)  # Zipf-ish ranks
    block_starts = np.array([0, 0, 17, 100, 101, 350, 599], dtype=np.int64)  # an empty block, a 1-word one
    labels, keys, distinct = bigram_labels(stream, block_starts, num_words, num_classes)
    want_labels, want_keys, want_distinct = _reference_pairs(stream.tolist(), block_starts.tolist(), num_words,
                                                             num_classes)
    assert labels.dtype == np.int32 and labels.tolist() == want_labels
    assert keys.tolist() == want_keys and distinct == want_distinct
    words = [f"w{i}" for i in range(num_words)]
    a, b = divmod(want_keys[0], num_words)
    assert pair_names([1, 0], keys, words) == [f"w{a} w{b}", "<unk>"]


def test_word_labels_truncate_the_vocabulary():
    assert word_labels(np.array([0, 3, 1, 2]), 3).tolist() == [1, 0, 2, 0]


# ------------------------------------------------------------------ text, bigram mode
# Words, by file: a: def f x return x x | b: x f y | c: import os x os path.
_FIXTURE = {
    "a.py": "def f(x):\n    return x + x\n",
    "pkg/b.py": "x = f(y)\n",
    "pkg/c.py": "import os\nx = os.path\n",
}


def _write(root, files: dict) -> None:
    for rel, body in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)


def _expected_samples(files: dict, num_classes: int, vocab_size: int, context: int) -> dict:
    """Per file, the (inputs, label) samples of bigram mode, written out with plain Python."""
    words = {rel: re.findall(rb"[A-Za-z_][A-Za-z0-9_]*", body.encode()) for rel, body in files.items()}
    counts = collections.Counter(w for ws in words.values() for w in ws)
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    rank = {w: r for r, w in enumerate(ranked)}
    pair_counts = collections.Counter((rank[a], rank[b]) for ws in words.values() for a, b in zip(ws, ws[1:]))
    order = sorted(pair_counts, key=lambda ab: (-pair_counts[ab], ab))[: num_classes - 1]
    class_of = {ab: i + 1 for i, ab in enumerate(order)}
    pad = min(vocab_size, 1 + len(ranked))
    out = {}
    for rel, ws in words.items():
        ids = [pad] * context + [rank[w] + 1 if rank[w] + 1 < pad else 0 for w in ws]
        samples = []
        for p in range(len(ws) - 1):
            label = class_of.get((rank[ws[p]], rank[ws[p + 1]]), 0)
            if label:
                samples.append((tuple(ids[p: p + context]), label))
        out[rel] = samples
    return out


@pytest.fixture
def fixture_root(tmp_path):
    _write(tmp_path / "src", _FIXTURE)
    return tmp_path / "src"


def _pairs(root, tmp_path, **kwargs) -> TextDataset:
    kwargs = {"num_classes": 5, "context": 2, "heldout_fraction": 0.34, "mode": "bigram", "vocab_size": 4,
              **kwargs}
    return TextDataset(root=root, cache_dir=tmp_path / "cache", **kwargs)


@pytest.mark.parametrize("num_classes, vocab_size", [(5, 4), (3, 100), (100, 6)])
def test_text_bigram_exact_samples(fixture_root, tmp_path, num_classes, vocab_size):
    ds = _pairs(fixture_root, tmp_path, num_classes=num_classes, vocab_size=vocab_size)
    expected = _expected_samples(_FIXTURE, num_classes, vocab_size, 2)
    (held,) = text_module.heldout_files(list(_FIXTURE), 0.34)
    info = ds.describe()
    assert (info["mode"], info["num_distinct_pairs"], info["num_tokens"]) == ("bigram", 11, 14)
    assert ds.num_label_classes == min(num_classes, 12) and ds.pad_id == min(vocab_size, 9)
    assert info["num_unk_dropped"] == 14 - sum(len(s) for s in expected.values())
    x, y = next(ds.eval_batches(info["num_eval"]))
    assert sorted(zip(map(tuple, x.tolist()), y.tolist())) == sorted(expected[held])
    x, y = ds.train_batch(0, 2000)
    want = {s for rel, samples in expected.items() if rel != held for s in samples}
    assert set(zip(map(tuple, x.tolist()), y.tolist())) == want


def test_text_bigram_vocabulary_and_names(fixture_root, tmp_path):
    ds = _pairs(fixture_root, tmp_path)
    # Ranks: x 5, f 2, os 2, then def, import, path, return, y; every pair occurs once, so the
    # classes follow the pair of ranks: (x x), (x f), (x os), (x return), ...
    assert ds.vocab == ["<unk>", "x", "f", "os"] and ds.input_dim == 5
    assert ds.decode_labels(torch.tensor([1, 2, 3, 4, 0])) == ["x x", "x f", "x os", "x return", "<unk>"]
    assert ds.decode(torch.tensor([1, 0, 4])) == ["x", "<unk>", "<pad>"]


def test_text_bigram_cache_keys_and_reuse(fixture_root, tmp_path, monkeypatch):
    word = TextDataset(5, context=2, heldout_fraction=0.34, root=fixture_root, cache_dir=tmp_path / "cache")
    pairs = _pairs(fixture_root, tmp_path)
    other_vocab = _pairs(fixture_root, tmp_path, vocab_size=6)
    assert len({word.cache_path, pairs.cache_path, other_vocab.cache_path}) == 3
    assert word.describe()["mode"] == "word" and word.describe()["num_distinct_pairs"] is None

    def fail(*args, **kwargs):
        raise AssertionError("tokenise called although the cache exists")

    monkeypatch.setattr(text_module, "tokenise", fail)
    again = _pairs(fixture_root, tmp_path)
    a, b = again.train_batch(3, 64), pairs.train_batch(3, 64)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "trigram"}, r"mode='trigram' is invalid: allowed \['word', 'bigram'\]"),
    ({"mode": "word", "vocab_size": 3}, "vocab_size=3 is invalid in word mode"),
    ({"vocab_size": 1}, "vocab_size=1 is invalid"),
])
def test_text_bigram_bad_args(fixture_root, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _pairs(fixture_root, tmp_path, **kwargs)


def test_build_dataset_passes_the_mode(fixture_root, tmp_path):
    ds = build_dataset("text", 5, context=2, root=fixture_root, cache_dir=tmp_path / "cache", mode="bigram",
                       vocab_size=4, heldout_fraction=0.34)
    assert isinstance(ds, TextDataset) and ds.mode == "bigram" and ds.num_label_classes == 5


def test_train_config_text_fields():
    head = {"num_classes": 10, "embedding_dim": 4}
    cfg = parse_config({"extreme_classification": head, "xc_train": {
        "data": "text", "text_mode": "bigram", "text_vocab_size": 20_000}}).xc_train
    assert (cfg.data, cfg.text_mode, cfg.text_vocab_size) == ("text", "bigram", 20_000)
    for train, match in [({"text_mode": "bigram", "text_vocab_size": 500}, "text_vocab_size=500 must be 0 or in"),
                         ({"text_vocab_size": 300_000}, "xc_train.text_vocab_size"),
                         ({"text_vocab_size": 20_000}, "applies to text_mode='bigram'"),
                         ({"text_mode": "trigram"}, "xc_train.text_mode")]:
        with pytest.raises(ConfigError, match=match):
            parse_config({"extreme_classification": head, "xc_train": {"data": "text", **train}})
