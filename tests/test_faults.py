"""Fault injection (marker ``faults``): killed, stopped and disk-starved ranks of launch/train.py,
and damaged checkpoint files. ``python -m pytest -q -m faults`` runs only these.

Every job is 2 ranks of ``launch/train.py`` (synthetic data, 101 classes, an ANN sampler that
rebuilds its index every 2 steps, AdamW, 8 steps, a checkpoint every 2 steps,
``comm_timeout_s=5``), forked from a server that imported torch and DeepSpeed once, with
one fault fired from inside a rank by tests/fault_driver.py (a test hook: ``DS_XC_FAULT``).
The injection points are a seeded, reproducible draw (``FAULT_SEED``) over the phases of a
step and the points inside a checkpoint save. For each fault:

* the job stops within the timeout (no rank still running past ``comm_timeout_s`` plus
  slack: a hang fails the test), and each survivor's message names itself, the phase and
  step where its collective failed, and the lost rank with its pid;
* ``latest`` names the last save completed before the fault, every published tag passes
  its checksums and equals the uninterrupted reference run's tag of the same name, and a
  resume from ``latest`` continues bit for bit (the reference run's losses and final weights);
* damaged files (truncated or one bit flipped at a random offset) either raise
  CheckpointError naming the file on both ranks, or load exactly the saved state.

Set ``DS_XC_FAULT_TALLY=path.json`` to write the counts (faults injected, survived, silent
corruptions, hangs) to a file: docs/checkpoints.md quotes them.
"""
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch

from tests import fault_driver
from tests.dist_pool import free_port

pytestmark = [pytest.mark.faults, pytest.mark.serial]  # timing: stamps and timeouts, run alone

FAULT_SEED, STEPS, SAVE_EVERY, TIMEOUT_S, SLACK_S = 20261201, 8, 2, 5, 10
CFG = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "steps_per_print": 10**6,
       "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "torch_adam": True}},
       "extreme_classification": {"num_classes": 101, "embedding_dim": 16, "sampler": {
           "type": "ann", "sample_rate": 0.5, "code_bits": 32, "nlist": 3, "nprobe": 2, "top_k": 3, "rerank": 0,
           "rebuild_interval": 2}},
       "xc_train": {"data": "synthetic", "max_steps": STEPS, "eval_every": 0, "eval_samples": 16,
                    "log_every": 1000, "hidden_dim": 16, "save_every": SAVE_EVERY, "comm_timeout_s": TIMEOUT_S}}
TALLY = {"injected": 0, "survived": 0, "silent_corruptions": 0, "hangs": 0, "data_lost": 0, "by_kind": {}}
# each phase's position in a step, to check that a survivor failed at or after the victim's point
ORDER = ["forward", "index rebuild", "backward", "gradient reduction", "optimizer step", "checkpoint save",
         "evaluation"]
DS_SAVE = "call:deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine.save"
SAVE_POINTS = {  # points inside xc.save_checkpoint, with the rank that can reach them
    "call:ds_xc.engine.checkpointing:save_head_state": (0, 1), "call:ds_xc.engine.checkpointing:atomic_save": (0, 1),
    DS_SAVE: (0,), "call:ds_xc.engine.checkpointing:write_manifest_all_ranks": (0, 1),
    "call:ds_xc.engine.checkpointing:publish_tag": (0,), "call:ds_xc.checkpoint.files:write_latest": (0,)}
STEP_POINTS = {"call:ds_xc.head.head:ClassParallelHead.forward": "forward",
               "call:deepspeed.runtime.engine:DeepSpeedEngine.step": "optimizer step"}


def _draw_cases() -> list:
    """(kind, spec) for 16 kills and 2 stops: every point once (phases of a step, points inside a save,
    points between the head's and the backbone's work) at a seeded step and rank, one more drawn at random."""
    rng = random.Random(FAULT_SEED)
    phase_steps = {"forward": range(2, STEPS), "backward": range(2, STEPS), "gradient reduction": range(2, STEPS),
                   "optimizer step": range(2, STEPS), "index rebuild": range(2, STEPS, 2),
                   "checkpoint save": range(4, STEPS + 1, SAVE_EVERY), "evaluation": [STEPS]}
    points = [("phase:" + p, steps, (0, 1)) for p, steps in phase_steps.items()]
    points += [(at, range(4, STEPS + 1, SAVE_EVERY), ranks) for at, ranks in SAVE_POINTS.items()]
    points += [(at, range(2, STEPS), (0, 1)) for at in STEP_POINTS]
    drawn = []
    for at, steps, ranks in points + [rng.choice(points)]:
        while True:
            spec = {"at": at, "step": rng.choice(list(steps)), "rank": rng.choice(ranks), "action": "kill"}
            if spec not in drawn:
                break
        drawn.append(spec)
    cases = [("kill", spec) for spec in drawn]
    for at in ("phase:backward", "phase:checkpoint save"):
        cases.append(("stop", {"at": at, "step": 4, "rank": rng.choice((0, 1)), "action": "stop"}))
    return cases


