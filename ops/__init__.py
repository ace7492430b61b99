"""Native kernels for ds_xc, each behind a DeepSpeed OpBuilder with a PyTorch fallback.

The Hamming top-k scan (binary codes + inverted file) used by the ANN sampler:
``hamming_topk_ivf``, ``hamming_topk_flat``, ``pack_signs``, ``unpack_bits`` and
``available_backends``; see docs/ops.md.

Triton kernels (optional) are imported on use, never here, since Triton reads
TRITON_INTERPRET when its kernels are decorated: the kernels of the fused class-parallel
margin softmax (``ds_xc_ops.triton_softmax_kernels``; driven from the head by
``ds_xc.head.triton_softmax``, chosen by ``ds_xc.head.softmax_backend``), the Hamming scan
(``ds_xc_ops.hamming_triton``, ``backend="triton"``) and the compressors' threshold selection
(``ds_xc_ops.triton_select.select_above``).
"""
from ds_xc_ops.hamming import (available_backends, hamming_topk_flat, hamming_topk_ivf,
                         pack_signs, unpack_bits)

__all__ = ["hamming_topk_ivf", "hamming_topk_flat", "pack_signs", "unpack_bits",
           "available_backends"]
