"""Tests of the built-in data sets (ds_xc.data): shapes, determinism, rank splits,
label statistics, text vocabulary on a hand-written fixture, caching, argument checks."""

from __future__ import annotations

import pytest
import torch

from ds_xc.data import DATASETS, SyntheticDataset, TextDataset, XCDataset, build_dataset
from ds_xc.data import text as text_module
from ds_xc.data.base import eval_batch_ranges


# ------------------------------------------------------------------------ helpers
def _rows(x: torch.Tensor, y: torch.Tensor) -> set:
    """Samples as hashable tuples (inputs..., label)."""
    return {tuple(r) + (int(l),) for r, l in zip(x.tolist(), y.tolist())}


def _eval_shares(ds: XCDataset, batch_size: int, world_size: int) -> list[list]:
    return [list(ds.eval_batches(batch_size, r, world_size)) for r in range(world_size)]


def _check_eval_split(ds: XCDataset, batch_size: int, world_size: int) -> None:
    """Same number of full batches on every rank, disjoint shares, same on every call."""
    shares = _eval_shares(ds, batch_size, world_size)
    assert len({len(s) for s in shares}) == 1 and len(shares[0]) >= 1
    assert all(len(x) == len(y) == batch_size for s in shares for x, y in s)
    rows = [tuple(row) for share in shares for x, _ in share for row in x.tolist()]
    if ds.input_kind == "dense":  # float rows never collide by chance: all distinct
        assert len(set(rows)) == len(rows)
    again = list(ds.eval_batches(batch_size, world_size - 1, world_size))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(again, shares[-1]))


# ---------------------------------------------------------------------- synthetic
def test_synthetic_shapes_dtypes_ranges():
    ds = SyntheticDataset(1003, input_dim=24, latent_dim=8, group_size=5)
    x, y = ds.train_batch(0, 64)
    assert x.shape == (64, 24) and x.dtype == torch.float32
    assert y.shape == (64,) and y.dtype == torch.int64
    assert 0 <= y.min() and y.max() < 1003 and torch.isfinite(x).all()
    assert ds.input_kind == "dense" and ds.context == 0 and ds.input_dim == 24
    big = SyntheticDataset(10**8)
    _, y = big.train_batch(12345, 256, 3, 4)
    assert 0 <= y.min() and y.max() < 10**8
    assert big.describe()["num_classes"] == 10**8


def test_synthetic_determinism_and_rank_split():
    a, b = SyntheticDataset(5000, seed=3), SyntheticDataset(5000, seed=3)
    xa, ya = a.train_batch(7, 32, 1, 2)
    xb, yb = b.train_batch(7, 32, 1, 2)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x0, _ = a.train_batch(7, 32, 0, 2)
    x8, _ = a.train_batch(8, 32, 1, 2)
    xs, _ = SyntheticDataset(5000, seed=4).train_batch(7, 32, 1, 2)
    for other in (x0, x8, xs):
        assert not _rows(xa, ya) & _rows(other, ya)
    # The global batch of a step does not depend on how it is split over ranks.
    x_one, y_one = a.train_batch(7, 64, 0, 1)
    assert torch.equal(torch.cat([x0, xa]), x_one)


