"""DeepSpeed OpBuilders for the native kernels, and a loader that falls back.

``HammingBuilder`` (C++/OpenMP, ops/csrc/hamming_cpu.cpp), ``HammingCudaBuilder``
(ops/csrc/hamming_cuda.cu + hamming_cuda_binding.cpp), ``RowsBuilder`` (the fused row
kernels of the head optimizers' lazy steps, ops/csrc/rows_cpu.cpp), ``SoftmaxBuilder`` (the
softmax's row exponentials, ops/csrc/softmax_cpu.cpp) and ``SelectBuilder`` (the gradient compressors'
threshold selection, ops/csrc/select_cpu.cpp) follow DeepSpeed's pattern:
``load()`` imports a prebuilt op if DeepSpeed's install recorded one, else JIT-compiles
it with ninja through ``torch.utils.cpp_extension.load`` into the torch extensions cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/py<ver>_<cpu|cuXYZ>/<name>``).
A later process finds the cached build and only loads it (well under a second); torch
rebuilds when a source or flag changes. The sources are found next to this file, so an
editable install and a wheel that ships ops/csrc/ both work.

Each op's name (so its build folder) carries a short hash of its sources, headers, flags, install
folder and torch (``ds_xc_ops.build_cache.op_name``): two checkouts or versions never share or rebuild
each other's builds. A build holds the folder exclusively (``build_cache.exclusive_build``): a lock
that a killed build left is removed with a warning, a process waiting for a live build says for whom,
and a build that is about to compile says so once, with its expected duration.

``load_op(kind)`` is what the Python API calls: it builds at most once per process and,
when the build fails, logs one warning and returns None so the caller falls back to the
PyTorch implementation.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import time

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

from ds_xc_ops.build_cache import build_folder, exclusive_build, is_built, op_name

__all__ = ["HammingBuilder", "HammingCudaBuilder", "RowsBuilder", "SoftmaxBuilder", "SelectBuilder", "load_op",
           "BUILDERS", "CSRC", "plain_arch_list", "plain_arch_lists_for_deepspeed", "included_headers"]

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _popcnt_flags() -> list:
    # The hardware popcount instruction; not -march=native, so that a build cached on a
    # shared home directory also runs on an older CPU of the same architecture.
    return ["-mpopcnt"] if platform.machine() in ("x86_64", "AMD64") else []


def _header_flags(*headers: str) -> list:
    """A define per included header of ops/csrc/ carrying its content hash: torch's JIT cache hashes the
    sources and the flags, not the headers they include, so an edit of a header rebuilds the op."""
    flags = []
    for name in headers:
        with open(os.path.join(CSRC, name), "rb") as f:
            sha = hashlib.sha1(f.read()).hexdigest()[:16]
        flags.append(f"-DDS_XC_{re.sub(r'[^A-Z0-9]', '_', name.upper())}_SHA={sha}")
    return flags


def included_headers(sources) -> list:
    """The ops/csrc/ headers that ``sources`` include (``#include "x.h"``), transitively, sorted."""
    seen, todo = set(), list(sources)
    while todo:
        with open(todo.pop()) as fh:
            for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', fh.read(), flags=re.M):
                path = os.path.join(CSRC, name)
                if path not in seen and os.path.isfile(path):
                    seen.add(path)
                    todo.append(path)
    return sorted(seen)


class _DsXcOp:
    """What every ds_xc op builder shares (mixed in before DeepSpeed's builder class): the base name
    ``NAME``, the build name ``self.name`` (``NAME`` and a hash of the sources, headers, flags and
    install: :func:`ds_xc_ops.build_cache.op_name`), the module it installs as
    (``ds_xc_ops.<NAME>_op``), the headers in ops/csrc/, and a JIT build that holds its folder
    exclusively and announces itself (:meth:`jit_load`). ``BUILD_S``: about how long a build takes
    (seconds, measured on 2 shared CPU cores), quoted in the message."""

    NAME = ""
    BUILD_S = 30

    def __init__(self):
        super().__init__(name=self.NAME)
        self.name = op_name(self.NAME, self.sources() + included_headers(self.sources()), self.hashed_flags(),
                            CSRC)

    def hashed_flags(self) -> list:
        """The flags that go into the build name (the C++ compiler's)."""
        return list(self.cxx_args())

    def absolute_name(self):
        return f"ds_xc_ops.{self.NAME}_op"

    def include_paths(self):
        return [CSRC]

    def build_folder(self) -> str:
        """Where torch builds (and caches) this op."""
        return build_folder(self.name)

    def jit_load(self, verbose=True):
        """DeepSpeed's JIT build, holding the build folder (a killed build's lock is removed, a live
        builder waited for with messages) and saying once, before it compiles, that it does."""
        with exclusive_build(self.name, f"C++ op {self.NAME}") as folder:
            if not is_built(self.name):
                logger.warning("building ds_xc's C++ ops (once, about %d s): %s into %s; later runs load it from "
                               "there. Build ahead of a job with: python -m ds_xc_ops.build",
                               self.BUILD_S, self.NAME, folder)
            return super().jit_load(verbose)


class HammingBuilder(_DsXcOp, OpBuilder):
    """C++ CPU kernel: OpenMP over queries, 64/32-bit popcount, bucket top-k selection."""

    NAME = "ds_xc_hamming_cpu"
    BUILD_S = 40

    def sources(self):
        return [os.path.join(CSRC, "hamming_cpu.cpp"), os.path.join(CSRC, "pack_cpu.cpp")]

    def cxx_args(self):
        return ["-O3", "-fopenmp", "-Wall", *_popcnt_flags(), *_header_flags("cpu_simd.h")]

    def extra_ldflags(self):
        return ["-fopenmp"]


_ARCH = re.compile(r"^(\d+)\.(\d+)[a-z]?(\+PTX)?$")


def plain_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` in the form DeepSpeed's builder parses: the architecture-specific
    suffix dropped ("9.0a" -> "9.0", "10.0a+PTX" -> "10.0+PTX"), separators as ";", duplicates once.

    CUDA images for Hopper and Blackwell often set "9.0a" or "10.0a"; DeepSpeed 0.19's
    ``compute_capability_args`` reads each entry as ``int`` and fails ("invalid literal for int()
    with base 10: '0a'"). Our kernels use no architecture-specific instructions (wgmma, setmaxnreg),
    so the plain target builds the same code. An entry that is not ``X.Y[a-z][+PTX]`` is kept as it is
    (DeepSpeed then names it in its own error)."""
    out = []
    for token in value.replace(",", ";").replace(" ", ";").split(";"):
        m = _ARCH.match(token.strip())
        plain = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}" if m else token.strip()
        if plain and plain not in out:
            out.append(plain)
    return ";".join(out)


def plain_arch_lists_for_deepspeed() -> bool:
    """Make every DeepSpeed CUDA op builder (FusedAdam, FusedLamb, ours) read an architecture-specific
    ``TORCH_CUDA_ARCH_LIST`` ("9.0a", the H200 image's) as the plain list (:func:`plain_arch_list`).

    DeepSpeed 0.19's ``CUDAOpBuilder.compute_capability_args`` reads each entry with ``int()`` and raises
    on "0a"; ds_xc used to normalise the variable only around its own build, so a user's FusedAdam (built
    by ``deepspeed.initialize``) still failed. The method is wrapped once, process-wide, when this module
    is imported (``import ds_xc`` does): inside it the list it parses (the one ``jit_load`` captured, the
    variable, the cross-compile list) is the plain one; the caller's variable is left as it is otherwise
    (DeepSpeed's ``jit_load`` restores it after the build). Returns False when already wrapped."""
    original = CUDAOpBuilder.compute_capability_args
    if getattr(original, "__ds_xc_plain__", False):
        return False

    def compute_capability_args(self, cross_compile_archs=None):
        jit = getattr(self, "_jit_arch_list", None)
        if jit:
            self._jit_arch_list = plain_arch_list(jit)
        env = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if env and plain_arch_list(env) != env.strip():
            os.environ["TORCH_CUDA_ARCH_LIST"] = plain_arch_list(env)  # DeepSpeed rewrites it next, from this
        return original(self, plain_arch_list(cross_compile_archs) if cross_compile_archs else cross_compile_archs)

    compute_capability_args.__ds_xc_plain__ = True
    compute_capability_args.__wrapped__ = original
    compute_capability_args.__doc__ = original.__doc__
    CUDAOpBuilder.compute_capability_args = compute_capability_args
    return True


plain_arch_lists_for_deepspeed()


class HammingCudaBuilder(_DsXcOp, CUDAOpBuilder):
    """CUDA kernel: one thread block per query, shared-memory histogram + radix select."""

    NAME = "ds_xc_hamming_cuda"
    BUILD_S = 90

    def sources(self):
        return [os.path.join(CSRC, "hamming_cuda_binding.cpp"),
                os.path.join(CSRC, "hamming_cuda.cu")]

    def is_compatible(self, verbose=False):
        import torch
        if not torch.cuda.is_available():
            self.error_log = "no CUDA device (or a CPU build of torch)"
            return False
        return super().is_compatible(verbose)

    def nvcc_args(self):
        return super().nvcc_args() + ["-lineinfo"]


class RowsBuilder(_DsXcOp, OpBuilder):
    """C++ CPU kernels: one in-place pass per row for the lazy SGD / AdamW steps and exact catch-ups
    (at::parallel_for over rows)."""

    NAME = "ds_xc_rows_cpu"
    BUILD_S = 25

    def sources(self):
        return [os.path.join(CSRC, "rows_cpu.cpp")]  # includes rows_body.h and cpu_simd.h

    def cxx_args(self):
        # no contraction: the loops fuse a multiply-add exactly where PyTorch's kernels do (std::fma)
        return ["-O3", "-Wall", "-ffp-contract=off", *_header_flags("rows_body.h", "cpu_simd.h")]


class SoftmaxBuilder(_DsXcOp, OpBuilder):
    """C++ CPU kernel: the softmax's row max, in-place exponentials and row sums of the logits
    scratch in two passes (AVX-512 polynomial exp, checked at run time; a scalar fallback)."""

    NAME = "ds_xc_softmax_cpu"
    BUILD_S = 30

    def sources(self):
        return [os.path.join(CSRC, "softmax_cpu.cpp")]

    def cxx_args(self):
        return ["-O3", "-Wall", *_header_flags("cpu_simd.h")]


class SelectBuilder(_DsXcOp, OpBuilder):
    """C++ CPU kernel: the positions and values of |v| >= t in one counting and one writing pass
    (AVX-512 compares, checked at run time; a scalar fallback)."""

    NAME = "ds_xc_select_cpu"
    BUILD_S = 30

    def sources(self):
        return [os.path.join(CSRC, "select_cpu.cpp")]

    def cxx_args(self):
        return ["-O3", "-Wall", *_header_flags("cpu_simd.h")]


BUILDERS = {"cpu": HammingBuilder, "cuda": HammingCudaBuilder, "rows": RowsBuilder, "softmax": SoftmaxBuilder,
            "select": SelectBuilder}
_OPS: dict = {}  # kind -> loaded module, or None after a failed build (no retry)


def load_op(kind: str, verbose: bool = False):
    """The built op module for `kind` ("cpu" or "cuda": the Hamming scan; "rows": the optimizers'
    row kernels; "softmax": the softmax's row exponentials; "select": the compressors' threshold
    selection), or None if it cannot be built.

    Builds (or loads from the cache) at most once per process; a failure is logged once
    as a warning, and callers fall back to the PyTorch implementation.
    """
    if kind not in BUILDERS:
        raise ValueError(f"kind = {kind!r} is not one of {sorted(BUILDERS)}")
    if kind in _OPS:
        return _OPS[kind]
    builder = BUILDERS[kind]()
    start = time.perf_counter()
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        if not builder.is_compatible(verbose):
            raise RuntimeError(builder.error_log or "not compatible")
        plain = plain_arch_list(arch_list) if kind == "cuda" and arch_list else arch_list
        if plain != arch_list:
            logger.info("building %s for TORCH_CUDA_ARCH_LIST=%r (was %r: DeepSpeed's builder does not parse "
                        "architecture-specific targets)", builder.NAME, plain, arch_list)
            os.environ["TORCH_CUDA_ARCH_LIST"] = plain
        op = builder.load(verbose=verbose)
    except Exception as exc:  # a compiler error, no ninja, no CUDA: fall back to torch
        msg = str(exc).strip() or repr(exc)
        logger.warning("ds_xc %s op (%s) unavailable, falling back to the PyTorch "
                       "implementation: %s: %s", kind, builder.NAME, type(exc).__name__, msg[-2000:])
        op = None
    else:
        logger.info("ds_xc %s op (%s) ready in %.1f s", kind, builder.NAME, time.perf_counter() - start)
    finally:  # the caller's value again (DeepSpeed's builder rewrites the variable while it builds)
        if kind == "cuda":
            if arch_list is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    _OPS[kind] = op
    return op
