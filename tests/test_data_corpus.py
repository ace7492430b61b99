"""Tests of the corpus data set (ds_xc.data.corpus) and the Debian fetch helpers
(ds_xc.data.debian) on tiny fixture packages written to tmp_path: shapes, label
ranges, exact samples, vocabulary truncation, bigram class ids, determinism, split
disjointness, caching, the Python .deb unpacker. Nothing is downloaded."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

import numpy as np
import pytest
import torch

from ds_xc.config import ConfigError, parse_config
from ds_xc.data import DATASETS, CorpusDataset, build_dataset, debian
from ds_xc.data import corpus as corpus_module


# ------------------------------------------------------------------------ fixtures
def _package(root, key: str, files: dict[str, bytes]) -> None:
    """An unpacked package folder as debian.fetch_package leaves it (marker included)."""
    base = root / key
    for rel, body in files.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(body)
    (base / debian.MARKER).write_text(json.dumps({"package": key, "deb": f"{key}.deb", "sha256": "0"}))


_GCIDE = "usr/share/dictd/gcide.dict.dz"
_LINUX = "usr/share/doc/linux-doc-6.1/html/_sources/"
_PYTHON = "usr/share/doc/python3.11/html/_sources/"


def _tiny_root(tmp_path):
    """Three sources; gcide's pronunciation field must vanish."""
    root = tmp_path / "extracted"
    _package(root, "gcide", {_GCIDE: gzip.compress(b"Cat \\Cat\\, n. A cat.\nDog \\Dog\\, n. A dog.\n")})
    _package(root, "linux-doc", {_LINUX + "a.rst.txt": b"The cat and the dog", _LINUX + "x.html": b"zzz"})
    _package(root, "python-doc", {_PYTHON + "lib/b.rst.txt": b"A dog, the DOG."})
    # As in python3.X-doc: a second path to the same files, which must count once.
    (root / "python-doc/usr/share/doc/python3.11-doc").mkdir(parents=True)
    (root / "python-doc/usr/share/doc/python3.11-doc/html").symlink_to("../python3.11/html")
    return root


def _random_root(tmp_path, num_files: int = 6, words_per_file: int = 400):
    """A Zipf-ish corpus of 40 words over several files, for statistics and splits."""
    root = tmp_path / "extracted"
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    probs = 1.0 / np.arange(1, 41)
    probs /= probs.sum()
    files = {f"{_LINUX}f{f}.rst.txt": " ".join(rng.choice(words, words_per_file, p=probs)).encode()
             for f in range(num_files)}
    _package(root, "linux-doc", files)
    return root


def _corpus(root, tmp_path, num_classes, **kwargs) -> CorpusDataset:
    kwargs = {"sources": ("linux-doc",), "block_words": 50, "heldout_fraction": 0.2, "download": False,
              **kwargs}
    return CorpusDataset(num_classes, root=root, cache_dir=tmp_path / "cache", **kwargs)


# ---------------------------------------------------------------------- word mode
def test_tokens_vocabulary_and_exact_samples(tmp_path):
    ds = CorpusDataset(5, context=2, root=_tiny_root(tmp_path), cache_dir=tmp_path / "cache",
                       heldout_fraction=0.5, block_words=100, download=False)
    # Words (lowercased): gcide "cat n a cat dog n a dog", linux "the cat and the dog",
    # python "a dog the dog". Counts: dog 5, a 3, cat 3, the 3, n 2, and 1; ties by bytes.
    assert ds._all_words == ["dog", "a", "cat", "the", "n", "and"]
    assert ds.vocab == ["<unk>", "dog", "a", "cat", "the"] and ds.pad_id == 5 and ds.input_dim == 6
    info = ds.describe()
    assert (info["num_files"], info["num_tokens"], info["num_blocks"]) == (3, 17, 3)
    assert info["num_dropped"] == 3  # n, n, and: beyond the vocabulary
    x, y = ds.train_batch(0, 500)
    got = set(zip(map(tuple, x.tolist()), y.tolist()))
    ex, ey = next(ds.eval_batches(info["num_eval"]))
    held = set(zip(map(tuple, ex.tolist()), ey.tolist()))
    # python-doc's file: a dog the dog -> ids 2 1 4 1; each file starts with pad ids (5).
    python_samples = {((5, 5), 2), ((5, 2), 1), ((2, 1), 4), ((1, 4), 1)}
    linux_samples = {((5, 5), 4), ((5, 4), 3), ((0, 4), 1)}  # the cat and the dog; "and" dropped
    assert python_samples <= got | held and linux_samples <= got | held
    assert info["num_train"] + info["num_eval"] == 17 - 3
    assert ds.decode(torch.tensor([1, 0, 5])) == ["dog", "<unk>", "<pad>"]