def test_synthetic_eval_split_and_disjoint_from_train():
    ds = SyntheticDataset(2000, num_eval=1000)
    for world_size in (1, 2, 3):
        _check_eval_split(ds, 64, world_size)
    assert sum(len(y) for _, y in ds.eval_batches(64, 0, 3)) == (1000 // 192) * 64
    assert sum(len(y) for _, y in ds.eval_batches(10, max_samples=95)) == 90
    ex, ey = next(ds.eval_batches(100))
    tx, ty = ds.train_batch(0, 100)
    assert not _rows(ex, ey) & _rows(tx, ty)


def test_synthetic_zipf_skew_and_spread():
    ds = SyntheticDataset(10_000)
    labels = torch.cat([ds.train_batch(s, 512)[1] for s in range(20)])
    counts = torch.bincount(labels, minlength=10_000)
    assert counts.max() > 100 * max(1, int(counts.median()))
    # Empirical frequency of the top classes matches the exact prior.
    top = ds.class_of_rank(torch.arange(3))
    expected = ds.class_probabilities(top) * len(labels)
    assert torch.allclose(counts[top].double(), expected, rtol=0.1)
    # The 64 most frequent classes fall in every quarter of the class range (every shard).
    quarters = ds.class_of_rank(torch.arange(64)) // 2500
    assert set(quarters.tolist()) == {0, 1, 2, 3}
    uniform = torch.bincount(SyntheticDataset(100, zipf_exponent=0.0).train_batch(0, 20_000)[1])
    assert uniform.max() < 1.5 * uniform.float().median()


def test_synthetic_label_bijection_and_prior():
    ds = SyntheticDataset(1000, zipf_exponent=1.3)
    classes = ds.class_of_rank(torch.arange(1000))
    assert sorted(classes.tolist()) == list(range(1000))
    assert torch.equal(ds.rank_of_class(classes), torch.arange(1000))
    probs = ds.class_probabilities(torch.arange(1000))
    assert abs(float(probs.sum()) - 1.0) < 1e-9
    assert torch.all(probs[classes][:-1] >= probs[classes][1:])  # decreasing in rank


def test_synthetic_prototypes_grouped():
    ds = SyntheticDataset(4000, group_size=8)
    protos = ds.prototypes(torch.arange(4000))
    assert protos.shape == (4000, ds.latent_dim)
    assert torch.allclose(protos.norm(dim=1), torch.ones(4000), atol=1e-5)
    cos = protos @ protos.T
    same = ds.group_of(torch.arange(4000))[:, None] == ds.group_of(torch.arange(4000))[None, :]
    off_diag = ~torch.eye(4000, dtype=torch.bool)
    assert cos[same & off_diag].mean() > 0.6 > 0.1 > cos[~same].mean().abs()
    assert torch.equal(ds.prototypes(torch.tensor([17, 3])), protos[[17, 3]])


@pytest.mark.parametrize("kwargs, match", [
    ({"num_classes": 0}, "num_classes=0"), ({"noise": -1.0}, "noise=-1.0"),
    ({"group_size": 0}, "group_size=0"), ({"zipf_exponent": float("nan")}, "zipf_exponent=nan"),
    ({"num_eval": 2.5}, "num_eval=2.5"),
])
def test_synthetic_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticDataset(**{"num_classes": 10, **kwargs})


@pytest.mark.parametrize("call, match", [
    (lambda ds: ds.train_batch(-1, 4), "step"),
    (lambda ds: ds.train_batch(0, 0), "batch_size"),
    (lambda ds: ds.train_batch(0, 4, 2, 2), "rank"),
    (lambda ds: ds.train_batch(0, 4, 0, 0), "world_size"),
    (lambda ds: list(ds.eval_batches(100, 0, 2)), "batch_size=100"),
])
def test_batch_bad_args(call, match):
    with pytest.raises(ValueError, match=match):
        call(SyntheticDataset(10, num_eval=150))


def test_eval_batch_ranges_cover_global_blocks():
    ranges = [eval_batch_ranges(10, 2, r, 2) for r in range(2)]
    assert ranges == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]


def test_registry():
    assert DATASETS["synthetic"] is SyntheticDataset and DATASETS["text"] is TextDataset
    ds = build_dataset("synthetic", 50, seed=2, input_dim=8)
    assert isinstance(ds, XCDataset) and ds.seed == 2 and ds.input_dim == 8
    with pytest.raises(ValueError, match=r"name='imagenet'.*synthetic.*text"):
        build_dataset("imagenet", 10)
    with pytest.raises(TypeError):
        XCDataset()  # abstract


# --------------------------------------------------------------------------- text
# Words, by file: a: def f x return x x | b: x f y | c: import os x os path.
# Counts: x 5, f 2, os 2, then 1 each (byte order): def, import, path, return, y.
_FIXTURE = {
    "a.py": "def f(x):\n    return x + x\n",
    "pkg/b.py": "x = f(y)\n",
    "pkg/c.py": "import os\nx = os.path\n",
    "site-packages/z.py": "zzz zzz zzz zzz zzz zzz",  # excluded
    "notes.txt": "zzz zzz zzz zzz zzz zzz",  # not a .py file
}
# num_classes=5: vocab <unk>=0, x=1, f=2, os=3, def=4; pad=5. context=2; <unk> labels dropped.
_SAMPLES = {
    "a.py": [((5, 5), 4), ((5, 4), 2), ((4, 2), 1), ((1, 0), 1), ((0, 1), 1)],
    "pkg/b.py": [((5, 5), 1), ((5, 1), 2)],
    "pkg/c.py": [((5, 0), 3), ((0, 3), 1), ((3, 1), 3)],
}


def _write(root, files: dict) -> None:
    for rel, body in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)


@pytest.fixture
def fixture_root(tmp_path):
    _write(tmp_path / "src", _FIXTURE)
    return tmp_path / "src"


def _text(root, tmp_path, **kwargs) -> TextDataset:
    kwargs = {"num_classes": 5, "context": 2, "heldout_fraction": 0.34, **kwargs}
    return TextDataset(root=root, cache_dir=tmp_path / "cache", **kwargs)


