"""The glyphs data set on a Latin block with the font Pillow carries (no download), the image
backbone, and TAR at FAR against exhaustive float64 references."""
import itertools

import copy

import pytest
import torch

PIL = pytest.importorskip("PIL", reason="the glyphs data set needs Pillow (pip install 'ds-xc[data]')")
from PIL import ImageFont  # noqa: E402

from ds_xc.data.glyphs import Design, GlyphDataset, render_font  # noqa: E402
from ds_xc.evaluate import tar_at_far, verification  # noqa: E402
from ds_xc.models import ImageBackbone, build_backbone  # noqa: E402

BLOCK = (0x41, 0x5A)  # A..Z


@pytest.fixture(scope="module")
def font_file(tmp_path_factory):
    font = ImageFont.load_default(size=20)
    if not hasattr(font, "path") or not hasattr(font.path, "getvalue"):
        pytest.skip("this Pillow has no FreeType default font to write out")
    path = tmp_path_factory.mktemp("fonts") / "default.ttf"
    path.write_bytes(font.path.getvalue())
    return path


DESIGNS = [Design(f"d{i}", "none", "default.ttf", 0, "train" if i < 3 else "heldout") for i in range(5)]


@pytest.fixture(scope="module")
def build(font_file, tmp_path_factory):
    """GlyphDataset over A..Z with five designs (three training, two held out) of one font."""
    cache = tmp_path_factory.mktemp("cache")

    def make(num_classes=20, **kw):
        kw = dict(dict(seed=1, image_size=16, min_designs=2, num_eval=64), **kw)
        return GlyphDataset(num_classes, fonts={d.name: font_file for d in DESIGNS}, designs=DESIGNS,
                            cache_dir=cache, block=BLOCK, **kw)
    return make


@pytest.fixture(scope="module")
def dataset(build):
    return build()


def test_render_font_marks_missing_characters(font_file):
    images, covered = render_font(str(font_file), 0, [0x41, 0x4E00, 0x10FFFD - 1], 16)
    assert covered.tolist() == [True, False, False]  # a CJK ideograph is not in a Latin font
    assert images[0].any() and not images[1].any() and images.shape == (3, 16, 16)


