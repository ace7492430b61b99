"""Native kernels for ds_xc, each behind a DeepSpeed OpBuilder with a PyTorch fallback.

The Hamming top-k scan (binary codes + inverted file) used by the ANN sampler:
``hamming_topk_ivf``, ``hamming_topk_flat``, ``pack_signs``, ``unpack_bits`` and
``available_backends``; see docs/ops.md. Triton kernels (optional, imported on use):
``ops.hamming_triton`` (``backend="triton"``) and ``ops.triton_select.select_above``
(the compressors' threshold selection).
"""
from ops.hamming import (available_backends, hamming_topk_flat, hamming_topk_ivf,
                         pack_signs, unpack_bits)

__all__ = ["hamming_topk_ivf", "hamming_topk_flat", "pack_signs", "unpack_bits",
           "available_backends"]
