"""The recipes of configs/: every file passes the config validator, configs/README.md lists
each one with its class count, and launch/train.py runs each for a few steps (slow), with
a summary that names the sampler and the active share its budget implies, on 1 and 2 ranks."""
import glob
import json
import math
import os
import re
from fractions import Fraction

import pytest

import ds_xc
from ds_xc.engine import load_raw_config
from tests.train_procs import run_ranks

pytestmark = pytest.mark.xdist_group("recipes")  # the module's runs share one process: one xdist worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.json")))
NAMES = [os.path.basename(p) for p in RECIPES]
FETCHED = ("glyphs", "corpus")  # data sets fetched from Debian: the smoke runs use synthetic data instead


def _raw(name: str) -> dict:
    return load_raw_config(os.path.join(ROOT, "configs", name))


@pytest.mark.parametrize("name", NAMES)
def test_recipe_passes_the_validator(name):
    raw = _raw(name)
    cfg = ds_xc.parse_config(raw)
    head, train = raw["extreme_classification"], raw.get("xc_train", {})
    assert cfg.extreme_classification.num_classes == head["num_classes"]
    assert cfg.extreme_classification.sampler.type == head.get("sampler", {}).get("type", "full")
    assert cfg.extreme_classification.loss.type == head.get("loss", {}).get("type", "softmax")
    assert cfg.xc_train.data == train.get("data", "text")


def _readme_rows() -> dict:
    """{file: classes} of the table in configs/README.md (first column a link to the file)."""
    with open(os.path.join(ROOT, "configs", "README.md")) as fh:
        text = fh.read()
    rows = re.findall(r"^\| \[`?([\w.]+\.json)`?\]\([\w./]+\) \|(.*)$", text, re.M)
    return {name: [c.strip() for c in rest.split("|")] for name, rest in rows}


def test_readme_lists_every_recipe_with_its_classes():
    rows = _readme_rows()
    assert sorted(rows) == NAMES
    for name, cells in rows.items():
        classes = _raw(name)["extreme_classification"]["num_classes"]
        assert f"{classes:,}" in cells, (name, cells)


def test_the_default_job_is_a_sampled_head_over_word_pairs_and_the_old_one_is_kept():
    default, exact = ds_xc.parse_config(_raw("default.json")), ds_xc.parse_config(_raw("text_exact_20k.json"))
    head, train = default.extreme_classification, default.xc_train
    assert head.sampler.type == "ann" and head.num_classes >= 10**5
    assert (train.data, train.text_mode) == ("text", "bigram")
    head, train = exact.extreme_classification, exact.xc_train
    assert (head.sampler.type, head.num_classes, head.optimizer.update) == ("full", 20_000, "dense")
    assert (train.data, train.text_mode, train.max_steps, train.eval_samples) == ("text", "word", 1500, 8192)


