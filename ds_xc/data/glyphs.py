"""``glyphs``: CJK character recognition as an embedding task, rendered from Debian fonts.

One class per CJK Unified Ideograph (U+4E00..U+9FFF); each class has a few *designs*
(the glyph in different fonts), rendered once into a cache and augmented per sample.
The task is trained like face recognition (ArcFace / CosFace over a class-parallel
head) and evaluated as face recognition is: by verification on designs never seen in
training (held-out fonts), TAR at FAR 1e-3 and 1e-4 (:func:`ds_xc.evaluate.verification`).

Fonts come from Debian packages fetched without installing them (ds_xc/data/debian.py):
``fonts-noto-cjk``, ``fonts-arphic-uming``/``-ukai``, ``fonts-wqy-zenhei``/``-microhei``,
``fonts-hanazono``, ``fonts-ipafont-mincho``/``-gothic`` (licences in docs/data.md).

Rendering (Pillow's FreeType): each glyph is drawn at 7/8 of the image size and
centred on its ink box, as 8-bit grey levels. A font *covers* a character when its
rendering differs from the font's missing-glyph box (the rendering of U+10FFFD) and has
ink. A class is kept when at least ``min_designs`` training fonts cover it; classes are
the first ``num_classes`` such characters in code point order.

Samples are a pure function of (seed, sample index) (see ds_xc/data/base.py): the class
is uniform, the design uniform among the training fonts covering it, and the
augmentation (rotation, anisotropic scale, shear, shift, stroke thickening or
thinning, pixel noise) is drawn from the same counter-based hash, applied batch-wise
with ``affine_grid``/``grid_sample``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ds_xc.data.base import (XCDataset, derive_salt, eval_batch_ranges, hash_normal, hash_uniform,
                             train_sample_indices)

logger = logging.getLogger(__name__)

__all__ = ["Design", "DESIGNS", "GlyphDataset", "render_font", "fetch_fonts"]

FIRST, LAST = 0x4E00, 0x9FFF  # CJK Unified Ideographs (the URO block)
_MISSING = chr(0x10FFFD)  # a private-use code point no font maps: its rendering is the .notdef box
_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Design:
    """One font face: its Debian package, the file inside it, the face index and its split."""
    name: str
    package: str
    path: str  # relative to the unpacked package root
    face: int
    split: str  # "train" or "heldout"


DESIGNS: tuple[Design, ...] = (
    Design("noto-sans-sc", "fonts-noto-cjk", "usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc", 2, "train"),
    Design("noto-sans-sc-bold", "fonts-noto-cjk", "usr/share/fonts/opentype/noto/NotoSansCJK-Bold.ttc", 2, "train"),
    Design("noto-serif-sc", "fonts-noto-cjk", "usr/share/fonts/opentype/noto/NotoSerifCJK-Regular.ttc", 2, "train"),
    Design("noto-serif-sc-bold", "fonts-noto-cjk", "usr/share/fonts/opentype/noto/NotoSerifCJK-Bold.ttc", 2,
           "train"),
    Design("ar-pl-uming", "fonts-arphic-uming", "usr/share/fonts/truetype/arphic/uming.ttc", 0, "train"),
    Design("wqy-zenhei", "fonts-wqy-zenhei", "usr/share/fonts/truetype/wqy/wqy-zenhei.ttc", 0, "train"),
    Design("hanamin-a", "fonts-hanazono", "usr/share/fonts/truetype/hanazono/HanaMinA.ttf", 0, "train"),
    Design("ipa-mincho", "fonts-ipafont-mincho", "usr/share/fonts/opentype/ipafont-mincho/ipam.ttf", 0, "train"),
    Design("ar-pl-ukai", "fonts-arphic-ukai", "usr/share/fonts/truetype/arphic/ukai.ttc", 0, "heldout"),
    Design("ipa-gothic", "fonts-ipafont-gothic", "usr/share/fonts/opentype/ipafont-gothic/ipag.ttf", 0, "heldout"),
    Design("wqy-microhei", "fonts-wqy-microhei", "usr/share/fonts/truetype/wqy/wqy-microhei.ttc", 0, "heldout"),
)


def _pil():
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError("the glyphs data set renders fonts with Pillow: pip install 'ds-xc[data]' "
                          "(or pip install pillow)") from exc
    return Image, ImageDraw, ImageFont


def render_font(path: str, face: int, code_points: Sequence[int], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Render ``code_points`` of one font face: ((n, size, size) uint8 images, (n,) bool coverage).

    Uncovered characters (the missing-glyph box, or no ink) get a blank image.
    """
    Image, ImageDraw, ImageFont = _pil()
    try:
        font = ImageFont.truetype(str(path), max(4, size * 7 // 8), index=face)
    except OSError as exc:
        raise OSError(f"cannot read font {path} (face {face}): {exc}") from exc
    missing = font.getmask(_MISSING)
    missing_key = (missing.size, bytes(missing))
    images = np.zeros((len(code_points), size, size), dtype=np.uint8)
    covered = np.zeros(len(code_points), dtype=bool)
    for i, cp in enumerate(code_points):
        ch = chr(cp)
        mask = font.getmask(ch)
        if mask.size[0] == 0 or (mask.size, bytes(mask)) == missing_key:
            continue
        left, top, right, bottom = font.getbbox(ch)
        if right <= left or bottom <= top:
            continue
        img = Image.new("L", (size, size), 0)
        ImageDraw.Draw(img).text(((size - (right - left)) / 2 - left, (size - (bottom - top)) / 2 - top), ch,
                                 fill=255, font=font)
        images[i] = np.asarray(img)
        covered[i] = images[i].any()
    return images, covered


def fetch_fonts(designs: Sequence[Design] = DESIGNS, cache_dir=None) -> dict[str, Path]:
    """Fetch (apt-get download + unpack, cached) the packages of ``designs``; {design name: font file}."""
    from ds_xc.data.debian import PackageSpec, default_cache_dir, fetch_package
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    (cache / "debs").mkdir(parents=True, exist_ok=True)
    roots: dict[str, Path] = {}
    out = {}
    for d in designs:
        if d.package not in roots:
            spec = PackageSpec(d.package, d.package.replace("+", r"\+"), f"fonts for the glyphs data set ({d.package})")
            roots[d.package] = fetch_package(spec, cache).root
        path = roots[d.package] / d.path
        if not path.is_file():
            raise FileNotFoundError(f"font {d.path} of design {d.name!r} is not in package {d.package} "
                                    f"(unpacked in {roots[d.package]})")
        out[d.name] = path
    return out


def _glyph_cache_dir() -> Path:
    if os.environ.get("DS_XC_CACHE"):
        return Path(os.environ["DS_XC_CACHE"]) / "glyphs"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds_xc" / "glyphs"


def load_renderings(fonts: dict[str, Path], designs: Sequence[Design], size: int,
                    cache_dir: Optional[Path] = None, block: tuple[int, int] = (FIRST, LAST)
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(F, n, size, size) uint8 images and (F, n) coverage of the code points ``block``
    (inclusive; default the URO block), per design, rendered once and cached as .npz
    files (``$DS_XC_CACHE/glyphs`` or ~/.cache/ds_xc/glyphs)."""
    folder = Path(cache_dir) if cache_dir is not None else _glyph_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    code_points = list(range(block[0], block[1] + 1))
    images, coverage = [], []
    for d in designs:
        path = Path(fonts[d.name])
        stat = path.stat()
        key = folder / f"v{_FORMAT}_{d.name}_{size}px_{stat.st_size}_{block[0]:x}-{block[1]:x}.npz"
        if key.is_file():
            with np.load(key) as z:
                img, cov = z["images"], z["covered"]
        else:
            logger.info("rendering %d characters of %s (%s face %d) at %d px", len(code_points), d.name,
                        path.name, d.face, size)
            img, cov = render_font(str(path), d.face, code_points, size)
            tmp = key.with_suffix(f".{os.getpid()}.tmp.npz")  # per process: two renderers never share it
            np.savez_compressed(tmp, images=img, covered=cov)
            os.replace(tmp, key)
            logger.info("%s covers %d of %d characters; cached in %s", d.name, int(cov.sum()), len(code_points), key)
        images.append(img)
        coverage.append(cov)
    return np.stack(images), np.stack(coverage)


class GlyphDataset(XCDataset):
    """CJK glyph recognition: (B, 1, size, size) float images, labels = character classes.

    Args:
        num_classes: classes to keep (the first ones, in code point order, among the
            characters at least ``min_designs`` training fonts cover); more than are
            available raises ValueError naming the count.
        seed: sample stream seed.
        image_size: rendering size in pixels.
        min_designs: training fonts that must cover a class.
        augment: strength of the augmentation (0: none; 1: the default ranges).
        num_eval: held-out classification samples (training fonts, fresh augmentations).
        fonts: {design name: font file}; default: fetched from Debian (cached).
        designs: the designs to use (default DESIGNS; each has a train/heldout split).
        cache_dir: where renderings are cached.
        block: the inclusive code point range the classes come from (default the CJK URO
            block; tests use a Latin range with a font they carry).
    """

    name = "glyphs"
    input_kind = "image"
    context = 0

    def __init__(self, num_classes: int, seed: int = 0, image_size: int = 32, min_designs: int = 3,
                 augment: float = 1.0, num_eval: int = 8192, fonts: Optional[dict] = None,
                 designs: Sequence[Design] = DESIGNS, cache_dir=None, block: tuple[int, int] = (FIRST, LAST)):
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes} is invalid: must be >= 2")
        if not 8 <= image_size <= 256:
            raise ValueError(f"image_size={image_size} is invalid: must be in [8, 256]")
        if augment < 0:
            raise ValueError(f"augment={augment} is invalid: must be >= 0")
        self.designs = tuple(designs)
        train = [i for i, d in enumerate(self.designs) if d.split == "train"]
        held = [i for i, d in enumerate(self.designs) if d.split == "heldout"]
        if not 1 <= min_designs <= len(train):
            raise ValueError(f"min_designs={min_designs} is invalid: must be in [1, {len(train)}] "
                             f"(the number of training designs)")
        fonts = fonts if fonts is not None else fetch_fonts(self.designs)
        images, coverage = load_renderings(fonts, self.designs, image_size, cache_dir, block)  # (F, n, s, s), (F, n)
        keep = np.flatnonzero(coverage[train].sum(0) >= min_designs)  # URO positions of the usable classes
        if num_classes > keep.size:
            raise ValueError(f"num_classes={num_classes} is invalid: only {keep.size} characters are covered by "
                             f">= {min_designs} training fonts; use num_classes <= {keep.size}")
        keep = keep[:num_classes]
        self.num_classes, self.seed, self.image_size = int(num_classes), int(seed), int(image_size)
        self.augment, self.num_eval, self.min_designs = float(augment), int(num_eval), int(min_designs)
        self.code_points = (keep + block[0]).astype(np.int64)  # (C,) the character of each class
        self.input_dim = image_size * image_size
        self.input_shape = (1, image_size, image_size)
        self._train_designs, self._held_designs = train, held
        self._images = torch.from_numpy(np.ascontiguousarray(images[:, keep]))  # (F, C, s, s) uint8
        cov = torch.from_numpy(coverage[:, keep])  # (F, C)
        cov_train = cov[train]  # (F_train, C)
        self._count = cov_train.sum(0)  # (C,) covering training designs per class
        order = torch.argsort((~cov_train).to(torch.int8), dim=0, stable=True)  # covering designs first
        self._covering = torch.tensor(train)[order].t().contiguous()  # (C, F_train) design ids, covering first
        self._held_cov = cov[held] if held else torch.zeros((0, self.num_classes), dtype=torch.bool)
        self._salt = derive_salt("glyphs", seed)
        self._eval_salt = derive_salt("glyphs-eval", seed)
        logger.info("glyphs: %d classes (U+%04X..U+%04X), %d training and %d held-out designs, %d px",
                    self.num_classes, int(self.code_points[0]), int(self.code_points[-1]), len(train), len(held),
                    image_size)

    # ------------------------------------------------------------------ samples
    def _samples(self, index: Tensor, salt: int) -> tuple[Tensor, Tensor]:
        """(N,) global sample indices -> ((N, 1, s, s) float32 images, (N,) int64 labels)."""
        u = hash_uniform(index, salt, 9)  # (N, 9) float64 in (0, 1)
        labels = (u[:, 0] * self.num_classes).long().clamp_max(self.num_classes - 1)
        pick = (u[:, 1] * self._count[labels]).long()
        design = self._covering[labels, pick.clamp_max(self._covering.shape[1] - 1)]
        x = self._images[design, labels].float().div_(255.0).unsqueeze(1)  # (N, 1, s, s) in [0, 1]
        if self.augment > 0:
            noise = hash_normal(index, salt ^ 0x5DEECE66D, self.image_size ** 2).view_as(x)  # (N, 1, s, s)
            x = self._augment(x, u[:, 2:].float(), noise)
        return x.sub_(0.5).div_(0.5), labels

    def _augment(self, x: Tensor, u: Tensor, noise: Tensor) -> Tensor:
        """Random affine warp, stroke weight and pixel noise, per sample; u (N, 7) uniforms in (0, 1),
        noise (N, 1, s, s) standard normals."""
        a = self.augment
        c = (u - 0.5) * 2.0  # (N, 7) in (-1, 1)
        angle = c[:, 0] * math.radians(10.0) * a
        scale_x = 1.0 + c[:, 1] * 0.12 * a
        scale_y = scale_x * (1.0 + c[:, 2] * 0.08 * a)
        shear = c[:, 3] * 0.15 * a
        cos, sin = torch.cos(angle), torch.sin(angle)
        theta = torch.zeros((x.shape[0], 2, 3))  # output -> input coordinates
        theta[:, 0, 0], theta[:, 0, 1] = cos / scale_x, (-sin + shear) / scale_x
        theta[:, 1, 0], theta[:, 1, 1] = sin / scale_y, cos / scale_y
        theta[:, 0, 2] = c[:, 4] * 0.1 * a
        theta[:, 1, 2] = c[:, 5] * 0.1 * a
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        stroke = c[:, 6].view(-1, 1, 1, 1) * a  # > 0 thicker, < 0 thinner
        thick = F.max_pool2d(x, 3, stride=1, padding=1)
        thin = -F.max_pool2d(-x, 3, stride=1, padding=1)
        x = torch.where(stroke > 0, x + stroke * (thick - x), x - stroke * (thin - x))
        return x.add_(noise.mul_(0.05 * a)).clamp_(0.0, 1.0)

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1,
                    sample_offset: int = 0) -> tuple[Tensor, Tensor]:
        return self._samples(train_sample_indices(step, batch_size, rank, world_size, sample_offset), self._salt)

    def eval_batches(self, batch_size: int, rank: int = 0, world_size: int = 1,
                     max_samples: Optional[int] = None) -> Iterator[tuple[Tensor, Tensor]]:
        n = self.num_eval if max_samples is None else min(self.num_eval, max_samples)
        for a, b in eval_batch_ranges(n, batch_size, rank, world_size):
            yield self._samples(torch.arange(a, b, dtype=torch.int64), self._eval_salt)

    # ------------------------------------------------------------------ verification
    def verification_set(self, max_classes: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
        """The held-out designs, unaugmented: ((M, 1, s, s) images, (M,) labels, (M,) design ids).

        Classes covered by every held-out design (at most ``max_classes``, the first
        ones), so each class gives one genuine pair per pair of held-out designs.
        """
        if not self._held_designs:
            raise ValueError("no held-out designs: give designs with split='heldout'")
        classes = torch.nonzero(self._held_cov.all(0)).squeeze(1)  # (C_v,)
        if max_classes is not None:
            classes = classes[:max_classes]
        held = torch.tensor(self._held_designs)
        design = held.repeat_interleave(classes.numel())  # (F_h * C_v,)
        labels = classes.repeat(held.numel())
        x = self._images[design, labels].float().div_(255.0).unsqueeze(1).sub_(0.5).div_(0.5)
        return x, labels, design

    def describe(self) -> dict:
        cov = self._count.float()
        return {"name": self.name, "num_classes": self.num_classes, "image_size": self.image_size,
                "train_designs": [self.designs[i].name for i in self._train_designs],
                "heldout_designs": [self.designs[i].name for i in self._held_designs],
                "designs_per_class_mean": float(cov.mean()), "verification_classes": int(self._held_cov.all(0).sum()),
                "first_char": chr(int(self.code_points[0])), "num_eval": self.num_eval}
