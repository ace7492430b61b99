"""The markdown report of benchmarks/ann_head.py: header, speed and memory against the exact
head, scaling against 1 rank with the issue-16 targets, upkeep, and where the time goes."""
from __future__ import annotations

import json
import os
import platform

from harness import cpu_model, git_rev, mib, usable_cores

LOSSES = {"arcface": {"type": "arcface", "scale": 64.0, "margin": 0.5}, "softmax": {"type": "softmax"}}
SGD = {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}
# issue 16: speed-up over the exact head of the same world size, per sampled variant; 2-rank / 1-rank
# step of ann; per-step memory against the exact head's
TARGET_SPEEDUP = {"ann": 7.0, "uniform": 8.0}
TARGET_SCALING, TARGET_MEMORY = 0.55, 0.2
# the parts timed inside a step (wall and CPU s; ann_head.PARTS wraps them)
PART_KEYS = ("check", "gather", "sample", "upkeep", "retrieve", "probe", "scan", "rerank", "assemble", "loss",
             "catch_up")


def header(title: str, args, command: str, started: str, wall_s: float, hwm_ok: bool, torch_version: str) -> list:
    update = f"update forced to {args.update}" if args.update else "update at the library default"
    return [
        f"# {title}",
        "",
        f"- command: `{command}`",
        f"- date: {started} (wall time {wall_s:.0f} s)",
        f"- torch {torch_version}, python {platform.python_version()}, CPU: {cpu_model()}, "
        f"{usable_cores()} cores usable (os.cpu_count() = {os.cpu_count()}); load average (1/5/15 min) "
        f"at start / end of each configuration in the `load` column (other jobs share these cores)",
        f"- head: {args.num_classes:,} classes, d={args.dim}, global batch {args.batch}, float32, chunk_size "
        f"{args.chunk} (exact), " + (f"{args.sampled_chunk}" if args.sampled_chunk else "not named (the library "
                                     "default: one chunk)") + " (sampled heads), "
        f"loss {json.dumps(LOSSES[args.loss])}, check_inputs off, SGD {json.dumps(SGD)}; "
        f"sampled heads: {update} (exact: the default)",
        f"- sampler configs: {{'type', 'sample_rate': {args.sample_rate}}} only"
        + (f", ann overrides {json.dumps(args.ann_overrides)}" if args.ann_overrides else "")
        + " (every other key at its default in ds_xc/config.py)",
        f"- per configuration: fresh gloo group of spawned processes; threads = {args.threads_1} at 1 rank, "
        f"1 per rank otherwise; {args.warmup} warm-up + {args.steps} timed steps per round, {args.rounds} round(s); "
        "max over ranks of each rank's median",
        f"- ds_xc at git {git_rev()}",
        f"- VmHWM reset via /proc/self/clear_refs works here: {'yes' if hwm_ok else 'NO (peak is since process start)'}",
        "",
    ]


def speedups(r: dict, base: dict) -> dict:
    """Ratios of variant ``r`` against the exact row ``base`` of the same world size."""
    return {"wall": base["amortised_s"] / r["amortised_s"],
            "cpu": base["amortised_cpu"] / max(r["amortised_cpu"], 1e-9),
            "peak": r["peak"] / base["peak"], "extra": r["extra"] / max(base["extra"], 1),
            "with_build": r["peak_with_build"] / base["peak"]}


def _find(rows: list, world: int, variant: str):
    return next((b for b in rows if b["world"] == world and b["variant"] == variant), None)


def _verdict(wall: float, cpu: float, ok) -> str:
    if ok(wall) and ok(cpu):
        return "yes"
    return "wall only" if ok(wall) else "cpu only" if ok(cpu) else "**no**"