CASES = _draw_cases()
BUCKET = "call:ds_xc.parallel.buckets:BucketedGradReducer._launch"  # one gradient bucket issued (in the backward)
CFG_OVERLAP = json.loads(json.dumps(CFG))
CFG_OVERLAP["extreme_classification"]["overlap"] = {"enabled": True, "num_chunks": 2, "bucket_size_mb": 1e-5}
_R = random.Random(FAULT_SEED + 2)
OVERLAP_CASES = [("kill", {"at": BUCKET, "step": _R.randrange(2, STEPS), "rank": _R.choice((0, 1)),
                           "nth": _R.choice((1, 2)), "action": "kill"}),
                 ("kill", {"at": "phase:gradient reduction", "step": _R.randrange(2, STEPS), "rank": _R.choice((0, 1)),
                           "action": "kill"}),
                 ("stop", {"at": BUCKET, "step": _R.randrange(2, STEPS), "rank": _R.choice((0, 1)), "action": "stop"}),
                 # the head's gathers run on a side group: it must have the world's timeout, not torch's 30 min
                 ("stop", {"at": "phase:overlapped forward-backward", "step": _R.randrange(2, STEPS),
                           "rank": _R.choice((0, 1)), "action": "stop"})]


def _phase_of(at: str) -> str:
    if at.startswith("phase:"):
        return at[len("phase:"):]
    return dict(STEP_POINTS, **{BUCKET: "overlapped forward-backward"}).get(at, "checkpoint save")


def _expected_latest(at: str, step: int) -> str:
    """The last save completed before a fault at (at, step): a save of ``step`` in progress does not count,
    nor the final one (after the evaluation at STEPS)."""
    last = step - (1 if _phase_of(at) in ("checkpoint save", "evaluation") else 0)
    return f"step{last - last % SAVE_EVERY}"


# ---------------------------------------------------------------------- jobs
def _server():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(fault_driver.PRELOAD)
    return ctx


def _stamp_time(stamp: str):
    """The time the victim wrote to ``stamp`` before acting (None while the file is absent or empty)."""
    if os.path.exists(stamp) and os.path.getsize(stamp):
        with open(stamp) as fh:
            return float(fh.read())
    return None


