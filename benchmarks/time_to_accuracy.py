"""Benchmark: time to accuracy of the backbone reductions over tc-shaped links (needs root).

Two ranks in two network namespaces joined by a veth pair (benchmarks/netns.sh), or ``--ranks N``
hosts of one rank each on a switch (benchmarks/netns_hosts.sh), one link speed after the other.
For each link, launch/train.py's job (``--config``, default the default job) first trains with
DeepSpeed's dense all-reduce for ``--steps`` steps, evaluating held-out top-1 every
``--eval_every`` steps; its final top-1 is the target.
Every other variant then trains on the same link until an evaluation reaches the target or
``--max_factor`` x ``--steps`` steps have run. The time is the training time (barrier to
barrier per step, evaluations left out). Variants:

- ``dense``: DeepSpeed's all-reduce of every gradient (flat, after the backward);
- ``dense_rows``: the best dense reduction we have: ds_xc's buckets from the backward's hooks,
  the embedding table sent as its nonzero rows (``topology.sparse_rows``; the same mean);
- ``powersgd``: rank 4 (about 1% of the dense bytes on the text task, as many bytes as bayes_prior on 2 ranks;
  ``--powersgd_rank``), error feedback;
- ``bayes_prior``, ``topk``: density 0.01, error feedback, their library defaults.

``--trajectory RUN.json`` re-times a recorded run on other links (``A.json,B.json``: each variant from the
first file that holds it, the files sharing the target): each variant trains only
``--timed_steps`` steps per link (evaluating as the recorded run did: give its ``--eval_every``
and ``--eval_samples``); its losses must equal the recorded run's bit for bit (the runs
are deterministic: the link changes the step time, not the numbers), and it reaches the recorded
target at its recorded step, after this link's mean step time per step.

Writes a table per link (steps and time to the target, speed-up against dense and against
PowerSGD, bytes on the veth) and a plot of top-1 against training time per link:

    sudo python benchmarks/time_to_accuracy.py                          # 1gbit,100mbit; ~45 min
    sudo python benchmarks/time_to_accuracy.py --rates 10gbit --steps 100 --out -
    sudo python benchmarks/time_to_accuracy.py --ranks 4 --rates 1gbit --steps 1200 --target_variant dense_rows
    sudo python benchmarks/time_to_accuracy.py --config configs/glyphs_cosface.json --seed 1 \\
        --variants dense,powersgd,bayes_prior --rates 1gbit,10gbit --timed_steps 300 --eval_every 100 \\
        --trajectory benchmarks/results/time_to_accuracy_glyphs_100mbit_3d21490.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/harness.py, compression_netns.py
from compression_netns import in_namespaces  # noqa: E402
from harness import git_rev  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "time_to_accuracy.md")
# name -> (compression_train.py --method, extra gradient_compression keys)
VARIANTS = {"dense": ("dense", {}), "dense_rows": ("dense_rows", {}),
            "powersgd": ("powersgd", {"powersgd": {"rank": 4}}),
            "bayes_prior": ("bayes_prior", {}), "topk": ("topk", {})}


def first_reach(curve: list[dict], target: float):
    """The first evaluation with top-1 >= target (None: never)."""
    return next((c for c in curve if c["top1"] >= target), None)


def since_first_step(r: dict, train_s: float) -> float:
    """Training time after the first step (which builds the ANN index and warms DeepSpeed up, alike for all)."""
    return train_s - r["first_step_s"]


def run_variant(args, name: str, rate: str, port: int, steps: int, target: float,
                evaluate: bool = True) -> tuple[dict, dict]:
    method, extra = VARIANTS[name]
    if name == "powersgd":
        extra = {"powersgd": {"rank": args.powersgd_rank}}
    argv = ["--config", os.path.join(ROOT, args.config), "--method", method, "--density", str(args.density),
            "--steps", str(steps), "--eval_every", str(args.eval_every if evaluate else 0),
            "--compression", json.dumps(extra),
            "--seed", str(args.seed)]
    if args.eval_samples:
        argv += ["--eval_samples", str(args.eval_samples)]
    if target:
        argv += ["--target", repr(target)]
    return in_namespaces("compression_train.py", argv, rate, port, args.timeout, ranks=args.ranks)


def extrapolate(run: dict, leader: dict, target: float, source: str) -> dict:
    """A run timed over a few steps only, completed from ``leader``, a run on the same trajectory.

    ``leader`` is the dense_rows run for DeepSpeed's dense one (``--dense_steps``: the same mean)
    or this variant's run recorded on another link (``--trajectory``); the losses of the common
    steps are compared (``loss_max_diff``). Every evaluation of ``leader`` is placed at this run's
    first step plus its mean step time (first step excluded) times the steps after the first, so
    the run reaches the target at the leader's step. Returns a copy of ``run`` with that curve;
    ``source`` names the leader in the report."""
    n = len(run["losses"])
    mean_s = (run["train_s"] - run["first_step_s"]) / max(n - 1, 1)
    out = dict(run, extrapolated_from=n, leader=source,
               loss_max_diff=max(abs(a - b) for a, b in zip(run["losses"], leader["losses"])))
    out["curve"] = [dict(c, train_s=run["first_step_s"] + mean_s * (c["step"] - 1)) for c in leader["curve"]]
    return out


def recorded(paths: str, rate: Optional[str] = None) -> tuple[dict, float]:
    """Time-to-accuracy .json files' runs of one link by variant, and their target. The link is ``rate``, or each
    file's first one (``--trajectory``: the runs are deterministic, so every link of one file holds the same
    trajectory and target). ``paths`` is one file or several, comma-separated: each variant comes from the
    first file that holds it (its record gains ``source``: that file's name and link), and the files must share
    the target (the same leading run): a run recorded at another revision joins one of this revision only where
    its variant did not change (timed_link refuses it otherwise)."""
    runs, target = {}, None
    for path in paths.split(","):
        with open(path) as fh:
            saved = json.load(fh)
        link = rate or next(iter(saved))
        if target is None:
            target = saved[link]["target"]
        elif saved[link]["target"] != target:
            raise SystemExit(f"--trajectory={paths}: {os.path.basename(path)}'s target {saved[link]['target']!r} "
                             f"differs from {target!r}; allowed: files whose leading run is the same")
        for name, r, _ in saved[link]["runs"]:
            runs.setdefault(name, dict(r, source=f"{os.path.basename(path)}, {link}"))
    return runs, target


def rate_table(rate: str, runs: list, target: float) -> list[str]:
    """The markdown table of one link (a row whose run was extrapolated says from how many steps)."""
    reach = {name: first_reach(r["curve"], target) for name, r, _ in runs}
    t = {name: (since_first_step(r, reach[name]["train_s"]) if reach[name] else None) for name, r, _ in runs}
    lines = [f"## {rate}: target top-1 {target:.4f} ({runs[0][0]}'s final)\n",
             "| variant | s/step (median) | steps to target | time to target (s) | vs dense | vs powersgd | "
             "best top-1 (step) | veth B/step (rank 0 tx) |", "|---|---|---|---|---|---|---|---|"]
    for name, r, c in runs:
        best = max(r["curve"] or [{"top1": float("nan"), "step": r["steps"]}], key=lambda e: e["top1"])
        hit = reach[name]

        def ratio(other):
            return f"{t[other] / t[name]:.2f}x" if t.get(other) and t[name] else "n/a"
        end = r["curve"][-1]["train_s"] if r.get("extrapolated_from") and r["curve"] else r["train_s"]
        when = f"{t[name]:.1f}" if hit else f"> {since_first_step(r, end):.1f}"  # never: its whole run
        if r.get("extrapolated_from"):
            when += f" (timed over {r['extrapolated_from']} steps)"
        lines.append(f"| {name} | {r['step_s']:.3f} | {hit['step'] if hit else 'never'} | {when} | "
                     f"{ratio('dense')} | {ratio('powersgd')} | {best['top1']:.4f} ({best['step']}) | "
                     f"{c['tx_bytes'][0] / r['steps']:,.0f} |")
    extra = {}  # one note per leader: the runs it completes, their timed steps, the largest loss difference
    for name, r, _ in runs:
        if r.get("extrapolated_from"):
            names, n, diff = extra.get(r["leader"], ([], r["extrapolated_from"], 0.0))
            extra[r["leader"]] = (names + [name], n, max(diff, r["loss_max_diff"]))
    extra = [f"{', '.join(names)} ran {n} steps on this link: the evaluations are those of {leader}, each at this "
             f"run's mean step time x its step; over those steps the losses differ from those of {leader} by at most "
             f"{diff:.2e}\n" for leader, (names, n, diff) in extra.items()]
    return lines + [""] + extra


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (rate, (runs, target)) in zip(axes[0], results.items()):
        for name, r, _ in runs:
            ax.plot([since_first_step(r, c["train_s"]) for c in r["curve"]], [c["top1"] for c in r["curve"]],
                    marker="o", ms=3, label=name)
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_title(f"{rate} link, {runs[0][1].get('world', 2)} ranks")  # records before --ranks: 2
        ax.set_xlabel("training time after step 1 (s)")
        ax.set_ylabel("held-out top-1")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit,100mbit", help="tc tbf rates, comma-separated ('none': unshaped)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--config", default="configs/default.json")
    p.add_argument("--ranks", type=int, default=2,
                   help="ranks, one per namespace: 2 on netns.sh's veth pair, more on netns_hosts.sh's switch")
    p.add_argument("--steps", type=int, default=300, help="the target variant's steps; its final top-1 is the target")
    p.add_argument("--target_variant", choices=("dense", "dense_rows"), default="dense",
                   help="the variant whose final top-1 is the target (it runs first)")
    p.add_argument("--dense_steps", type=int, default=60,
                   help="with --target_variant dense_rows: steps DeepSpeed's dense runs to time its step (the same "
                   "mean as dense_rows: its time to the target is extrapolated, see extrapolate)")
    p.add_argument("--trajectory", default=None,
                   help="a recorded run's .json, or several comma-separated with the same target (the same job, "
                   "seed and trajectory; each variant from the first file that holds it): each variant then trains "
                   "only --timed_steps steps per link and reaches the target at its recorded step")
    p.add_argument("--timed_steps", type=int, default=100,
                   help="with --trajectory: the steps each variant is timed over")
    p.add_argument("--max_factor", type=float, default=2.0, help="the others stop at max_factor x steps")
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--eval_samples", type=int, default=0, help="override xc_train.eval_samples (0: the config's)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--powersgd_rank", type=int, default=VARIANTS["powersgd"][1]["powersgd"]["rank"],
                   help="the powersgd variant's rank (4: the bytes of bayes_prior at density 0.01 on 2 ranks; its "
                   "all-gather grows with the ranks, so matching it on more ranks takes a larger rank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--replot", default=None, help="only redraw the plot from a run's .json (needs no root)")
    args = p.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    if args.powersgd_rank < 1:
        p.error(f"--powersgd_rank={args.powersgd_rank}: allowed: a rank >= 1")
    names = args.variants.split(",")
    lead = args.target_variant
    if any(n not in VARIANTS for n in names) or lead not in names:
        p.error(f"--variants={args.variants!r}: must name {lead} (--target_variant, it sets the target); allowed: "
                f"{', '.join(VARIANTS)}")
    names = [lead] + [n for n in names if n != lead]
    record = recorded(args.trajectory) if args.trajectory else None
    if record is not None:
        missing = [n for n in names if n not in record[0]]
        if missing:
            p.error(f"--trajectory={args.trajectory}: has no run of {', '.join(missing)} "
                    f"(--variants={args.variants!r})")
    command = "sudo python benchmarks/time_to_accuracy.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started, t0, port = datetime.datetime.now().isoformat(timespec="seconds"), time.time(), 29655
    results = {}
    for rate in args.rates.split(","):
        if record is not None:
            runs, target = timed_link(args, rate, names, port, record)
        else:
            runs, target = measured_link(args, rate, names, port)
        port += len(names)
        results[rate] = (runs, target)
        report = render(args, command, started, time.time() - t0, results)
        write(args.out, report, results)  # after every link: a later failure keeps what was measured
    print(report)
    if args.out != "-":
        save_plot(results, os.path.splitext(args.out)[0] + ".png")
    return report


def measured_link(args, rate: str, names: list[str], port: int) -> tuple[list, float]:
    """One link: the target variant trains ``--steps`` steps and sets the target; the others train to it."""
    runs, target, lead = [], 0.0, names[0]
    for i, name in enumerate(names):
        short = name == "dense" and lead != "dense"
        steps = (args.steps if name == lead else args.dense_steps if short
                 else math.ceil(args.max_factor * args.steps))
        res, ctr = run_variant(args, name, rate, port + i, steps, target, evaluate=not short)
        if name == lead:
            target = res["curve"][-1]["top1"]
        if short:
            res = extrapolate(res, runs[0][1], target, lead)
        runs.append((name, res, ctr))
        progress(rate, name, res, target)
    return runs, target


def timed_link(args, rate: str, names: list[str], port: int, record: tuple) -> tuple[list, float]:
    """One link, ``--trajectory``: each variant trains ``--timed_steps`` steps, on the trajectory of ``record``
    (:func:`recorded` of the file).

    The runs are deterministic (gloo's reductions do not depend on the link's speed), so a variant
    reaches the target at the step it did in the recorded run; what the link changes is the step time.
    A variant whose losses differ from the recorded ones in any step is refused: it is another
    trajectory (another revision, config or seed), and the recorded steps would not apply. It
    evaluates every ``--eval_every`` steps as the recorded run did (those times are left out):
    an evaluation can move later steps by a rounding (the text job's head catches its lazy rows
    up for it), so only the recorded schedule keeps the recorded trajectory."""
    rec, target = record
    runs = []
    for i, name in enumerate(names):
        res, ctr = run_variant(args, name, rate, port + i, args.timed_steps, 0.0)
        res = extrapolate(res, rec[name], target, f"each one's recorded run ({rec[name]['source']})")
        if res["loss_max_diff"] != 0.0:
            raise SystemExit(f"--trajectory={args.trajectory}: {name}'s losses differ from the recorded run's by "
                             f"{res['loss_max_diff']:.3e} within {args.timed_steps} steps; the recorded steps to the "
                             "target do not apply (another revision, config or seed, or another --eval_every / "
                             "--eval_samples than the recorded run's?)")
        runs.append((name, res, ctr))
        progress(rate, name, res, target)
    return runs, target


def progress(rate: str, name: str, res: dict, target: float) -> None:
    hit = first_reach(res["curve"], target)
    print(f"{rate} {name}: {res['step_s']:.3f} s/step, "
          f"{'target at step %d, %.1f s' % (hit['step'], hit['train_s']) if hit else 'target not reached'}",
          flush=True)


def write(out: str, report: str, results: dict) -> None:
    """The report as ``out`` and every run's record and curve as a .json beside it (--replot redraws from it)."""
    if out == "-":
        return
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        fh.write(report + "\n")
    with open(os.path.splitext(out)[0] + ".json", "w") as fh:
        json.dump({rate: {"target": target, "runs": [[n, r, c] for n, r, c in runs]}
                   for rate, (runs, target) in results.items()}, fh)


def save_plot(results: dict, path: str) -> None:
    """The plot, or a line saying how to make it (matplotlib is the ``bench`` extra)."""
    try:
        plot(results, path)
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install -e '.[bench]', then python "
              f"benchmarks/time_to_accuracy.py --replot {os.path.splitext(path)[0]}.json)", flush=True)