def test_text_vocabulary_and_exact_samples(fixture_root, tmp_path):
    ds = _text(fixture_root, tmp_path)
    assert ds.vocab == ["<unk>", "x", "f", "os", "def"]
    assert ds.pad_id == 5 and ds.input_dim == 6 and ds.input_kind == "tokens"
    info = ds.describe()
    assert (info["num_files"], info["num_heldout_files"]) == (3, 1)
    assert (info["num_tokens"], info["num_unk_dropped"]) == (14, 4)
    (held,) = text_module.heldout_files(list(_SAMPLES), 0.34)
    x, y = next(ds.eval_batches(info["num_eval"]))
    assert x.dtype == y.dtype == torch.int64 and x.shape == (len(_SAMPLES[held]), 2)
    got = sorted(zip(map(tuple, x.tolist()), y.tolist()))
    assert got == sorted(_SAMPLES[held])
    x, y = ds.train_batch(0, 2000)
    want = {s for rel, samples in _SAMPLES.items() if rel != held for s in samples}
    assert set(zip(map(tuple, x.tolist()), y.tolist())) == want
    assert ds.decode(torch.tensor([1, 0, 5])) == ["x", "<unk>", "<pad>"]


def test_text_large_vocabulary_keeps_all_words(fixture_root, tmp_path):
    ds = _text(fixture_root, tmp_path, num_classes=100)
    assert ds.vocab[1:4] == ["x", "f", "os"]
    assert ds.vocab[4:] == ["def", "import", "path", "return", "y"]
    assert ds.input_dim == 10 and ds.describe()["num_unk_dropped"] == 0


def _corpus(root, num_files: int = 12) -> None:
    words = [f"w{i}" for i in range(30)]
    files = {f"m{f:02d}.py": " ".join(words[(f * 7 + i * i) % 30] for i in range(200))
             for f in range(num_files)}
    _write(root, files)


def test_text_determinism_ranks_and_eval_split(tmp_path):
    _corpus(tmp_path / "src")
    ds = _text(tmp_path / "src", tmp_path, num_classes=20, context=3, heldout_fraction=0.25, seed=1)
    assert ds.describe()["num_heldout_files"] == 3
    again = _text(tmp_path / "src", tmp_path, num_classes=20, context=3, heldout_fraction=0.25, seed=1)
    a, b = ds.train_batch(5, 64, 1, 2), again.train_batch(5, 64, 1, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for other in (ds.train_batch(5, 64, 0, 2), ds.train_batch(6, 64, 1, 2)):
        assert not torch.equal(a[0], other[0])
    assert 1 <= a[1].min() and a[1].max() < 20 and a[0].max() <= ds.pad_id
    for world_size in (1, 2, 3):
        _check_eval_split(ds, 16, world_size)
    # Shares are disjoint: positions of ranks 0 and 1 never overlap.
    ranges = [eval_batch_ranges(ds.describe()["num_eval"], 16, r, 2) for r in range(2)]
    assert not {i for s, e in ranges[0] for i in range(s, e)} & {i for s, e in ranges[1] for i in range(s, e)}


def test_text_cache_written_and_reused(fixture_root, tmp_path, monkeypatch):
    ds = _text(fixture_root, tmp_path)
    assert ds.cache_path.is_file() and ds.cache_path.is_relative_to(tmp_path / "cache")
    assert [p.name for p in ds.cache_path.parent.iterdir()] == ["data.npz"]  # no tmp files left

    def fail(*args, **kwargs):
        raise AssertionError("tokenise called although the cache exists")

    monkeypatch.setattr(text_module, "tokenise", fail)
    cached = _text(fixture_root, tmp_path)
    assert cached.vocab == ds.vocab and torch.equal(cached.train_batch(3, 50)[1], ds.train_batch(3, 50)[1])
    monkeypatch.undo()
    (fixture_root / "a.py").write_text("def f(x):\n    return x + x + x\n")  # new key
    changed = _text(fixture_root, tmp_path)
    assert changed.cache_path != ds.cache_path and changed.describe()["num_tokens"] == 15
    ds.cache_path.write_bytes(b"not an npz file")  # unreadable cache: rebuilt
    assert _text(fixture_root, tmp_path).describe()["num_tokens"] == 15
    assert _text(fixture_root, tmp_path, context=3).cache_path != changed.cache_path


@pytest.mark.parametrize("kwargs, match", [
    ({"num_classes": 1}, "num_classes"), ({"context": 0}, "context"),
    ({"heldout_fraction": 0.0}, "heldout_fraction"), ({"heldout_fraction": 1.0}, "heldout_fraction"),
])
def test_text_bad_args(fixture_root, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _text(fixture_root, tmp_path, **kwargs)


def test_text_bad_root(tmp_path):
    with pytest.raises(ValueError, match="root"):
        _text(tmp_path / "missing", tmp_path)
    _write(tmp_path / "one", {"only.py": "a b c"})
    with pytest.raises(ValueError, match="at least 2"):
        _text(tmp_path / "one", tmp_path)


def test_text_excludes_site_packages(fixture_root):
    rel = [p.relative_to(fixture_root).as_posix() for p in text_module.list_sources(fixture_root)]
    assert rel == ["a.py", "pkg/b.py", "pkg/c.py"]
