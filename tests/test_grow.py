"""Growing the class set of a checkpoint (launch/grow.py, ds_xc/head/imprint.py).

Engines train 23 classes on 1, 3 and 2 gloo ranks (uneven shards) with dense SGD momentum, lazy
AdamW, lazy_exact SGD and lazy_exact AdamW (a uniform sampler, so rows differ in staleness), save,
grow to 31 classes on 2, 2 and 3 ranks, and load into an engine with num_classes 31: every old
row and its optimizer rows equal the saved ones bit for bit, the new rows are the fresh head's
rows with zero state, AdamW's step is kept, and the top-5 over all 31 classes equals a float64
reference over the merged weights. Imprinting on 2 and 3 ranks equals a float64 single-process
reference; the command line imprints from a trained built-in job and the job resumes from it.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ds_xc
from ds_xc.checkpoint import ShardRows, load_file
from ds_xc.head import init_shard, shard_range
from ds_xc.head.imprint import ImprintSums, imprint_rows, new_class_range
from tests.train_procs import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C, C2, D, IN, B, SEED = 23, 31, 6, 5, 4, 11
MODES = {"sgd-dense": ("sgd", "dense", "full"), "adamw-lazy": ("adamw", "lazy", "uniform"),
         "sgd-lazy_exact": ("sgd", "lazy_exact", "uniform"), "adamw-lazy_exact": ("adamw", "lazy_exact", "uniform")}


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"ds_xc_launch_{name}", os.path.join(ROOT, "launch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


grow_tool = _tool("grow")


def _config(mode, num_classes):
    opt, update, sampler = MODES[mode]
    extra = {"momentum": 0.9, "weight_decay": 0.01} if opt == "sgd" else {"weight_decay": 0.01}
    return {
        "train_micro_batch_size_per_gpu": B, "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "extreme_classification": {
            "num_classes": num_classes, "embedding_dim": D, "loss": {"type": "cosface", "scale": 8.0, "margin": 0.2},
            "sampler": {"type": sampler} if sampler == "full" else {"type": sampler, "sample_rate": 0.4},
            "init_std": 0.5, "seed": SEED, "optimizer": {"type": opt, "lr": 0.05, "update": update, **extra}},
    }


def _batch(step, rank, num_classes):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, IN, generator=g), torch.randint(0, num_classes, (B,), generator=g)


def _engine(mode, num_classes):
    torch.manual_seed(SEED)
    body = torch.nn.Linear(IN, D, bias=False)
    return ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9),
                            config=_config(mode, num_classes))


def _state(xc):
    opt = xc.head_optimizer.state_dict()["state"].get(0, {})
    return {"weight": xc.head.weight.detach().clone(), "opt": {k: v.clone() for k, v in opt.items()}}


def _train_and_save(rank, world, mode, save_dir, steps=3):
    xc = _engine(mode, C)
    for step in range(steps):
        x, y = _batch(step, rank, C)
        xc.backward(xc(x, y))
        xc.step()
    xc.save_checkpoint(save_dir, tag=f"step{steps}", client_state={"step": steps})
    return _state(xc)  # after the save: lazy_exact rows caught up, as saved


def _load_grown(rank, world, mode, load_dir):
    xc = _engine(mode, C2)
    start = xc.load_checkpoint(load_dir)["step"]
    out = dict(_state(xc), start=start, backbone=xc.engine.module.weight.detach().clone())
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(5, IN, generator=g)
    out["x"], out["top"] = x, xc.head.topk(xc.engine(x).detach(), k=5)  # (5, 5) over all 31 classes
    x, y = _batch(start, rank, C2)
    loss = xc(x, y)  # training goes on from the grown checkpoint, new classes' labels included
    xc.backward(loss)
    xc.step()
    out["loss"] = loss.item()
    return out


def _merged(results, key=None):
    return torch.cat([r["weight"] if key is None else r["opt"][key] for r in results])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_grow_keeps_old_rows_and_state_bit_for_bit(pools, tmp_path, mode):
    for old_world, new_world in ((1, 2), (3, 2), (2, 3)):
        src, dst = str(tmp_path / f"p{old_world}"), str(tmp_path / f"g{old_world}{new_world}")
        saved = pools(old_world).run(_train_and_save, mode, src)
        with open(os.path.join(tmp_path, f"cfg{old_world}.json"), "w") as fh:
            json.dump(_config(mode, C2), fh)
        report = grow_tool.main(["--load_dir", src, "--out_dir", dst, "--init", "random", "--world_size",
                                 str(new_world), "--deepspeed_config", os.path.join(tmp_path, f"cfg{old_world}.json")])
        assert (report["old_num_classes"], report["num_classes"], report["world_size"]) == (C, C2, new_world)
        loaded = pools(new_world).run(_load_grown, mode, dst)
        old_w = _merged(saved)
        new_w = init_shard(C2, D, C, C2 - C, 0.5, SEED)  # what a fresh 31-class head starts with
        keys = sorted(k for k, v in saved[0]["opt"].items() if v.dim() >= 1)
        assert keys == (["momentum_buffer"] if mode.startswith("sgd") else ["exp_avg", "exp_avg_sq"])
        for rank, r in enumerate(loaded):
            start, n = shard_range(C2, new_world, rank)
            assert r["start"] == 3
            assert torch.equal(r["weight"], torch.cat([old_w, new_w])[start: start + n])
            for key in keys:
                full = torch.cat([_merged(saved, key), torch.zeros(C2 - C, D)])
                assert torch.equal(r["opt"][key], full[start: start + n]), (key, rank)
            for key, v in saved[0]["opt"].items():
                if v.dim() == 0:  # AdamW's step
                    assert torch.equal(r["opt"][key], v)
            w = torch.cat([old_w, new_w]).double()
            cos = F.normalize(r["x"].double() @ r["backbone"].double().t(), dim=1) @ F.normalize(w, dim=1).t()
            assert torch.equal(r["top"], cos.topk(5, dim=1).indices), rank  # (5, 5) over all 31 classes
            assert r["loss"] == r["loss"] and r["loss"] > 0


def _imprint_dist(rank, world, emb, labels, first, num_classes, old_emb, old_rows):
    cuts = [3, 20][: world - 1] if world > 1 else []
    mine, old = torch.tensor_split(torch.arange(emb.shape[0]), cuts)[rank], \
        torch.tensor_split(torch.arange(old_emb.shape[0]), [5, 9][: world - 1] if world > 1 else [])[rank]
    sums = ImprintSums(first, num_classes, emb.shape[1])
    sums.add(emb[mine], labels[mine])
    plain = imprint_rows(sums, None, calibrate=False)
    sums.add_old(old_emb[old], old_rows[old])
    return plain, imprint_rows(sums, None)


def _turned_reference(mu, x_all, kappa):
    """float64: k * mu + sqrt(1 - k^2) * (least-variance eigenvector, sign fixed, made orthogonal to mu)."""
    vecs = torch.linalg.eigh(x_all.t() @ x_all).eigenvectors
    v = vecs[:, 0] * vecs[vecs[:, 0].abs().argmax(), 0].sign()
    r = F.normalize(v - (v @ mu) * mu, dim=0)
    return kappa * mu + (1 - kappa**2) ** 0.5 * r


@pytest.mark.parametrize("world", [1, 2, 3])
def test_imprint_class_parallel_equals_float64_reference(pools, world):
    g = torch.Generator().manual_seed(5)
    first, num_classes, d = 10, 17, 4  # 7 new classes: uneven over 2 and 3 owners
    labels = torch.randint(0, num_classes, (40,), generator=g)
    labels[labels == 15] = 3  # class 15 has no sample: a zero row, count 0
    emb = torch.randn(40, d, generator=g) * torch.rand(40, 1, generator=g).add(0.5)
    old_emb, old_rows = torch.randn(12, d, generator=g), torch.randn(12, d, generator=g)  # old classes' samples
    args = (emb, labels, first, num_classes, old_emb, old_rows)
    results = pools(world).run(_imprint_dist, *args) if world > 1 else [_imprint_dist(0, 1, *args)]
    xn, on = F.normalize(emb.double(), dim=1), F.normalize(old_emb.double(), dim=1)
    new = labels >= first
    means = {c: F.normalize(xn[labels == c].mean(0), dim=0) for c in range(first, num_classes) if (labels == c).any()}
    a_new = torch.stack([xn[i] @ means[int(labels[i])] for i in range(40) if new[i]]).mean().item()
    a_old = (on * F.normalize(old_rows.double(), dim=1)).sum(1).mean().item()
    kappa = min(1.0, a_old / a_new)
    assert kappa < 1.0  # random old rows: the calibration turns the rows
    x_all = torch.cat([xn[new], on])
    for rank, ((start, rows, counts, _), (start2, rows2, counts2, info)) in enumerate(results):
        off, n = new_class_range(num_classes - first, world, rank)
        assert start == start2 == first + off and rows.shape == rows2.shape == (n, d)
        assert info["kappa"] == pytest.approx(kappa, rel=1e-12) and info["a_old"] == pytest.approx(a_old, rel=1e-12)
        for i in range(n):
            c = start + i
            assert counts[i].item() == counts2[i].item() == int((labels == c).sum())
            want = means.get(c, torch.zeros(d, dtype=torch.float64))
            assert torch.allclose(rows[i], want, rtol=0, atol=1e-12), (c, rows[i], want)
            turned = _turned_reference(want, x_all, kappa) if c in means else want
            assert torch.allclose(rows2[i], turned, rtol=0, atol=1e-10), (c, rows2[i], turned)
            if c in means:  # a unit row turned by acos(kappa) away from the class mean
                assert rows2[i].norm().item() == pytest.approx(1.0, abs=1e-12)
                assert (rows2[i] @ want).item() == pytest.approx(kappa, abs=1e-12)
    assert sum(r[0][1].shape[0] for r in results) == num_classes - first


def _job_config(path, num_classes, steps):
    raw = {"train_micro_batch_size_per_gpu": 32, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "torch_adam": True}},
           "extreme_classification": {"num_classes": num_classes, "embedding_dim": 8, "sampler": {"type": "full"},
                                      "loss": {"type": "cosface", "scale": 16.0, "margin": 0.1}, "init_std": 0.01,
                                      "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9, "update": "dense"}},
           "xc_train": {"data": "synthetic", "max_steps": steps, "eval_every": 0, "eval_samples": 512,
                        "hidden_dim": 16, "eval_class_split": 24}}
    with open(path, "w") as fh:
        json.dump(raw, fh)
    return path


def _run(args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_imprint_from_the_command_line_and_resume(tmp_path):
    from ds_xc.data import SyntheticDataset
    from ds_xc.models import build_backbone
    stage1, stage2 = _job_config(tmp_path / "s1.json", 24, 6), _job_config(tmp_path / "s2.json", 30, 8)
    _run([os.path.join("launch", "train.py"), "--deepspeed_config", stage1, "--save_dir", str(tmp_path / "c1")])
    proc = _run([os.path.join("launch", "grow.py"), "--load_dir", str(tmp_path / "c1"), "--out_dir",
                 str(tmp_path / "c2"), "--deepspeed_config", stage2, "--imprint_samples", "3000",
                 "--imprint_calibration", "none"])
    assert "from 24 to 30 classes" in proc.stdout and "imprinted" in proc.stdout, proc.stdout
    old = ShardRows(str(tmp_path / "c1" / "step6"))
    grown = ShardRows(str(tmp_path / "c2" / "step6"))
    assert torch.equal(grown.rows(0, 24), old.rows(0, 24))
    assert torch.equal(grown.rows(0, 24, "momentum_buffer"), old.rows(0, 24, "momentum_buffer"))
    assert torch.equal(grown.rows(24, 6, "momentum_buffer"), torch.zeros(6, 8))
    # the float64 reference: the same 3000 samples, the saved backbone, class means of unit embeddings
    data = SyntheticDataset(30, seed=0)
    body = build_backbone(data, 8, hidden_dim=16)
    body.load_state_dict(load_file(str(tmp_path / "c1" / "step6" / "mp_rank_00_model_states.pt"))["module"])
    body.eval()
    xs, ys = zip(*[data.train_batch(k, 32, 0, 1) for k in range(-(-3000 // 32))])
    with torch.no_grad():
        emb = F.normalize(body(torch.cat(xs)).double(), dim=1)
    y = torch.cat(ys)
    scale = old.rows(0, 24).double().norm(dim=1).median()
    for c in range(24, 30):
        want = F.normalize(emb[y == c].mean(0), dim=0) * scale
        assert (y == c).sum() > 0
        assert torch.allclose(grown.rows(c, 1)[0].double(), want, rtol=0, atol=1e-6), c
    # class-parallel on 2 ranks (2 processes embed halves of the same 3,008 samples, 3 shards
    # written): the same rows bit for bit (float64 sums, one cast)
    run_ranks(["--load_dir", str(tmp_path / "c1"), "--out_dir", str(tmp_path / "c3"), "--deepspeed_config", stage2,
               "--imprint_samples", "3000", "--imprint_calibration", "none", "--world_size", "3"], world=2,
              script=os.path.join(ROOT, "launch", "grow.py"), timeout=240)
    three = ShardRows(str(tmp_path / "c3" / "step6"))
    assert three.world_size == 3 and torch.equal(three.rows(0, 30), grown.rows(0, 30))
    summary = tmp_path / "sum.json"
    _run([os.path.join("launch", "train.py"), "--deepspeed_config", stage2, "--save_dir", str(tmp_path / "c2"),
          "--resume", "--summary_json", str(summary)])
    result = json.loads(summary.read_text())
    assert result["steps"] == 2 and result["num_classes"] == 30
    assert {"top1_old", "top1_new", "samples_old", "samples_new"} <= set(result)
    assert result["samples_old"] + result["samples_new"] == result["eval_samples"]


def _expect_exit(argv, *words):
    with pytest.raises(SystemExit) as exc:
        grow_tool.main(argv)
    for word in words:
        assert word in str(exc.value), (word, str(exc.value))


def test_bad_requests_name_the_value(pools, tmp_path):
    src = str(tmp_path / "p2")
    saved = pools(2).run(_train_and_save, "sgd-dense", src, 1)
    cfg = {}
    for name, classes, dim in (("same", C, D), ("fewer", 20, D), ("dim", C2, D + 1), ("ok", C2, D)):
        raw = _config("sgd-dense", classes)
        raw["extreme_classification"]["embedding_dim"] = dim
        cfg[name] = str(tmp_path / f"{name}.json")
        with open(cfg[name], "w") as fh:
            json.dump(raw, fh)
    base = ["--load_dir", src, "--init", "random"]
    _expect_exit(base + ["--out_dir", str(tmp_path / "o1"), "--deepspeed_config", cfg["same"]], "num_classes 23",
                 "nothing to grow")
    _expect_exit(base + ["--out_dir", str(tmp_path / "o2"), "--deepspeed_config", cfg["fewer"]], "num_classes 20",
                 "--retire")
    _expect_exit(base + ["--out_dir", str(tmp_path / "o3"), "--deepspeed_config", cfg["dim"]], "embedding_dim 7",
                 "checkpoint's 6")
    _expect_exit(base + ["--out_dir", src, "--deepspeed_config", cfg["ok"]], "--out_dir")
    _expect_exit(["--load_dir", str(tmp_path / "none"), "--out_dir", str(tmp_path / "o4"), "--init", "random",
                  "--deepspeed_config", cfg["ok"]], "latest")
    assert not any(os.path.exists(tmp_path / f"o{i}") for i in range(1, 5))  # nothing written
    # retiring falls out of the same file work: the first 20 classes and their state, bit for bit
    grow_tool.main(base + ["--out_dir", str(tmp_path / "r"), "--deepspeed_config", cfg["fewer"], "--retire"])
    rows = ShardRows(str(tmp_path / "r" / "step1"))
    assert rows.num_classes == 20 and torch.equal(rows.rows(0, 20), _merged(saved)[:20])
    assert torch.equal(rows.rows(0, 20, "momentum_buffer"), _merged(saved, "momentum_buffer")[:20])
    os.remove(os.path.join(src, "step1", "mp_rank_00_model_states.pt"))
    _expect_exit(base + ["--out_dir", str(tmp_path / "o5"), "--deepspeed_config", cfg["ok"]],
                 "mp_rank_00_model_states.pt")


def test_evaluate_topk_splits_old_and_new_classes():
    from ds_xc.evaluate import evaluate_topk
    from ds_xc.head import ClassParallelHead
    cfg = _config("sgd-dense", C2)["extreme_classification"]
    head = ClassParallelHead.from_config(cfg)  # one process, cosine scores (CosFace)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(60, D, generator=g), torch.randint(0, C2, (60,), generator=g)
    batches = [(x[:30], y[:30]), (x[30:], y[30:])]
    res = evaluate_topk(lambda t: t, head, batches, split=C)
    pred = (F.normalize(x.double(), dim=1) @ F.normalize(head.weight.detach().double(), dim=1).t()).argmax(1)
    hit, old = pred == y, y < C
    assert res["samples_old"] == int(old.sum()) and res["samples_new"] == int((~old).sum())
    assert res["top1_old"] == hit[old].double().mean().item() and res["top1_new"] == hit[~old].double().mean().item()
    assert res["top1"] == hit.double().mean().item()
    assert "top1_old" not in evaluate_topk(lambda t: t, head, batches)
