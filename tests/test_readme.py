"""The README's 30-second example runs as written (with fewer classes, to stay quick), and its
first loss is the sampled ArcFace loss of tests/reference.py over the active classes it drew."""
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.reference import per_row_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS_LINE = "    loss = xc(x, y)"
# after the first forward, before any update: the inputs of the loss, for an independent recomputation
PROBE = """
    if step == 0:
        with torch.no_grad():
            emb = xc.engine.module(x)
        torch.save({"loss": float(loss), "emb": emb, "weight": xc.head.weight.detach().clone(),
                    "index": xc.head.last_active.index, "targets": xc.head.last_active.targets,
                    "labels": y, "loss_cfg": config["extreme_classification"]["loss"]}, "first_step.pt")
"""


@pytest.mark.slow
def test_readme_example_runs(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as fh:
        code = re.findall(r"```python\n(.*?)```", fh.read(), re.S)[0]
    assert "ds_xc.initialize" in code and "1_000_000" in code
    lines = code.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(LOSS_LINE))
    code = "\n".join(lines[: at + 1] + PROBE.strip("\n").split("\n") + lines[at + 1:])
    script = tmp_path / "example.py"
    script.write_text(code.replace("1_000_000", "20_000") + "\nprint('LOSS', float(loss))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a plain `python example.py`
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").is_file()
    assert re.search(r"LOSS ([0-9.]+)", proc.stdout), proc.stdout[-2000:]
    first = torch.load(tmp_path / "first_step.pt", weights_only=True)
    index, targets = first["index"], first["targets"]  # (K,) sorted class ids, (B,) columns in [0, K)
    assert first["weight"].shape == (20_000, 128) and index.numel() >= 2000  # 10% of the classes + positives
    assert torch.equal(index[targets], first["labels"])  # every positive is active, at its column
    cfg = first["loss_cfg"]
    ref = per_row_loss(first["emb"].double(), first["weight"].double()[index], targets, cfg).mean()
    assert first["loss"] == pytest.approx(float(ref), rel=1e-5)


def test_ci_runs_the_readme_test_command_verbatim():
    """.ci/run ends with the README's test command, and the command runs every test: the parallel
    part excludes exactly the `serial` marker that the second part selects."""
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = fh.read()
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        ci = fh.read()
    cmd = re.search(r"Set up and run the tests:\n\n```bash\n(.+)\n```", readme).group(1)
    assert cmd in ci.splitlines()
    assert '-m "not serial"' in cmd and cmd.endswith("python -m pytest -q -m serial")


REVISION = re.compile(r"\b(?:git(?: revisions?)?|[Rr]evisions?|ds_xc at git)[:\s]+`?[0-9a-f]{7,40}\b")


def _results_cited(text: str, results: str) -> set:
    """Names of top-level files in benchmarks/results/ that ``text`` cites (history/ is not top-level)."""
    return {m.group(1) for m in re.finditer(r"(?<![\w/])(?:benchmarks/results/)?([\w.]+\.md)", text)
            if m.group(1) != "README.md" and os.path.exists(os.path.join(results, m.group(1)))
            and not text[max(m.start() - 5, 0): m.start()].endswith("docs/")}


def _code_was_dirty(line: str) -> bool:
    """True when a header line lists uncommitted files other than results files (the code that ran
    was not the committed revision)."""
    m = re.search(r"uncommitted:\s*([^)]*)", line)
    if not m:
        return False
    paths = [p.strip() for p in m.group(1).split(",") if p.strip()]
    return not paths or any(not p.startswith("benchmarks/results/") for p in paths)


def test_readme_and_docs_numbers_come_from_clean_revisions():
    """Every results file the README or a page of docs/ quotes names, in its header, the committed
    revision it ran at, with no uncommitted change to the code (issue 15). Superseded runs live in
    benchmarks/results/history/ and are quoted as history only."""
    results = os.path.join(ROOT, "benchmarks", "results")
    pages = [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    cited = {}
    for page in pages:
        with open(page) as fh:
            for name in _results_cited(fh.read(), results):
                cited.setdefault(name, []).append(os.path.basename(page))
    assert len(cited) >= 20, cited
    for name, pages_citing in sorted(cited.items()):
        with open(os.path.join(results, name)) as fh:
            header = fh.read().split("\n## ")[0]
        revs = [line for line in header.splitlines() if REVISION.search(line)]
        assert revs, f"{name} (quoted by {pages_citing}): its header names no git revision"
        assert not any(_code_was_dirty(line) for line in revs), \
            f"{name} (quoted by {pages_citing}): ran with uncommitted code: {revs}"


def test_dirty_code_rule():
    assert _code_was_dirty("Revision: af08d14 (uncommitted: ds_xc/head/head.py)")
    assert not _code_was_dirty("Revision: af08d14 (uncommitted: benchmarks/results/a.md, benchmarks/results/b.json)")
    assert not _code_was_dirty("- git 97e6e6a (no uncommitted files under ds_xc/)")
    assert REVISION.search("- git revisions: aef4c62, 19e4453 (clean trees)")
    assert not REVISION.search("- date: 2026-12-01")