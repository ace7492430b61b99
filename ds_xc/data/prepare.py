"""Fetch and build a data set once, ahead of training, and print its sizes:

    python -m ds_xc.data.prepare corpus                       # fetch the packages, tokenise
    python -m ds_xc.data.prepare corpus --mode bigram --num_classes 2000000
    python -m ds_xc.data.prepare corpus --plot docs/corpus_class_frequency.png
    python -m ds_xc.data.prepare text

Later builds (``build_dataset``, ``launch/train.py --data corpus``) read the caches.
``--plot`` draws the class frequencies of the word (250,000 classes) and bigram
(2,000,000 classes) modes on log-log axes; it needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np

from ds_xc.data import build_dataset
from ds_xc.data import corpus as corpus_module
from ds_xc.data import debian

PLOT_SIZES = {"word": 250_000, "bigram": 2_000_000}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=["corpus", "text"], help="data set to prepare")
    p.add_argument("--num_classes", type=int, default=50_000, help="classes (default 50000)")
    p.add_argument("--mode", choices=list(corpus_module.MODES), default="word", help="corpus label mode")
    p.add_argument("--vocab_size", type=int, help="corpus bigram mode: input vocabulary")
    p.add_argument("--context", type=int, default=4, help="previous words used as input")
    p.add_argument("--plot", help="corpus: write a class-frequency plot (PNG) of both modes here")
    p.add_argument("--quiet", action="store_true", help="only warnings in the log")
    return p.parse_args(argv)


def plot_class_frequencies(path: str, context: int) -> dict:
    """Training-sample frequency of each class against its rank, for both corpus modes.

    Sorted training counts (class ids are ranks over the whole corpus, both splits, so
    plotting by id would add the noise of the 1% held out to the tail).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sizes = {}
    for mode, num_classes in PLOT_SIZES.items():
        data = build_dataset("corpus", num_classes, context=context, mode=mode)
        counts = data.label_counts("train")[1:]  # class 0 (<unk> / other) holds no samples
        counts = np.sort(counts[counts > 0])[::-1]
        freq = counts / counts.sum()
        ranks = np.arange(1, len(freq) + 1)
        label = "next word" if mode == "word" else "next two words"
        ax.loglog(ranks, freq, label=f"{label}: {len(freq):,} classes, {int(counts.sum()):,} samples")
        sizes[mode] = {"classes": len(freq), "samples": int(counts.sum()), "top1": float(freq[0])}
    ax.loglog(ranks[:: max(1, len(ranks) // 1000)], 0.1 / ranks[:: max(1, len(ranks) // 1000)],
              "k:", lw=1, label="0.1 / rank")
    ax.set_xlabel("class rank (by training samples)")
    ax.set_ylabel("fraction of training samples")
    ax.set_title("corpus data set: class frequencies (gcide + linux-doc + python-doc)")
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return sizes


def _report_logger() -> logging.Logger:
    """The command's own result lines: plain messages on stdout, through logging (the library
    never prints)."""
    report = logging.getLogger(__name__ + ".report")
    if not report.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        report.addHandler(handler)
        report.propagate = False
        report.setLevel(logging.INFO)
    return report


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    report = _report_logger()
    start = time.perf_counter()
    kwargs = {"context": args.context}
    if args.name == "corpus":
        fetched = debian.fetch_packages([s.package for s in corpus_module.SOURCES.values()])
        for key, pkg in fetched.items():
            report.info("%s: %s (%s, %.1f MB) in %s", key, pkg.name, pkg.deb.name, pkg.deb.stat().st_size / 1e6,
                        pkg.root)
        kwargs.update(mode=args.mode, vocab_size=args.vocab_size)
    data = build_dataset(args.name, args.num_classes, **kwargs)
    info = data.describe()
    report.info("%s", json.dumps(info, indent=1))
    report.info("%s: %s training and %s held-out samples, input vocabulary %s, ready in %.1f s", args.name,
                f"{info['num_train']:,}", f"{info['num_eval']:,}", f"{info['input_dim']:,}",
                time.perf_counter() - start)
    if args.plot:
        if args.name != "corpus":
            raise SystemExit("--plot is only for the corpus data set")
        report.info("%s", json.dumps(plot_class_frequencies(args.plot, args.context), indent=1))
        report.info("wrote %s", args.plot)


if __name__ == "__main__":
    main()