def _start(ctx, folder, spec, save_dir=None, cfg=None, extra=()):
    """Start a 2-rank job with ``spec`` injected (``extra``: more launch/train.py flags); returns its handle."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "cfg.json"), "w") as fh:
        json.dump(cfg or CFG, fh)
    spec = dict(spec, stamp=os.path.join(folder, "stamp"))
    argv = ["--deepspeed_config", os.path.join(folder, "cfg.json"), "--save_dir",
            save_dir or os.path.join(folder, "ckpt")] + list(extra)
    port, logs = free_port(), [os.path.join(folder, f"rank{r}.log") for r in range(2)]
    procs = [ctx.Process(target=fault_driver.run_rank, args=(r, 2, port, spec, argv, logs[r])) for r in range(2)]
    for p in procs:
        p.start()
    return {"procs": procs, "logs": logs, "spec": spec}


def _job(ctx, folder, spec, save_dir=None, cfg=None, extra=()):
    """Run a 2-rank job with ``spec`` injected; returns {"codes", "logs", "pids", "stop_s", "fault_t", "hung"}."""
    return _wait_job(_start(ctx, folder, spec, save_dir, cfg, extra))


def _wait_job(run):
    """Wait for a job :func:`_start` started: every rank but a kill/stop victim must exit within the timeout."""
    procs, logs, spec = run["procs"], run["logs"], run["spec"]
    stamp, deadline, fault_t = spec["stamp"], time.time() + 120, None
    victim = spec.get("rank") if spec.get("action") in ("kill", "stop") else None  # the others must exit
    waited = [p for r, p in enumerate(procs) if r != victim]
    while time.time() < deadline and any(p.is_alive() for p in waited):
        if fault_t is None:
            fault_t = _stamp_time(stamp)
            if fault_t is not None:
                deadline = min(deadline, fault_t + TIMEOUT_S + SLACK_S)  # nobody may run past this
        time.sleep(0.02)
    fault_t = fault_t if fault_t is not None else _stamp_time(stamp)  # the survivor may leave between two polls
    hung = [r for r, p in enumerate(procs) if p.is_alive() and not (r == victim and spec["action"] == "stop")]
    stop_s = time.time() - fault_t if fault_t else None
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)  # the stopped victim, or a rank that hung
        p.join(10)
    return {"codes": [p.exitcode for p in procs], "logs": [open(f).read() for f in logs], "hung": hung,
            "pids": [p.pid for p in procs], "stop_s": stop_s, "fault_t": fault_t}


# ---------------------------------------------------------------------- replays in the pool
def _snapshot(xc) -> dict:
    xc.head_optimizer.catch_up_all()  # update auto = lazy_exact here: every row current, as a save has them

    def tensors(sd):
        return {f"{k}.{n}": v.clone() for k, st in sd["state"].items() for n, v in st.items() if torch.is_tensor(v)}
    return {"head": xc.head.weight.detach().clone(), "head_opt": tensors(xc.head_optimizer.state_dict()),
            "body": {n: p.detach().clone() for n, p in xc.engine.module.named_parameters()},
            "body_opt": tensors(xc.engine.basic_optimizer.state_dict()), "step": xc.global_steps}


def _engine(raw):
    import ds_xc
    from ds_xc.data import build_dataset
    from ds_xc.models import build_backbone
    torch.set_num_threads(1)
    tcfg, hcfg = raw["xc_train"], raw["extreme_classification"]
    data = build_dataset(tcfg["data"], hcfg["num_classes"], seed=tcfg.get("seed", 0))
    torch.manual_seed(tcfg.get("seed", 0))
    backbone = build_backbone(data, hcfg["embedding_dim"], hidden_dim=tcfg["hidden_dim"])
    return ds_xc.initialize(model=backbone, config=raw), data


def _replay(rank, world, raw, ref_dir, fault_dir, tags):
    """From ``fault_dir``'s latest (or from scratch when None) to STEPS: losses and the final state; and
    whether every tag in ``tags`` loads to the reference run's state of the same tag."""
    xc, data = _engine(raw)
    micro = xc.engine.train_micro_batch_size_per_gpu()
    same_tags = {}
    for tag in tags:
        xc.load_checkpoint(fault_dir, tag=tag)
        got = _snapshot(xc)
        xc.load_checkpoint(ref_dir, tag=tag)
        same_tags[tag] = _differences(got, _snapshot(xc))
    start = xc.load_checkpoint(fault_dir)["step"] if fault_dir else 0
    losses = []
    for step in range(start, STEPS):
        x, y = data.train_batch(step, micro, rank, world)
        losses.append(xc.forward_backward(x, y).item())
        xc.step()
        if (step + 1) % SAVE_EVERY == 0:  # launch/train.py saves here; its save catches every row up
            xc.head_optimizer.catch_up_all()  # (lazy_exact: a catch-up's rounding depends on when it runs)
    final = _snapshot(xc)
    xc.load_checkpoint(ref_dir, tag=f"step{STEPS}")
    return {"start": start, "losses": losses, "final_vs_ref": _differences(final, _snapshot(xc)),
            "tags": same_tags}


def _differences(a: dict, b: dict) -> list:
    out = [] if a["step"] == b["step"] else ["step"]
    out += [] if torch.equal(a["head"], b["head"]) else ["head"]
    for part in ("head_opt", "body", "body_opt"):
        out += [f"{part}.{k}" for k in sorted(set(a[part]) | set(b[part]))
                if k not in a[part] or k not in b[part] or not torch.equal(a[part][k], b[part][k])]
    return out


