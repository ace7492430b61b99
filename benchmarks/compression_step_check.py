"""Benchmark: the step check's verdicts against time-to-accuracy measurements (needs root).

The step check (ds_xc.compression.pays.StepCheck, docs/compression.md "When compression pays")
times a running job's compressed steps and predicts the step with the best exact reduction
instead. This runs each case of :data:`CASES` as in benchmarks/time_to_accuracy.py (the same
job, seed, 2 ranks in network namespaces over a tc-shaped veth pair), with bayes_prior at its
defaults and ``gradient_compression.link_gbit_per_s`` set to the link, for ``--steps`` steps,
and puts its verdict beside what the recorded time-to-accuracy run measured end to end: the
exact variant's step, and how much sooner (or later) bayes_prior reached the exact run's accuracy.

    sudo python benchmarks/compression_step_check.py            # 5 cases, ~3 min
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, compression_netns.py
from compression_netns import in_namespaces  # noqa: E402
from harness import git_rev, write_report  # noqa: E402
from time_to_accuracy import first_reach, recorded, since_first_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DEFAULT_OUT = os.path.join(RESULTS, "compression_step_check.md")
# (config, tc rate, link_gbit_per_s, seed, recorded time-to-accuracy run, its exact variant)
CASES = (("configs/default.json", "1gbit", 1.0, 0, "time_to_accuracy_1gbit_unshaped_8401cbc.json", "dense_rows"),
         ("configs/default.json", "100mbit", 0.1, 0, "time_to_accuracy_100mbit_1fc302a.json", "dense_rows"),
         ("configs/glyphs_cosface.json", "100mbit", 0.1, 1, "time_to_accuracy_glyphs_100mbit_3d21490.json", "dense"),
         ("configs/default.json", "10gbit", 10.0, 0, "time_to_accuracy_text_links_0573e9e.json", "dense_rows"),
         ("configs/glyphs_cosface.json", "1gbit", 1.0, 1, "time_to_accuracy_glyphs_links_308e4d8.json", "dense"))


def measured(record: str, rate: str, exact: str) -> dict:
    """From a recorded time-to-accuracy run: the exact variant's and bayes_prior's step, steps and time to
    the target, and bayes_prior's speed-up to it (exact's time / bayes_prior's)."""
    runs, target = recorded(os.path.join(RESULTS, record), rate)
    out = {}
    for name in (exact, "bayes_prior"):
        r = runs[name]
        hit = first_reach(r["curve"], target)
        out[name] = {"step_s": r["step_s"], "steps": hit["step"] if hit else None,
                     "time_s": since_first_step(r, hit["train_s"]) if hit else None}
    e, b = out[exact], out["bayes_prior"]
    out["speedup"] = e["time_s"] / b["time_s"] if e["time_s"] and b["time_s"] else None
    out["steps_factor"] = b["steps"] / e["steps"] if e["steps"] and b["steps"] else None
    return out


def run_case(config: str, rate: str, link: float, seed: int, steps: int, port: int, timeout: float) -> dict:
    argv = ["--config", os.path.join(ROOT, config), "--method", "bayes_prior", "--steps", str(steps),
            "--compression", json.dumps({"link_gbit_per_s": link}), "--seed", str(seed)]
    result, counters = in_namespaces("compression_train.py", argv, rate, port, timeout)
    if "step_check" not in result:
        raise RuntimeError(f"{config} at {rate}: no step check verdict after {steps} steps (too few steps?)")
    return result


def render(command: str, started: str, wall: float, rows: list) -> str:
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    lines = ["# The step check's verdicts against time to accuracy\n",
             f"- command: `{command}`",
             f"- date: {started}, wall time {wall / 60:.1f} min; {os.cpu_count()} cores, load average {load} "
             "at the end",
             f"- ds_xc at git {git_rev(('ds_xc', 'benchmarks', 'configs'))}",
             "- each case: bayes_prior at its defaults, density 0.01, 2 ranks in 2 network namespaces, 1 thread each, "
             "veth pair shaped by `tc tbf rate RATE burst 128kb latency 50ms` (benchmarks/netns.sh), "
             "`gradient_compression.link_gbit_per_s` = the link; the check's numbers are rank 0's (medians of "
             "20 compressed steps after 5); `recorded` = the time-to-accuracy run named (its medians over the "
             "whole run, or over the timed steps of a run re-timed with --trajectory), `exact` its best exact "
             "variant (dense_rows: the embedding table as rows; dense: "
             "DeepSpeed's all-reduce)\n",
             "| job | link | check: compressed step (reduction) | check: predicted exact step | recorded: exact "
             "step | check: to the same accuracy | recorded: to the same accuracy (steps x) |",
             "|---|---|---|---|---|---|---|"]
    for case, result, rec in rows:
        config, rate, _, seed, record, exact = case
        c = result["step_check"]
        seen = f"{rec['speedup']:.2f}x ({rec['steps_factor']:.2f})" if rec["speedup"] else "never reached"
        ms = {name: f"{1e3 * rec[name]['step_s']:.1f}" for name in (exact, "bayes_prior")}
        lines.append(f"| {result['data']} ({config}, seed {seed}) | {rate} | {1e3 * c['step_s']:.1f} ms "
                     f"({1e3 * c['compressed_s']:.1f}) | {1e3 * c['exact_step_s']:.1f} ms ({c['exact_kind']}) | "
                     f"{ms[exact]} ms ({exact}; bayes_prior {ms['bayes_prior']}) "
                     f"| {c['speedup']:.2f}x: {c['verdict']} | {seen}, {record} |")
    lines.append(f"\nThe check divides its step speed-up by {rows[0][1]['step_check']['steps_factor']:g}, the fewest "
                 "extra steps measured at the defaults (ds_xc/cost/compression_step.py).")
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="steps per case (the check needs 25 compressed ones)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    command = "sudo python benchmarks/compression_step_check.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    started, t0, port = datetime.datetime.now().isoformat(timespec="seconds"), time.time(), 29755
    rows = []
    for case in CASES:
        config, rate, link, seed, record, exact = case
        port += 1
        result = run_case(config, rate, link, seed, args.steps, port, args.timeout)
        rows.append((case, result, measured(record, rate, exact)))
        print(f"{config} {rate}: {result['step_check']['verdict']}", flush=True)
    report = render(command, started, time.time() - t0, rows)
    print(report)
    if args.out != "-":
        write_report(args.out, report)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
            json.dump([{"case": list(case), "step_check": r["step_check"], "recorded": rec} for case, r, rec in rows],
                      fh, indent=1)
    return report


if __name__ == "__main__":
    main()