def speed_table(rows: list, args) -> list:
    lines = [
        "Step = forward (sampler included) + backward + optimizer step + zero_grad; `amortised` adds "
        "index build / rebuild_interval (wall and CPU). `step s` is the median over the timed steps of the round "
        f"with the smallest median ({args.rounds} rounds, all variants once per round; every round's median in "
        "`rounds`); `cpu s` = user + sys CPU seconds of the rank per step (max over ranks), which other jobs "
        "disturb less than wall time (with more ranks than cores the ranks time-share: read cpu s). Memory in MiB "
        "above the rank's RSS before the head was built: `persistent` = after warm-up (weights + momentum + ANN "
        "index), `peak` = VmHWM over the timed steps, `above pers.` = peak - persistent (per-step memory). Ratios "
        "are variant / exact of the same world size. Targets (issue 16): speed-up >= "
        + ", ".join(f"{v:g}x for {k}" for k, v in TARGET_SPEEDUP.items())
        + f" (wall and cpu), per-step memory ratio <= {TARGET_MEMORY:g}.",
        "",
        "| ranks | variant | C_local | step s (min-max) | rounds | amortised s | speed-up | cpu s | speed-up (cpu) "
        "| target | persistent | peak | peak ratio | above pers. | ratio above pers. | <= 0.2x (above pers.) | load |",
        "|---:|---|---:|---:|---|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|:---:|---|",
    ]
    for r in rows:
        base = _find(rows, r["world"], "exact")
        if base is not None and r is not base:
            x = speedups(r, base)
            goal = TARGET_SPEEDUP.get(r["variant"].split("@")[0])
            ok = "-" if goal is None else f"{_verdict(x['wall'], x['cpu'], lambda v: v >= goal)} (>= {goal:g}x)"
            okm = "yes" if x["extra"] <= TARGET_MEMORY else "**no**"
            cells = [f"{x['wall']:.2f}", f"{x['cpu']:.2f}", ok, f"{x['peak']:.2f}", f"{x['extra']:.2f}", okm]
        else:
            cells = ["1.00", "1.00", "-", "1.00", "1.00", "-"]
        rounds = "/".join(f"{v:.2f}" for v in r["rounds_s"])
        lines.append(
            f"| {r['world']} | {r['variant']} | {r['num_local']:,} | {r['step_s']:.2f} ({r['step_range'][0]:.2f}-"
            f"{r['step_range'][1]:.2f}) | {rounds} | {r['amortised_s']:.2f} | {cells[0]} | {r['amortised_cpu']:.2f} | "
            f"{cells[1]} | {cells[2]} | {mib(r['persistent'])} | {mib(r['peak'])} | {cells[3]} | {mib(r['extra'])} | "
            f"{cells[4]} | {cells[5]} | {r['load']} |")
    return lines


def scaling_table(rows: list) -> list:
    """Each variant's amortised step at P ranks against its own 1-rank step (wall, and CPU per rank)."""
    lines = ["", f"Scaling: the amortised step at P ranks / the same variant's at 1 rank (wall; `cpu` = CPU s per "
             f"rank). Target (issue 16): ann at 2 ranks <= {TARGET_SCALING:g}x of 1 rank.", "",
             "| ranks | variant | amortised s | vs 1 rank | cpu s | cpu vs 1 rank | target |",
             "|---:|---|---:|---:|---:|---:|:---:|"]
    for r in rows:
        one = _find(rows, 1, r["variant"])
        if one is None or r["world"] == 1:
            continue
        wall, cpu = r["amortised_s"] / one["amortised_s"], r["amortised_cpu"] / max(one["amortised_cpu"], 1e-9)
        goal = "-"
        if r["world"] == 2 and r["variant"] == "ann":
            goal = f"{_verdict(wall, cpu, lambda v: v <= TARGET_SCALING)} (<= {TARGET_SCALING:g}x)"
        lines.append(f"| {r['world']} | {r['variant']} | {r['amortised_s']:.2f} | {wall:.2f} | "
                     f"{r['amortised_cpu']:.2f} | {cpu:.2f} | {goal} |")
    return lines


