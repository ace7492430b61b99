"""The tuner's outputs: the frontier table, the PNG of the frontier, the tuned JSON and the report.

``write_config`` never overwrites the input: the output path must differ from the input file
(compared after resolving links), and the file is written atomically.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

log = logging.getLogger(__name__)

__all__ = ["table", "plot", "write_config", "report_text", "default_output_path"]

GIB = float(1 << 30)


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(rows: list, base_s: Optional[float], front: list, markdown: bool = True) -> str:
    """Every predicted row that was measured or pruned for a reason, fastest prediction first."""
    head = ["candidate", "pred step s", "meas step s", "speed-up", "recall@10", "probe top-1", "pred peak GiB",
            "meas peak GiB", "meas persistent GiB", "status"]
    lines = []
    shown = sorted(rows, key=lambda r: (r.measured is None, r.pred_s))
    for r in shown:
        m = r.measured or {}
        status = r.status + (" (frontier)" if r in front and r.status != "chosen" else "")
        lines.append([r.cand.label(), f"{r.pred_s:.3f}", _fmt(m.get("amortised_s"), ".3f"),
                      _fmt(r.speedup(base_s), ".2f"), _fmt(m.get("recall"), ".3f"),
                      _fmt((r.probe or {}).get("top1"), ".4f"),
                      _fmt(None if r.pred_peak is None else r.pred_peak / GIB, ".2f"),
                      _fmt(m["peak_bytes"] / GIB if m else None, ".2f"),
                      _fmt(m["persistent_bytes"] / GIB if m else None, ".2f"), status])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(x) + " |" for x in lines])
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*x) for x in lines])


def plot(rows: list, front: list, chosen, target, path: str) -> Optional[str]:
    """Step time against recall, colour = measured peak memory, frontier joined, target lines.
    Returns the path, or None when matplotlib is not installed (the extra 'bench')."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed (pip install ds_xc[bench]): no frontier PNG")
        return None
    done = [r for r in rows if r.measured is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sc = ax.scatter([r.measured["amortised_s"] for r in done], [r.measured["recall"] for r in done],
                    c=[r.measured["peak_bytes"] / GIB for r in done], cmap="viridis", s=30)
    fig.colorbar(sc, ax=ax, label="peak memory per rank (GiB)")
    fr = sorted(front, key=lambda r: r.measured["amortised_s"])
    ax.plot([r.measured["amortised_s"] for r in fr], [r.measured["recall"] for r in fr], "k--", lw=1,
            label="frontier")
    for r in done:
        if r.cand.tag == "defaults" or r is chosen:
            ax.annotate("chosen" if r is chosen else "defaults", (r.measured["amortised_s"], r.measured["recall"]),
                        textcoords="offset points", xytext=(5, 5), fontsize=8)
    if target.min_recall is not None:
        ax.axhline(target.min_recall, color="r", lw=0.8, label=f"recall target {target.min_recall}")
    ax.set_xlabel("step time per rank (s, index build amortised)")
    ax.set_ylabel("sampler recall@10 (held-out)")
    ax.set_xscale("log")
    ax.legend(fontsize=8)
    ax.set_title("tuner: measured candidates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_output_path(input_path: str) -> str:
    """<input stem>.tuned.json next to the input."""
    stem, _ = os.path.splitext(input_path)
    return stem + ".tuned.json"


def write_config(config: dict, out_path: str, input_path: Optional[str]) -> str:
    """Write the tuned JSON atomically; refuses to overwrite the input file."""
    if input_path and os.path.exists(out_path) and os.path.samefile(out_path, input_path):
        raise ValueError(f"--out {out_path!r} is the input config {input_path!r}; the tuner never overwrites "
                         "its input: name another file")
    if input_path and os.path.realpath(out_path) == os.path.realpath(input_path):
        raise ValueError(f"--out {out_path!r} is the input config; the tuner never overwrites its input")
    tmp = f"{out_path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(config, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, out_path)
    return out_path


def report_text(chosen, base, target, rows: list, context: dict, tuned_keys: list) -> str:
    """A short Markdown report: the target, why this candidate, what changed, the runner-up."""
    m = chosen.measured
    lines = [f"# Tuner report", "", f"Context: {json.dumps(context, sort_keys=True)}", "",
             f"Target: max_memory_gib={target.max_memory_gib}, min_recall={target.min_recall}, "
             f"min_speedup={target.min_speedup}, max_step_s={target.max_step_s}, "
             f"max_accuracy_drop={target.max_accuracy_drop}", "",
             f"Chosen: **{chosen.cand.label()}**: measured step {m['amortised_s']:.3f} s "
             f"(predicted {chosen.pred_s:.3f} s), recall@10 {m['recall']:.3f}, peak {m['peak_bytes'] / GIB:.2f} GiB "
             f"per rank (persistent {m['persistent_bytes'] / GIB:.2f} GiB)."]
    if base is not None and base.measured:
        lines.append(f"Library defaults ({base.cand.label()}): step {base.measured['amortised_s']:.3f} s, recall@10 "
                     f"{base.measured['recall']:.3f}, peak {base.measured['peak_bytes'] / GIB:.2f} GiB: the chosen "
                     f"one is {base.measured['amortised_s'] / m['amortised_s']:.2f}x faster per step.")
    p = chosen.probe
    if p is not None and "drop" in p:
        lines.append(f"Accuracy probe ({p['steps']} head steps, paired on {p['samples']} held-out samples): top-1 "
                     f"{p['top1']:.4f} against the defaults' {p['base_top1']:.4f} on the same samples, a drop of "
                     f"{100 * p['drop']:.2f} +- {100 * p['se']:.2f} point (discordant samples {p['discordant'][0]} "
                     f"only the defaults', {p['discordant'][1]} only this one's; scoring ended: {p['verdict']}).")
    rejected = [r for r in rows if r.status.endswith("probe: lower accuracy")]
    if rejected:
        lines.append("Faster, but rejected by the accuracy probe: " + "; ".join(
            f"{r.cand.label()} ({r.measured['amortised_s']:.3f} s, probe top-1 {r.probe['top1']:.4f} vs "
            f"{r.probe['base_top1']:.4f}: {100 * r.probe['drop']:.2f} +- {100 * r.probe['se']:.2f} point below, "
            f"{r.probe['samples']} samples)" for r in rejected) + ".")
    ok = sorted((r for r in rows if r.measured and r is not chosen and not r.status.startswith("skipped")
                 and (target.min_recall is None or r.measured["recall"] >= target.min_recall)),
                key=lambda r: r.measured["amortised_s"])
    lines.append("")
    lines.append("Why: the fastest measured candidate that meets every constraint; candidates were measured in "
                 "the order of the time model's predictions, weaker ones than a candidate that missed the recall "
                 "target skipped" + ("; with the accuracy probe, a candidate is chosen only when its probe's held-out "
                                     "top-1 lies within max_accuracy_drop of the defaults' on the same samples."
                                     if target.max_accuracy_drop is not None else "."))
    if ok:
        lines.append(f"Runner-up: {ok[0].cand.label()} ({ok[0].measured['amortised_s']:.3f} s, recall "
                     f"{ok[0].measured['recall']:.3f}).")
    lines += ["", f"Keys changed (extreme_classification.*): {', '.join(tuned_keys) or 'none'}", ""]
    counts = {}
    for r in rows:
        counts[r.status.split(":")[0]] = counts.get(r.status.split(":")[0], 0) + 1
    lines.append("Candidates: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return "\n".join(lines) + "\n"