def replot(path: str) -> None:
    """Redraw the plot of a run from its ``.json`` beside the ``.md``."""
    with open(path) as fh:
        saved = json.load(fh)
    save_plot({rate: ([tuple(run) for run in v["runs"]], v["target"]) for rate, v in saved.items()},
              os.path.splitext(path)[0] + ".png")


def topology(ranks: int) -> str:
    """The header's words for the ranks' namespaces and links (and for more ranks than cores)."""
    shaping = "`tc tbf rate RATE burst 128kb latency 50ms` on both ends"
    text = f"{ranks} ranks in {ranks} namespaces, 1 thread each; " + (
        f"veth pair shaped by {shaping} (benchmarks/netns.sh)" if ranks == 2 else
        f"one rank per host on a switch (a bridge), each host's veth shaped by {shaping} (benchmarks/netns_hosts.sh)")
    if ranks > (os.cpu_count() or 1):
        text += (f"; {os.cpu_count()} cores for {ranks} single-threaded ranks: each step's compute is slower than "
                 "on 2 ranks")
    return text


def protocol(args) -> str:
    """The header's words for how the target and the times to it were measured."""
    if args.trajectory:
        return (f"each variant trains {args.timed_steps} steps on each link (evaluating every {args.eval_every} as "
                f"recorded), its losses equal bit for bit to its run "
                f"in {', '.join(os.path.basename(f) for f in args.trajectory.split(','))} (the same trajectory; with "
                "several files, each variant from the first that holds it): that run's target, evaluations and "
                "steps to the target, each evaluation at this link's mean step time (first step excluded) x its step")
    return (f"{args.target_variant} trains {args.steps} steps, its final top-1 is the target; the others stop at the "
            f"first evaluation (every {args.eval_every} steps) that reaches it, or after "
            f"{math.ceil(args.max_factor * args.steps)} steps")


def render(args, command: str, started: str, wall: float, results: dict) -> str:
    first = next(iter(results.values()))[0][0][1]
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    lines = ["# Time to accuracy over tc-shaped links: dense, dense with embedding rows, PowerSGD, compressed\n",
             f"- command: `{command}`", f"- date: {started}, wall time {wall / 60:.1f} min; {os.cpu_count()} cores, "
             f"load average {load} at the end", f"- ds_xc at git {git_rev(('ds_xc', 'benchmarks', 'configs'))}",
             f"- job: {first['config']} ({first['data']}, {first['num_classes']} classes, backbone "
             f"{first['backbone_numel'] / 1e6:.2f} M parameters), seed {args.seed}; {topology(args.ranks)}; "
             f"powersgd at rank {args.powersgd_rank}",
             f"- {protocol(args)}; time = training time after the first step (index build, warm-up), barrier to "
             "barrier per step, evaluations left out; `vs dense` = dense's time to the target / this variant's (> 1: "
             "faster)\n"]
    for rate, (runs, target) in results.items():
        lines += rate_table(rate, runs, target)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
