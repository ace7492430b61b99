"""Prebuild the native ops into the torch extensions cache.

    python -m ds_xc_ops.build            # every C++ CPU op, and the CUDA op when CUDA is available
    python -m ds_xc_ops.build --verbose  # show the compiler commands

The way to build ahead of a job (a setup step, an image): later processes then only load the cached
library, and no training process compiles (or waits for another's compile). Each op builds into its
own folder of the torch extensions cache, named per install and source (ds_xc_ops.build_cache).
Exits 1 if a requested op fails.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from ds_xc_ops import builders


logger = logging.getLogger(__name__)
CPU_KINDS = [k for k in builders.BUILDERS if k != "cuda"]  # the Hamming scan, the optimizers' rows, softmax, select


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print the compiler commands")
    parser.add_argument("--kinds", default="auto",
                        help=f"comma-separated ops to build ({','.join(builders.BUILDERS)}); auto: every CPU op "
                        f"({','.join(CPU_KINDS)}), plus cuda if available")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kinds = args.kinds.split(",") if args.kinds != "auto" else (
        CPU_KINDS + (["cuda"] if torch.cuda.is_available() else []))
    failed = []
    for kind in kinds:
        start = time.perf_counter()
        op = builders.load_op(kind, verbose=args.verbose)
        if op is None:
            failed.append(kind)
        else:
            logger.info("%s: %s (%.1f s)", kind, op.__file__, time.perf_counter() - start)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