def test_word_mode_shapes_ranges_and_zipf(tmp_path):
    ds = _corpus(_random_root(tmp_path), tmp_path, 20, context=3)
    x, y = ds.train_batch(3, 256, 1, 2)
    assert x.shape == (256, 3) and y.shape == (256,) and x.dtype == y.dtype == torch.int64
    assert 1 <= y.min() and y.max() < 20 and 0 <= x.min() and x.max() <= ds.pad_id == 20
    counts = ds.label_counts()
    assert len(counts) == 20 and counts[0] == 0 and counts[1] > 5 * counts[19]
    assert ds.describe()["num_label_classes"] == 20


def test_vocabulary_larger_than_corpus(tmp_path, caplog):
    ds = _corpus(_random_root(tmp_path), tmp_path, 1000)
    assert len(ds.vocab) == 41 and ds.num_label_classes == 41 and ds.describe()["num_dropped"] == 0
    assert "only 40 label classes" in caplog.text


def test_determinism_ranks_and_split(tmp_path):
    root = _random_root(tmp_path)
    a, b = _corpus(root, tmp_path, 30, seed=1), _corpus(root, tmp_path, 30, seed=1)
    xa, ya = a.train_batch(5, 64, 1, 2)
    xb, yb = b.train_batch(5, 64, 1, 2)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x_all, _ = a.train_batch(5, 128, 0, 1)  # global batch independent of the rank split
    assert torch.equal(x_all[64:], xa)
    assert not torch.equal(_corpus(root, tmp_path, 30, seed=2).train_batch(5, 64, 1, 2)[0], xa)
    # Held-out and training positions are disjoint and lie in disjoint blocks.
    train, held = set(a._train_pos.tolist()), set(a._eval_pos.tolist())
    assert train and held and not train & held
    blocks = a._block_starts.numpy()
    block_of = lambda pos: set(np.searchsorted(blocks, sorted(pos), side="right") - 1)  # noqa: E731
    assert not block_of(train) & block_of(held)
    assert a.describe()["num_heldout_blocks"] == round(0.2 * a.describe()["num_blocks"])
    shares = [list(a.eval_batches(16, r, 3)) for r in range(3)]
    assert len({len(s) for s in shares}) == 1 and len(shares[0]) >= 1


def test_context_stays_inside_block(tmp_path):
    ds = _corpus(_random_root(tmp_path, num_files=2, words_per_file=100), tmp_path, 50,
                 context=8, block_words=10)
    starts = set(ds._block_starts.tolist())
    pos = torch.tensor(sorted(starts)[1:4]) + 2  # third word of three blocks
    x, _ = ds._gather(pos)
    assert (x[:, :6] == ds.pad_id).all() and (x[:, 6:] != ds.pad_id).all()


# --------------------------------------------------------------------- bigram mode
def test_bigram_classes_by_frequency(tmp_path):
    root = tmp_path / "extracted"
    _package(root, "linux-doc", {_LINUX + "a.rst.txt": b"a b a b a b c a c d", _LINUX + "b.rst.txt": b"a b x y"})
    ds = _corpus(root, tmp_path, 3, mode="bigram", vocab_size=3, block_words=100, heldout_fraction=0.5)
    # Pairs inside a file: (a b) x4, (b a) x2, then once each: b c, c a, a c, c d, b x, x y.
    assert ds.num_label_classes == 3 and ds.describe()["num_distinct_pairs"] == 8
    assert ds.decode_labels(torch.tensor([1, 2, 0])) == ["a b", "b a", "<unk>"]
    assert ds.vocab == ["<unk>", "a", "b"] and ds.input_dim == 4
    labels = torch.cat([ds._labels[ds._train_pos], ds._labels[ds._eval_pos]])
    assert sorted(labels.tolist()) == [1, 1, 1, 1, 2, 2]
    wide = _corpus(root, tmp_path, 10**6, mode="bigram", block_words=100, heldout_fraction=0.5)
    assert wide.num_label_classes == 9 and wide.decode_labels(torch.tensor([3]))[0] == "a c"