def _make_reference(folder, pools, cfg) -> dict:
    """The uninterrupted job (tracing the phases it enters) and the pool's straight replay of it."""
    ctx = _server()
    trace = os.path.join(folder, "trace")
    job = _job(ctx, folder, {"action": "trace", "trace": trace}, cfg=cfg)
    assert job["codes"] == [0, 0], job["logs"][0][-3000:]
    straight = pools(2).run(_replay, cfg, os.path.join(folder, "ckpt"), None, [])
    for r in range(2):
        assert straight[r]["final_vs_ref"] == [], straight[r]  # the pool replays launch/train.py exactly
    entries = [line.split(" ", 2) for line in open(trace).read().splitlines()]
    return {"ctx": ctx, "ckpt": os.path.join(folder, "ckpt"), "straight": straight, "cfg": cfg,
            "trace": [(int(r), int(s), p) for r, s, p in entries]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, pools):
    yield _make_reference(str(tmp_path_factory.mktemp("reference")), pools, CFG)
    if os.environ.get("DS_XC_FAULT_TALLY"):
        _write_tally(os.environ["DS_XC_FAULT_TALLY"])


@pytest.fixture(scope="module")
def overlap_reference(tmp_path_factory, pools, reference):
    return _make_reference(str(tmp_path_factory.mktemp("overlap_reference")), pools, CFG_OVERLAP)


def _count(kind: str, survived: bool, **extra) -> None:
    TALLY["injected"] += 1
    TALLY["survived"] += bool(survived)
    slot = TALLY["by_kind"].setdefault(kind, {"injected": 0, "survived": 0})
    slot["injected"] += 1
    slot["survived"] += bool(survived)
    for k, v in extra.items():
        TALLY[k] += v


def test_the_phase_schedule_matches_the_trace(reference):
    """Every phase point the draw can pick is entered by the reference run (else a fault could never fire)."""
    seen = {(s, p) for r, s, p in reference["trace"]}
    for kind, spec in CASES:
        if spec["at"].startswith("phase:"):
            assert (spec["step"], _phase_of(spec["at"])) in seen, spec
    assert {p for _, p in seen} >= set(ORDER)


_MSG = re.compile(r"rank (\d) of 2: a collective failed during (.+?) at global step (\d+); peer process "
                  r"(gone|stopped \(not answering\)): rank (\d) \(pid (\d+) on")


def _check_resume(reference, ckpt: str, expect_latest: str, pools) -> list:
    """Problems with the checkpoints a faulted job left: ``latest``, the published tags, the resume."""
    problems = []
    latest = open(os.path.join(ckpt, "latest")).read() if os.path.exists(os.path.join(ckpt, "latest")) else None
    if latest != expect_latest:
        problems.append(f"latest is {latest!r}, expected {expect_latest!r}")
        return problems
    tags = sorted(d for d in os.listdir(ckpt) if not d.startswith(".") and os.path.isdir(os.path.join(ckpt, d)))
    got = pools(2).run(_replay, reference["cfg"], reference["ckpt"], ckpt, tags)
    for r in range(2):
        ref = reference["straight"][r]
        problems += [f"rank {r}: tag {t} differs from the reference in {d}" for t, d in got[r]["tags"].items() if d]
        if got[r]["losses"] != ref["losses"][got[r]["start"]:]:
            problems.append(f"rank {r}: the resumed losses differ: {got[r]['losses']} vs {ref['losses']}")
        if got[r]["final_vs_ref"]:
            problems.append(f"rank {r}: final state differs in {got[r]['final_vs_ref']}")
    return problems


@pytest.mark.parametrize("kind,spec", CASES, ids=[f"{k}-{s['at'].split(':')[-1]}-step{s['step']}-rank{s['rank']}"
                                                  for k, s in CASES])
def test_a_lost_rank_stops_the_job_and_the_last_checkpoint_resumes_exactly(reference, pools, tmp_path, kind, spec):
    _lost_rank_case(reference, pools, str(tmp_path), kind, spec)


@pytest.mark.parametrize("kind,spec", OVERLAP_CASES, ids=[f"{k}-{s['at'].split(':')[-1]}-step{s['step']}-rank{s['rank']}"
                                                          for k, s in OVERLAP_CASES])
def test_a_lost_rank_in_the_overlap_pipeline(overlap_reference, pools, tmp_path, kind, spec):
    """The same with extreme_classification.overlap (chunked head, gradient buckets in flight)."""
    _lost_rank_case(overlap_reference, pools, str(tmp_path), kind, spec)