def test_classes_shapes_and_ranges(dataset, build):
    assert dataset.num_classes == 20 and dataset.code_points[0] == ord("A")
    x, y = dataset.train_batch(0, 32)
    assert x.shape == (32, 1, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert -1.0 <= x.min() and x.max() <= 1.0 and 0 <= y.min() and y.max() < 20
    assert len(set(y.tolist())) > 10
    with pytest.raises(ValueError, match="num_classes=27 is invalid: only 26 characters are covered"):
        build(27)


def test_samples_are_a_pure_function_of_the_index(dataset):
    x, y = dataset.train_batch(5, 16, 0, 1)
    x2, y2 = dataset.train_batch(5, 8, 1, 2)  # the second half of the same global batch
    assert torch.equal(x[8:], x2) and torch.equal(y[8:], y2)
    assert not torch.equal(dataset.train_batch(6, 16)[0], x)
    ev = list(dataset.eval_batches(16))
    assert len(ev) == 4 and not torch.equal(ev[0][0], x)
    assert torch.equal(list(dataset.eval_batches(16))[0][0], ev[0][0])


def test_augmentation_changes_images_but_keeps_ink(dataset, build):
    plain = build(augment=0.0)
    xa, ya = dataset.train_batch(2, 16)
    xp, yp = plain.train_batch(2, 16)
    assert torch.equal(ya, yp)
    diff = (xa - xp).abs().mean().item()
    assert 0.01 < diff < 0.8
    assert ((xa > 0).float().mean() > 0.02)  # still ink on the page


def test_verification_set_holds_the_heldout_designs(dataset):
    x, labels, designs = dataset.verification_set()
    assert x.shape == (2 * 20, 1, 16, 16)
    assert sorted(set(designs.tolist())) == [3, 4] and labels.bincount().tolist() == [2] * 20


def test_image_backbone_shapes():
    net = build_backbone(type("D", (), {"input_kind": "image", "input_shape": (1, 16, 16)})(), 24, hidden_dim=128)
    assert isinstance(net, ImageBackbone)
    assert net(torch.randn(5, 1, 16, 16)).shape == (5, 24)
    with pytest.raises(ValueError, match=r"expected \(B, 1, 16, 16\)"):
        net(torch.randn(5, 1, 8, 8))


@pytest.mark.parametrize("buffers", ["float32", "bfloat16"])
def test_image_backbone_runs_in_bf16_like_float32(buffers):
    """DeepSpeed 0.19's bf16 casts the parameters and keeps the buffers (BatchNorm's running statistics) in
    float32 (``buffers`` bfloat16: a plain module.bfloat16()); launch/train.py then feeds bf16 images (float32
    ones work too). Training and eval mode follow the float32 network within bf16's rounding, and the running
    statistics move as float32's."""
    torch.manual_seed(0)
    net = build_backbone(type("D", (), {"input_kind": "image", "input_shape": (1, 16, 16)})(), 24, hidden_dim=128)
    x = torch.rand(32, 1, 16, 16)
    half = copy.deepcopy(net)
    for p in half.parameters():
        p.data = p.data.to(torch.bfloat16)
    if buffers == "bfloat16":
        half = half.to(torch.bfloat16)

    @torch.no_grad()
    def close(out, ref):  # bf16 rounding through 7 layers and 7 normalisations: a few percent
        assert out.dtype == torch.bfloat16
        assert float((out.float() - ref).norm() / ref.norm()) < 0.05

    close(half.train()(x.to(torch.bfloat16)), net.train()(x))  # one training forward each
    for a, b in ((a, b) for a, b in zip(net.modules(), half.modules()) if isinstance(a, torch.nn.BatchNorm2d)):
        assert b.running_mean.dtype == getattr(torch, buffers) and float(a.running_mean.abs().max()) > 0  # moved
        assert int(b.num_batches_tracked) == int(a.num_batches_tracked) == 1
        torch.testing.assert_close(b.running_mean.float(), a.running_mean, rtol=0.05, atol=0.01)
        torch.testing.assert_close(b.running_var.float(), a.running_var, rtol=0.05, atol=0.01)
    ref = net.eval()(x)
    for inp in (x.to(torch.bfloat16), x):
        close(half.eval()(inp), ref)


def test_tar_at_far_matches_a_plain_reference():
    gen = torch.Generator().manual_seed(0)
    genuine = torch.randn(500, generator=gen, dtype=torch.float64) + 2.0
    impostor = torch.randn(20000, generator=gen, dtype=torch.float64)
    out = tar_at_far(genuine, impostor, (1e-2, 1e-3))
    for far in (1e-2, 1e-3):
        allowed = int(far * impostor.numel())
        thr = sorted(impostor.tolist(), reverse=True)[allowed - 1]
        assert sum(v > thr for v in impostor.tolist()) == allowed - 1  # at most far * n accepted
        assert out[f"tar@far={far:g}"] == pytest.approx(sum(g > thr for g in genuine.tolist()) / 500)
    with pytest.raises(ValueError, match="far=1e-05 is invalid"):
        tar_at_far(genuine, impostor, (1e-5,))


def test_verification_pairs_and_perfect_embeddings():
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    designs = torch.tensor([0, 1, 2, 0, 2, 0, 1, 1])
    images = torch.nn.functional.one_hot(labels, 3).float()  # embed = identity: genuine 1, impostor 0
    out = verification(lambda x: x + 1e-3 * torch.randn_like(x), images, labels, designs, fars=(0.1,),
                       num_impostor=1000)
    expected = sum(1 for i, j in itertools.combinations(range(8), 2)
                   if labels[i] == labels[j] and designs[i] != designs[j])
    assert out["genuine_pairs"] == expected == 3 + 1 + 2
    assert out["tar@far=0.1"] == 1.0 and 0 < out["impostor_pairs"] <= 1000