def test_bigram_pairs_do_not_cross_blocks(tmp_path):
    ds = _corpus(_random_root(tmp_path), tmp_path, 10**6, mode="bigram", vocab_size=50, block_words=40)
    last = ds._block_starts[1:] - 1  # last word of every block but the final one
    assert (ds._labels[last] == 0).all()
    x, y = ds.train_batch(0, 512)
    assert 1 <= y.min() and y.max() < ds.num_label_classes
    counts = ds.label_counts()
    assert counts[1] >= counts[1:].max()  # class 1 = the most frequent pair


# ------------------------------------------------------------------ cache and args
def test_cache_written_and_reused(tmp_path, monkeypatch):
    root = _random_root(tmp_path)
    ds = _corpus(root, tmp_path, 30)
    assert ds.cache_path.is_file() and ds.cache_path.parent == tmp_path / "cache"

    def fail(*args, **kwargs):
        raise AssertionError("tokenise_corpus called although the cache exists")

    monkeypatch.setattr(corpus_module, "tokenise_corpus", fail)
    again = _corpus(root, tmp_path, 100, mode="bigram")  # other size and mode: same token cache
    assert again.cache_path == ds.cache_path
    monkeypatch.undo()
    (root / "linux-doc" / _LINUX / "f0.rst.txt").write_bytes(b"new words here")
    assert _corpus(root, tmp_path, 30).cache_path != ds.cache_path


def test_missing_packages_and_bad_args(tmp_path):
    with pytest.raises(ValueError, match=r"lacks the unpacked packages \['linux-doc'\].*prepare corpus"):
        _corpus(tmp_path / "nothing", tmp_path, 10)
    root = _random_root(tmp_path)
    for kwargs, match in [({"mode": "trigram"}, "mode='trigram'"), ({"vocab_size": 7}, "vocab_size=7"),
                          ({"sources": ("wiki",)}, "sources"), ({"heldout_fraction": 1.0}, "heldout_fraction"),
                          ({"context": 0}, "context"), ({"block_words": 1}, "block_words")]:
        with pytest.raises(ValueError, match=match):
            _corpus(root, tmp_path, 10, **kwargs)
    with pytest.raises(ValueError, match="num_classes=1"):
        _corpus(root, tmp_path, 1)


def test_registry_and_build(tmp_path):
    assert DATASETS["corpus"] is CorpusDataset
    ds = build_dataset("corpus", 12, seed=3, root=_random_root(tmp_path), cache_dir=tmp_path / "c",
                       sources=("linux-doc",), block_words=50, heldout_fraction=0.2, download=False)
    assert ds.seed == 3 and ds.describe()["name"] == "corpus"


def test_train_config_corpus_fields():
    head = {"num_classes": 10, "embedding_dim": 4}
    cfg = parse_config({"extreme_classification": head, "xc_train": {
        "data": "corpus", "corpus_mode": "bigram", "corpus_vocab_size": 20_000}}).xc_train
    assert (cfg.data, cfg.corpus_mode, cfg.corpus_vocab_size) == ("corpus", "bigram", 20_000)
    for train, match in [({"corpus_vocab_size": 500}, "corpus_vocab_size=500 must be 0 or in"),
                         ({"corpus_vocab_size": 300_000}, "xc_train.corpus_vocab_size"),
                         ({"corpus_vocab_size": 20_000}, "applies to corpus_mode='bigram'"),
                         ({"corpus_mode": "trigram"}, "xc_train.corpus_mode")]:
        with pytest.raises(ConfigError, match=match):
            parse_config({"extreme_classification": head, "xc_train": {"data": "corpus", **train}})