def _lost_rank_case(reference, pools, folder, kind, spec):
    job = _job(reference["ctx"], folder, spec, cfg=reference["cfg"])
    victim, survivor = spec["rank"], 1 - spec["rank"]
    hung = bool(job["hung"])
    problems = [f"ranks {job['hung']} still running {TIMEOUT_S + SLACK_S} s after the fault"] if hung else []
    if job["fault_t"] is None:
        problems.append(f"the fault never fired: exit codes {job['codes']}")
    if kind == "kill" and job["codes"][victim] != -signal.SIGKILL:
        problems.append(f"victim exit code {job['codes'][victim]}")
    if job["codes"][survivor] != 3:
        problems.append(f"survivor exit code {job['codes'][survivor]}")
    m = _MSG.search(job["logs"][survivor])
    if m is None:
        problems.append("no message naming the phase and the lost rank")
    else:
        rank, phase, step, how, lost, pid = m.groups()
        where = _where(reference["trace"], survivor, int(step), phase)
        outer = {"index rebuild": "forward"}.get(_phase_of(spec["at"]), _phase_of(spec["at"]))  # nested in it
        start = _where(reference["trace"], survivor, spec["step"], outer)
        if (int(rank), int(lost), int(pid)) != (survivor, victim, job["pids"][victim]):
            problems.append(f"the message names rank {rank}, lost rank {lost} pid {pid}")
        if where is None or start is None or not start <= where <= start + 8:
            problems.append(f"the survivor failed during {phase} at step {step}: not at or after the fault")
        if ("gone" in how) != (kind == "kill"):
            problems.append(f"the lost rank is said to be {how}")
    if job["stop_s"] is not None and job["stop_s"] > TIMEOUT_S + SLACK_S:
        problems.append(f"the job took {job['stop_s']:.1f} s to stop")
    lost = _check_resume(reference, os.path.join(folder, "ckpt"), _expected_latest(spec["at"], spec["step"]),
                         pools) if job["fault_t"] is not None else ["no fault"]
    _count(kind, not problems and not lost, hangs=int(hung), data_lost=int(bool(lost)))
    assert not problems + lost, "\n".join(problems + lost) + "\n--- survivor log:\n" + job["logs"][survivor][-3000:]


def _where(trace: list, rank: int, step: int, phase: str):
    """The index of the first entry of ``phase`` at ``step`` in ``rank``'s trace (None when absent)."""
    entries = [(s, p) for r, s, p in trace if r == rank]
    return entries.index((step, phase)) if (step, phase) in entries else None