def upkeep_table(rows: list) -> list:
    lines = [
        "",
        "Index upkeep and memory of the sampled variants: `build s` / `build cpu s` = one full index build "
        "(k-means + lists + every code; amortised over rebuild_interval steps above); `build above pers.` = "
        "its peak above the RSS before it; `peak incl. build` = persistent + max(per-step extra, build extra), "
        "the total peak of a step that also rebuilds, and its ratio to the exact peak; `index` = the index's "
        "tensors (codes, ids, positions, centroids, projection).",
        "",
        "| ranks | variant | build s | build cpu s | rebuild_interval | build above pers. | ratio build / exact above pers. "
        "| peak incl. build | ratio incl. build | index MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = _find(rows, r["world"], "exact")
        if r["variant"] == "exact" or base is None or not r["build_s"]:
            continue
        lines.append(
            f"| {r['world']} | {r['variant']} | {r['build_s']:.1f} | {r['build_cpu']:.1f} | {r['rebuild_interval']} | "
            f"{mib(r['build_extra'])} | {r['build_extra'] / max(base['extra'], 1):.2f} | {mib(r['peak_with_build'])} | "
            f"{r['peak_with_build'] / base['peak']:.2f} | {mib(r['index_bytes'])} |")
    return lines


def phase_table(rows: list) -> list:
    lines = [
        "",
        "Phases (median seconds of the representative round, max over ranks): `sample` is the whole sampler "
        "call inside the forward; `loss` = forward - sample (input check, gathers, active rows, fused chunked "
        "loss). Peaks per phase (MiB above baseline) from the last warm-up step. Counts of the last step on "
        "rank 0. W = weights of the shard in MiB.",
        "",
        "| ranks | variant | W | forward s | sample s | loss s | backward s | step s | "
        "peak forward | peak backward | peak step | active | retrieved | kept | cut | fill | loss step 1 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, p, st = r["phase_s"], r["phase_peak"], r["stats"]
        cnt = [str(st.get(k, "-")) for k in ("active", "retrieved", "kept", "cut", "fill")]
        lines.append(
            f"| {r['world']} | {r['variant']} | {mib(r['weights'])} | {t['forward']:.2f} | {t['sample']:.2f} | "
            f"{t['forward'] - t['sample']:.2f} | {t['backward']:.3f} | {t['step']:.2f} | {mib(p['forward'])} | "
            f"{mib(p['backward'])} | {mib(p['step'])} | " + " | ".join(cnt) + f" | {r['losses'][0]:.4f} |")
    return lines


def parts_table(rows: list) -> list:
    """Wall / CPU seconds of each timed part (median per step, max over ranks)."""
    keys = [k for k in PART_KEYS if any(r["parts"].get(k, (0, 0))[0] > 0 for r in rows)]
    lines = [
        "",
        "Where the time goes, `wall / cpu` ms per step (median of the timed steps, max over ranks; cpu = the "
        "rank's process CPU time, so waiting in a collective shows as wall without cpu): `check` = input check "
        "and size exchange; `gather` = all-gather of embeddings and labels; `sample` = the sampler (of which "
        "`upkeep` = re-encoding, `retrieve` = `probe` (centroid scores, lists) + `scan` (Hamming top-k) + "
        "`rerank` (exact scores) + code of the queries, `assemble` = active set); `loss` = the fused sharded "
        "loss with its all-reduces; `catch_up` = lazy_exact catch-up of the active rows; `backward` includes "
        "the embedding-gradient reduce-scatter; `opt` = optimizer step + zero_grad.",
        "",
        "| ranks | variant | " + " | ".join(keys) + " | backward | opt | total |",
        "|---:|---|" + "---:|" * (len(keys) + 3),
    ]
    for r in rows:
        cells = [r["parts"].get(k, (0.0, 0.0)) for k in keys]
        t = r["phase_s"]
        cells += [(t["backward"], t.get("backward_cpu", 0.0)), (t["step"], t.get("step_cpu", 0.0)),
                  (t["total"], t["cpu"])]
        lines.append(f"| {r['world']} | {r['variant']} | "
                     + " | ".join(f"{1e3 * w:.0f} / {1e3 * c:.0f}" for w, c in cells) + " |")
    return lines


def render(rows: list, args, command: str, started: str, wall_s: float, hwm_ok: bool) -> str:
    lines = header("ANN-sampled head vs exact chunked head", args, command, started, wall_s, hwm_ok,
                   rows[0]["torch"])
    lines += speed_table(rows, args) + scaling_table(rows) + upkeep_table(rows) + phase_table(rows)
    lines += parts_table(rows)
    return "\n".join(lines) + "\n"