# ---------------------------------------------------------------- Debian helpers
def _tar(files: dict[str, bytes], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def _ar(members: dict[str, bytes]) -> bytes:
    out = b"!<arch>\n"
    for name, body in members.items():
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode() + body
        out += b"\n" if len(body) % 2 else b""
    return out


def test_python_deb_extraction(tmp_path):
    data = _tar({"./usr/share/doc/p/copyright": b"GPL\n", "./usr/share/p/odd.txt": b"odd"}, "w:xz")
    deb = tmp_path / "p_1.0_all.deb"
    deb.write_bytes(_ar({"debian-binary": b"2.0\n", "control.tar.gz": _tar({}, "w:gz"), "data.tar.xz": data}))
    members = debian.read_ar(deb.read_bytes())
    assert list(members) == ["debian-binary", "control.tar.gz", "data.tar.xz"]
    debian.extract_deb_python(deb, tmp_path / "out")
    assert (tmp_path / "out/usr/share/doc/p/copyright").read_bytes() == b"GPL\n"
    assert (tmp_path / "out/usr/share/p/odd.txt").read_bytes() == b"odd"
    if debian.shutil.which("dpkg-deb"):  # the same result as dpkg-deb -x
        debian.extract_deb(deb, tmp_path / "dpkg")
        assert (tmp_path / "dpkg/usr/share/p/odd.txt").read_bytes() == b"odd"
    with pytest.raises(ValueError, match="not an ar archive"):
        debian.read_ar(b"PK\x03\x04")


def test_package_names_and_sources_parsing():
    spec = debian.PACKAGES["linux-doc"]
    assert debian.pick_package(spec, ["linux-doc", "linux-doc-5.10", "linux-doc-6.1", "linux-doc-6.12"]) \
        == "linux-doc-6.12"
    assert debian.pick_package(debian.PACKAGES["python-doc"], ["python3.9-doc", "python3.11-doc",
                                                              "python3-doc"]) == "python3.11-doc"
    with pytest.raises(ValueError, match="gcide.*dict-gcide"):
        debian.pick_package(debian.PACKAGES["gcide"], ["dictd"])
    sources = debian.parse_sources([
        "deb [arch=amd64] http://a.example/debian bookworm main contrib\n# deb http://no/ x y\n"
        "deb-src http://src/ bookworm main\n",
        "Types: deb\n# a comment inside the stanza\nURIs: http://b.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb-src\nURIs: http://c/\nSuites: s\nComponents: main\n",
    ])
    assert sources == [("http://a.example/debian", "bookworm", "main"),
                       ("http://a.example/debian", "bookworm", "contrib"),
                       ("http://b.example/debian", "bookworm", "main"),
                       ("http://b.example/debian", "bookworm-updates", "main")]
    index = debian.parse_packages_index(
        "Package: dict-gcide\nVersion: 1\nFilename: pool/main/d/dict-gcide/dict-gcide_1_all.deb\n"
        "SHA256: ab\nDescription: x\n\nPackage: other\nVersion: 2\n")
    assert index == {"dict-gcide": {"Package": "dict-gcide", "Version": "1", "SHA256": "ab",
                                    "Filename": "pool/main/d/dict-gcide/dict-gcide_1_all.deb"}}


def test_fetch_is_idempotent_without_downloading(tmp_path, monkeypatch):
    """A marked folder is reused: no package index or download is touched."""
    _package(tmp_path / "extracted", "gcide", {_GCIDE: gzip.compress(b"x")})
    monkeypatch.setattr(debian, "_apt_names", lambda spec: pytest.fail("resolved a name"))
    monkeypatch.setattr(debian, "_mirror_index", lambda: pytest.fail("read an index"))
    got = debian.fetch_packages(["gcide"], cache_dir=tmp_path, use_apt=False)
    assert got["gcide"].name == "gcide" and got["gcide"].root == tmp_path / "extracted" / "gcide"
    with pytest.raises(ValueError, match=r"\['wiki'\].*allowed"):
        debian.fetch_packages(["wiki"], cache_dir=tmp_path)


@pytest.mark.skipif(not (corpus_module.default_root() / "gcide" / debian.MARKER).is_file(),
                    reason="the real corpus is not fetched here (python -m ds_xc.data.prepare corpus)")
def test_real_corpus_if_cached():
    """On a machine where the packages are unpacked: sizes of the real corpus."""
    ds = CorpusDataset(50_000, download=False)
    info = ds.describe()
    assert info["num_tokens"] > 5 * 10**6 and info["num_train"] > 5 * 10**6
    assert ds.label_counts()[1] > 100 * ds.label_counts()[-1]
