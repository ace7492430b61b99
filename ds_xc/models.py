"""Small backbones for the built-in data sets (CPU-trainable, a few hundred K parameters).

ds_xc does not own the user's backbone; these exist so that the launcher, tests and
benchmarks have something to train. ``build_backbone`` picks one from the data set's
``input_kind`` (dense, tokens, image); each maps inputs (B, ...) to embeddings
(B, embedding_dim) float32.
"""

from __future__ import annotations

import logging

from torch import Tensor, nn
from torch.nn import functional as F

from ds_xc.data.base import XCDataset

logger = logging.getLogger(__name__)


def _mlp(in_dim: int, hidden_dim: int, out_dim: int) -> nn.Sequential:
    """in -> hidden -> hidden -> out with GELU; LayerNorm keeps the hidden scale stable."""
    return nn.Sequential(
        nn.Linear(in_dim, hidden_dim),
        nn.GELU(),
        nn.LayerNorm(hidden_dim),
        nn.Linear(hidden_dim, hidden_dim),
        nn.GELU(),
        nn.LayerNorm(hidden_dim),
        nn.Linear(hidden_dim, out_dim),
    )


class DenseBackbone(nn.Module):
    """MLP for dense inputs: (B, input_dim) float -> (B, embedding_dim)."""

    def __init__(self, input_dim: int, embedding_dim: int, hidden_dim: int = 256) -> None:
        super().__init__()
        self.mlp = _mlp(input_dim, hidden_dim, embedding_dim)

    def forward(self, x_BI: Tensor) -> Tensor:
        return self.mlp(x_BI.float())


class TokenBackbone(nn.Module):
    """Embeds each of the ``context`` input tokens and concatenates them in order
    (so the model knows which word came last), then an MLP.

    (B, context) int64 -> (B, context, hidden) -> (B, context*hidden) -> (B, embedding_dim)
    """

    def __init__(
        self, vocab_size: int, context: int, embedding_dim: int, hidden_dim: int = 256
    ) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab_size, hidden_dim)
        self.mlp = _mlp(context * hidden_dim, hidden_dim, embedding_dim)

    def forward(self, tokens_BK: Tensor) -> Tensor:
        if tokens_BK.dim() != 2 or tokens_BK.shape[1] != self.context:
            raise ValueError(
                f"tokens shape {tuple(tokens_BK.shape)} is invalid: expected (B, {self.context})"
            )
        h_BKH = self.embed(tokens_BK)
        return self.mlp(h_BKH.flatten(1))


class _StatsDtypeNorm:
    """A BatchNorm that computes in its running statistics' dtype. DeepSpeed's bf16 casts a module's
    parameters but keeps its buffers in float32, and batch_norm wants input, weight and statistics in one
    dtype (the CPU kernel refuses the mix): the input and the affine parameters are cast to the statistics'
    dtype and the output back to the input's. Otherwise it is nn.BatchNorm (momentum 0.1, running stats)."""

    def forward(self, x: Tensor) -> Tensor:
        dtype = self.running_mean.dtype
        if x.dtype == dtype and self.weight.dtype == dtype:
            return super().forward(x)
        self._check_input_dim(x)
        if self.training:
            self.num_batches_tracked.add_(1)
        out = F.batch_norm(x.to(dtype), self.running_mean, self.running_var, self.weight.to(dtype),
                           self.bias.to(dtype), self.training, self.momentum, self.eps)
        return out.to(x.dtype)


class BatchNorm1d(_StatsDtypeNorm, nn.BatchNorm1d):
    """nn.BatchNorm1d that also runs with bf16 parameters and float32 statistics (see _StatsDtypeNorm)."""


class BatchNorm2d(_StatsDtypeNorm, nn.BatchNorm2d):
    """nn.BatchNorm2d that also runs with bf16 parameters and float32 statistics (see _StatsDtypeNorm)."""


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    """Two 3x3 conv + BatchNorm + ReLU, then a 2x2 max-pool: (B, cin, H, W) -> (B, cout, H/2, W/2)."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class ImageBackbone(nn.Module):
    """A small CNN for image inputs, shaped like face-recognition heads' backbones.

    Three conv blocks of width w, 2w, 4w (w = hidden_dim // 16, at least 8) halve the
    image three times; then BatchNorm, flatten, dropout-free linear to the embedding and
    a final BatchNorm1d (the "BN-FC-BN" output of ArcFace's backbones).

    (B, C, H, W) float -> (B, 4w, H/8, W/8) -> (B, embedding_dim), in the dtype of the weights (the
    images are cast to it: float32, or bfloat16 when DeepSpeed's bf16 has cast the module)
    """

    def __init__(self, input_shape: tuple, embedding_dim: int, hidden_dim: int = 256) -> None:
        super().__init__()
        channels, height, width = input_shape
        if height % 8 or width % 8:
            raise ValueError(f"input_shape={tuple(input_shape)} is invalid: height and width must be multiples of 8")
        w = max(8, hidden_dim // 16)
        self.features = nn.Sequential(_conv_block(channels, w), _conv_block(w, 2 * w), _conv_block(2 * w, 4 * w),
                                      BatchNorm2d(4 * w))
        self.fc = nn.Linear(4 * w * (height // 8) * (width // 8), embedding_dim)
        self.bn = BatchNorm1d(embedding_dim)
        self.input_shape = tuple(input_shape)

    def forward(self, x_BCHW: Tensor) -> Tensor:
        if tuple(x_BCHW.shape[1:]) != self.input_shape:
            raise ValueError(f"image batch shape {tuple(x_BCHW.shape)} is invalid: expected (B, "
                             f"{', '.join(map(str, self.input_shape))})")
        h = self.features(x_BCHW.to(self.fc.weight.dtype))  # (B, 4w, H/8, W/8); bf16 under DeepSpeed's bf16
        return self.bn(self.fc(h.flatten(1)))


# input_kind -> constructor from (dataset, embedding_dim, hidden_dim)
BACKBONES = {
    "dense": lambda ds, emb, hid: DenseBackbone(ds.input_dim, emb, hid),
    "tokens": lambda ds, emb, hid: TokenBackbone(ds.input_dim, ds.context, emb, hid),
    "image": lambda ds, emb, hid: ImageBackbone(ds.input_shape, emb, hid),
}


def build_backbone(dataset: XCDataset, embedding_dim: int, hidden_dim: int = 256) -> nn.Module:
    """The backbone matching ``dataset.input_kind``, mapping its inputs to (B, embedding_dim)."""
    if embedding_dim < 1:
        raise ValueError(f"embedding_dim={embedding_dim} is invalid: must be >= 1")
    if hidden_dim < 1:
        raise ValueError(f"hidden_dim={hidden_dim} is invalid: must be >= 1")
    kind = dataset.input_kind
    if kind not in BACKBONES:
        raise ValueError(f"dataset.input_kind={kind!r} is invalid: allowed {sorted(BACKBONES)}")
    model = BACKBONES[kind](dataset, embedding_dim, hidden_dim)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("backbone %s for %s: %d parameters", type(model).__name__, kind, num_params)
    return model