# ---------------------------------------------------------------------- a full disk
@pytest.mark.parametrize("at,rank", [("phase:checkpoint save", 1), (DS_SAVE, 0)], ids=["save-start", "deepspeed-file"])
def test_a_full_disk_during_a_save_stops_the_job_and_keeps_the_last_checkpoint(reference, pools, tmp_path, at, rank):
    """A 4 MiB tmpfs holds the checkpoints; at the save of step 4 one rank fills it up (the fallback where
    mounting is refused: that rank's next torch.save writes half a file and raises ENOSPC)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    spec = {"rank": rank, "at": at, "step": 4, "action": "fill", "fill": str(disk)}
    if mounted.returncode != 0:
        spec["action"] = "enospc"
        TALLY["notes"] = f"ENOSPC simulated (mount refused: {mounted.stderr.decode().strip()[:200]})"
    try:
        job = _job(reference["ctx"], str(tmp_path / "job"), spec, save_dir=str(disk / "ckpt"))
        if os.path.exists(disk / "filler.bin"):
            os.remove(disk / "filler.bin")  # the disk has room again: resume on it
        problems = [f"ranks {job['hung']} still running" for _ in job["hung"][:1]]
        problems += [f"rank {r} exit code {c}" for r, c in enumerate(job["codes"]) if c in (0, None)]
        named = [r for r in range(2) if re.search(rf"rank {r} of 2: .*during checkpoint save at global step 4",
                                                  job["logs"][r])]
        if sorted(named) != [0, 1]:
            problems.append(f"only ranks {named} name themselves and the phase")
        if not any("No space left on device" in log for log in job["logs"]):
            problems.append("no rank reports ENOSPC")
        lost = _check_resume(reference, str(disk / "ckpt"), "step2", pools)
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    _count("full disk", not problems and not lost, hangs=int(bool(job["hung"])), data_lost=int(bool(lost)))
    assert not problems + lost, "\n".join(problems + lost) + "\n" + "\n---\n".join(g[-2500:] for g in job["logs"])


# ---------------------------------------------------------------------- damaged files
def _damage(path: str, kind: str, offset: int, bit: int) -> None:
    if kind == "truncate":
        os.truncate(path, offset)
    else:
        with open(path, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)[0]
            fh.seek(offset)
            fh.write(bytes([byte ^ (1 << bit)]))


def _load_damaged(rank, world, raw, src, tag, cases, work):
    """Load each damaged copy of ``src/tag``: ("error", message) or ("loaded", differences to the saved state)."""
    import torch.distributed as dist
    xc, _ = _engine(raw)
    xc.load_checkpoint(src, tag=tag)
    want = dict(_snapshot(xc), rng=torch.get_rng_state())
    out = []
    for i, (name, kind, offset, bit) in enumerate(cases):
        folder = os.path.join(work, f"case{i}")
        if rank == 0:
            shutil.copytree(os.path.join(src, tag), os.path.join(folder, tag))
            with open(os.path.join(folder, "latest"), "w") as fh:
                fh.write(tag)
            _damage(os.path.join(folder, tag, name), kind, offset, bit)
        dist.barrier()
        try:
            xc.load_checkpoint(folder)
        except Exception as exc:
            out.append(("error", f"{type(exc).__name__}: {exc}"))
            xc.load_checkpoint(src, tag=tag)  # the state as saved again, whatever an error left
        else:
            got = dict(_snapshot(xc), rng=torch.get_rng_state())
            out.append(("loaded", _differences(got, want) + ([] if torch.equal(got["rng"], want["rng"]) else ["rng"])))
    return out


def test_damaged_checkpoint_files_are_refused_naming_the_file_or_load_exactly(reference, pools, tmp_path):
    """40 seeded faults: a file of the step-4 checkpoint truncated at, or with one bit flipped at, a random offset."""
    tag_dir = os.path.join(reference["ckpt"], "step4")
    files = sorted(os.path.relpath(os.path.join(root, f), tag_dir) for root, _, names in os.walk(tag_dir)
                   for f in names)
    rng = random.Random(FAULT_SEED + 1)
    cases = []
    for _ in range(40):
        name = rng.choice(files)
        size = os.path.getsize(os.path.join(tag_dir, name))
        cases.append((name, rng.choice(["truncate", "bitflip"]), rng.randrange(size), rng.randrange(8)))
    results = pools(2).run(_load_damaged, CFG, reference["ckpt"], "step4", cases, str(tmp_path))
    silent = []
    for i, (name, kind, offset, bit) in enumerate(cases):
        for r in range(2):
            what, detail = results[r][i]
            named = name in detail or (name == "ds_xc_manifest.json" and "ds_xc_manifest.json" in detail)
            if (what == "error" and not (detail.startswith("CheckpointError") and named)) or \
                    (what == "loaded" and detail):
                silent.append(f"{name} {kind} at {offset} (bit {bit}), rank {r}: {what}: {detail}"[:500])
        bad = [s for s in silent if s.startswith(f"{name} {kind} at {offset} ")]
        _count("damaged file", not bad, silent_corruptions=int(bool(bad)))
    # launch/export.py on the same damaged copies: refused naming the file (it checks the manifest), never exported
    export = _export_tool()
    for i, (name, kind, offset, bit) in enumerate(cases):
        out = str(tmp_path / f"case{i}.pt")
        try:
            export.export(str(tmp_path / f"case{i}" / "step4"), out, fmt="pt")
        except Exception as exc:  # the message must name the damaged file
            ok = type(exc).__name__ == "CheckpointError" and name in str(exc) and not os.path.exists(out)
        else:
            ok = False
            silent.append(f"export of {name} {kind} at {offset} (bit {bit}): exported")
        _count("damaged file, export", ok, silent_corruptions=int(not ok))
    assert not silent, "\n".join(silent)
    assert {c[0] for c in cases} == set(files)  # every file of the checkpoint was hit at least once


def _export_tool():
    import importlib.util
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("ds_xc_launch_export", os.path.join(root, "launch", "export.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------- issue 59: saves and resumes that lost data
def _digests(folder: str) -> dict:
    import hashlib
    return {os.path.relpath(os.path.join(d, f), folder): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(folder) for f in files}


def test_two_jobs_saving_one_tag_the_second_is_refused_naming_the_holder(reference, pools, tmp_path):
    """Job A pauses inside its publish of step4 (holding the tag's save lock); job B, same folder, saves step2 and
    then step4: B is refused naming A's rank 0, A finishes, every tag equals the reference's and resumes exactly."""
    ckpt, release = str(tmp_path / "ckpt"), str(tmp_path / "release")
    slow = json.loads(json.dumps(CFG))
    slow["xc_train"]["comm_timeout_s"] = 120  # A's rank 1 waits for its paused rank 0
    a = _start(reference["ctx"], str(tmp_path / "a"), {"rank": 0, "at": "call:ds_xc.engine.checkpointing:publish_tag",
                                                       "step": 4, "action": "pause", "release": release},
               save_dir=ckpt, cfg=slow)
    deadline = time.time() + 120
    while _stamp_time(a["spec"]["stamp"]) is None and time.time() < deadline and all(p.is_alive() for p in a["procs"]):
        time.sleep(0.05)
    short = json.loads(json.dumps(slow))
    short["xc_train"]["max_steps"] = 4
    b = _job(reference["ctx"], str(tmp_path / "b"), {"action": "none"}, save_dir=ckpt, cfg=short)
    open(release, "w").close()
    job_a = _wait_job(a)
    problems = [f"job A exit codes {job_a['codes']}"] if job_a["codes"] != [0, 0] else []
    problems += [f"job B rank {r} exit code {c}" for r, c in enumerate(b["codes"]) if c in (0, None)]
    holder = f"is being saved by another job: pid {job_a['pids'][0]} on host"
    problems += [f"job B rank {r} does not name the holder" for r in range(2) if holder not in b["logs"][r]]
    problems += [f"ranks {job_a['hung'] + b['hung']} hung"] if job_a["hung"] or b["hung"] else []
    lost = _check_resume(reference, ckpt, f"step{STEPS}", pools)
    lost += [f"a lock or staging folder left: {n}" for n in os.listdir(ckpt) if n.startswith((".lock_", ".staging_"))]
    _count("two jobs saving one tag", not problems and not lost, data_lost=int(bool(lost)))
    assert not problems + lost, "\n".join(problems + lost) + "\n" + "\n---\n".join(g[-2500:] for g in
                                                                                  b["logs"] + job_a["logs"])


def test_a_killed_saver_leaves_a_stale_lock_that_the_next_save_takes_over(reference, pools, tmp_path):
    """Rank 0 killed inside its save of step4 (lock held, staging written): a resumed job saves step4 again,
    taking the stale lock over, and ends with the reference's checkpoints."""
    ckpt = str(tmp_path / "ckpt")
    job = _job(reference["ctx"], str(tmp_path / "killed"), {"rank": 0, "at": "call:ds_xc.engine.checkpointing:publish_tag",
                                                           "step": 4, "action": "kill"}, save_dir=ckpt)
    problems = [] if os.path.exists(os.path.join(ckpt, ".lock_step4")) else ["no lock left by the killed saver"]
    again = _job(reference["ctx"], str(tmp_path / "resumed"), {"action": "none"}, save_dir=ckpt, extra=["--resume"])
    problems += [f"the resumed job's exit codes {again['codes']}"] if again["codes"] != [0, 0] else []
    problems += [] if "taking over the save lock of pid" in again["logs"][0] else ["no warning naming the stale lock"]
    lost = _check_resume(reference, ckpt, f"step{STEPS}", pools) if job["fault_t"] else ["no fault"]
    lost += [f"left: {n}" for n in os.listdir(ckpt) if n.startswith((".lock_", ".staging_"))]
    _count("stale save lock", not problems and not lost, hangs=int(bool(job["hung"] or again["hung"])),
           data_lost=int(bool(lost)))
    assert not problems + lost, "\n".join(problems + lost) + "\n" + again["logs"][0][-3000:]


@pytest.mark.parametrize("extra,message", [
    (["--resume", "--set", 'extreme_classification.sampler={"type": "uniform", "sample_rate": 0.5}'],
     "sampler.type: checkpoint 'ann', this run 'uniform'"),
    (["--resume", "--set", 'extreme_classification.optimizer={"type": "adamw", "lr": 0.003}'],
     "optimizer.type: checkpoint 'sgd', this run 'adamw'"),
    (["--resume", "--max_steps", "4"], f"is at step {STEPS}, past max_steps=4"),
    (["--resume"], "(the folder does not exist)")], ids=["edited-sampler", "edited-optimizer", "smaller-max-steps",
                                                        "mistyped-folder"])
def test_a_resume_that_cannot_load_everything_stops_on_every_rank_and_changes_nothing(reference, tmp_path, extra,
                                                                                       message):
    """Refused before any step or save, on both ranks, within the timeout; the checkpoint's files unchanged."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(reference["ckpt"], ckpt)
    before = _digests(ckpt)
    save_dir = ckpt if message != "(the folder does not exist)" else ckpt + "_typo"
    job = _job(reference["ctx"], str(tmp_path / "job"), {"action": "none"}, save_dir=save_dir, extra=extra)
    problems = [f"rank {r} exit code {c}" for r, c in enumerate(job["codes"]) if c in (0, None)]
    problems += [f"rank {r} does not say {message!r}" for r in range(2) if message not in job["logs"][r]]
    problems += [f"ranks {job['hung']} hung"] if job["hung"] else []
    lost = [] if _digests(ckpt) == before and not os.path.exists(ckpt + "_typo") else ["the checkpoint changed"]
    _count("resume refused", not problems and not lost, hangs=int(bool(job["hung"])), data_lost=int(bool(lost)))
    assert not problems + lost, "\n".join(problems + lost) + "\n" + job["logs"][0][-3000:]


def test_a_read_only_checkpoint_resumes_exactly_on_two_ranks(reference, pools, tmp_path):
    """The reference checkpoint on a read-only bind mount (chmod a-w where mounting is refused): it loads on both
    ranks, every tag equals the reference's, the resume is exact, nothing is written."""
    ro = str(tmp_path / "ro")
    os.makedirs(ro)
    mounted = subprocess.run(["mount", "--bind", reference["ckpt"], ro], capture_output=True).returncode == 0 and \
        subprocess.run(["mount", "-o", "remount,bind,ro", ro], capture_output=True).returncode == 0
    folder = ro if mounted else reference["ckpt"]
    if not mounted:
        subprocess.run(["umount", ro], capture_output=True)
        subprocess.run(["chmod", "-R", "a-w", folder], check=False)
        TALLY["notes_read_only"] = "read-only by chmod (mount refused)"
    try:
        stamp = os.stat(folder).st_mtime_ns
        lost = _check_resume(reference, folder, f"step{STEPS}", pools)
        lost += [] if os.stat(folder).st_mtime_ns == stamp else ["the folder was written to"]
    finally:
        if mounted:
            subprocess.run(["umount", ro], check=False)
        else:
            subprocess.run(["chmod", "-R", "u+w", folder], check=False)
    _count("read-only resume", not lost, data_lost=int(bool(lost)))
    assert not lost, "\n".join(lost)


def _write_tally(path: str) -> None:
    """The counts as JSON at ``path`` and as a table next to it (``.md``): docs/checkpoints.md cites it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()
    TALLY["commit"], TALLY["command"] = head, f"DS_XC_FAULT_TALLY={path} python -m pytest -q tests/test_faults.py"
    with open(path, "w") as fh:
        json.dump(TALLY, fh, indent=1)
    lines = ["# Fault injection: the tally", "",
             f"Written by `{TALLY['command']}` (tests/test_faults.py) at commit {head}, "
             f"seed {FAULT_SEED}; docs/checkpoints.md describes each kind.", "",
             "| kind | injected | survived |", "|---|---|---|"]
    lines += [f"| {k} | {v['injected']} | {v['survived']} |" for k, v in TALLY["by_kind"].items()]
    lines += [f"| **total** | **{TALLY['injected']}** | **{TALLY['survived']}** |", "",
              f"Silent corruptions: {TALLY['silent_corruptions']}; hangs past the timeout: {TALLY['hangs']}; "
              f"checkpoints with data lost: {TALLY['data_lost']}."]
    lines += [f"Note: {v}" for k, v in TALLY.items() if k.startswith("notes")]
    with open(os.path.splitext(path)[0] + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