# ---------------------------------------------------------------- smoke runs (slow)
def _expected_active(sampler: dict, num_classes: int, world: int, batch: int = 32) -> int:
    """Active classes per step summed over the shards: max(ceil(rate * L_r), min(N, L_r)) per rank for
    a global batch of N = world * batch rows (sampling/active.py: room for every positive), every class
    for the exact head."""
    if sampler.get("type", "full") == "full":
        return num_classes
    rate = Fraction(str(sampler.get("sample_rate", 0.1)))
    sizes = [num_classes // world + (r < num_classes % world) for r in range(world)]
    return sum(min(size, max(math.ceil(rate * size), world * batch)) for size in sizes)


def _args(name: str, summary, num_classes: int) -> list:
    args = ["--deepspeed_config", os.path.join(ROOT, "configs", name), "--max_steps", "3", "--eval_every", "0",
            "--num_classes", str(num_classes), "--summary_json", str(summary),
            "--set", "train_micro_batch_size_per_gpu=32", "--set", "xc_train.eval_samples=256"]
    if _raw(name).get("xc_train", {}).get("data") in FETCHED:
        args += ["--data", "synthetic"]
    return args


def _run(name: str, tmp_path, world: int, num_classes: int = 2001) -> tuple[dict, str]:
    summary = tmp_path / "summary.json"
    out = run_ranks(_args(name, summary, num_classes), world=world)  # ranks started directly: test_launch.py
    with open(summary) as fh:                                       # tests the launcher
        return json.load(fh), out


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    """Every recipe's 3-step run on one rank, each forked from one process that loaded the
    interpreter, torch and DeepSpeed once (tests/recipe_driver.py). {name: (summary or None, output)}."""
    work = tmp_path_factory.mktemp("recipes")
    jobs = [{"args": _args(n, work / f"{n}.summary.json", _smoke_classes(n)), "out": str(work / f"{n}.out")}
            for n in NAMES]
    (work / "jobs.json").write_text(json.dumps(jobs))
    run_ranks([str(work / "jobs.json")], world=1, script=os.path.join(ROOT, "tests", "recipe_driver.py"))
    runs = {}
    for n, job in zip(NAMES, jobs):
        summary = work / f"{n}.summary.json"
        runs[n] = (json.loads(summary.read_text()) if summary.exists() else None, open(job["out"]).read())
    return runs


def _check_summary(name: str, res: dict, out: str, world: int, num_classes: int = 2001) -> None:
    sampler = _raw(name)["extreme_classification"].get("sampler", {"type": "full"})
    active = _expected_active(sampler, num_classes, world)
    assert (res["steps"], res["world_size"], res["num_classes"]) == (3, world, num_classes)
    assert res["sampler"] == sampler.get("type", "full") and math.isfinite(res["final_loss"])
    assert res["active"]["active_classes"] == active
    assert res["active"]["share"] == pytest.approx(active / num_classes, rel=1e-12)
    line = re.search(r"^head: .*sampler (\w+) .*?([\d,]+) of ([\d,]+) classes active per step \(share ([0-9.]+)\); "
                     r"held-out top-1 ([0-9.]+) top-5 ([0-9.]+)$", out, re.M)
    assert line, out[-3000:]
    assert line.group(1) == res["sampler"] and int(line.group(2).replace(",", "")) == active
    assert int(line.group(3).replace(",", "")) == num_classes
    assert float(line.group(5)) == pytest.approx(res["top1"], abs=5e-5)
    assert float(line.group(6)) == pytest.approx(res["top5"], abs=5e-5)


def _smoke_classes(name: str) -> int:
    """2001 classes, or more where the recipe's sample rate would give a budget below the 32 rows of a
    smoke batch (configs/synthetic_1e7.json: 1%), so that the positives fit in the budget."""
    rate = _raw(name)["extreme_classification"].get("sampler", {}).get("sample_rate", 1.0)
    return max(2001, 2 * math.ceil(32 / rate) + 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_recipe_runs(name, one_rank_runs):
    res, out = one_rank_runs[name]
    assert res is not None and out.rstrip().endswith("exit 0"), out[-4000:]
    _check_summary(name, res, out, world=1, num_classes=_smoke_classes(name))


@pytest.mark.slow
def test_default_recipe_on_two_ranks_counts_every_shard(tmp_path):
    res, out = _run("default.json", tmp_path, world=2)  # 2001 classes: shards of 1001 and 1000
    _check_summary("default.json", res, out, world=2)


ADAPTIVE = {"text_adaptive.json": "default.json", "glyphs_adaptive.json": "glyphs_cosface.json"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("name,base", sorted(ADAPTIVE.items()))
def test_adaptive_recipe_is_its_base_with_the_schedule_batch_and_rates(name, base):
    """The adaptive recipes of docs/convergence.md change only the global batch, the rates, the
    adaptive_lr section and the job's length against the recipe they are measured against."""
    new, old = _flat(_raw(name)), _flat(_raw(base))
    changed = {k for k in set(new) | set(old) if new.get(k) != old.get(k)}
    allowed = {"train_micro_batch_size_per_gpu", "optimizer.params.lr", "extreme_classification.optimizer.lr",
               "xc_train.max_steps", "xc_train.eval_every"}
    assert {k for k in changed if not k.startswith("adaptive_lr.")} <= allowed, changed
    assert ds_xc.parse_config(_raw(name)).adaptive_lr.enabled and "scheduler" not in _raw(name)
