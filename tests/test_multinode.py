"""A real multi-node launch on one machine: 2 "hosts" (network namespaces behind a switch,
benchmarks/netns_hosts.sh) x 2 ranks each, launch/train.py under the DeepSpeed launcher's
no-ssh multi-node mode (and a resume under torchrun --nnodes 2).

* The 2x2 run's training loss and held-out top-1 equal the 4-rank single-host run with the
  same seeds (float tolerance: across hosts the backbone is reduced hierarchically, on one
  host flat, so only the order of the additions differs).
  The head's row exchange runs in its two rank-aligned stages there (topology.head_collectives auto).
* Resume across hosts is bitwise: the 2x2 run's step-4 checkpoint (save_every 2) resumed to 6
  (under torchrun), and every weight of the step-6 checkpoint equals the uninterrupted 2x2 run's.
* A checkpoint folder that is not shared (host 1 sees its own empty tmpfs at the same path)
  is refused on every rank with an error naming the folder and the fix.
* One NIC per rank (netns_hosts.sh -n 2, each rank moved into its namespace by
  benchmarks/rank_netns.sh under `deepspeed --no_python`): the job trains on 2 nodes x 2, and
  every rank's NIC carries its share of the traffic (hierarchical: each local rank's
  rank-aligned flow leaves through its own NIC).

The runs set topology.probe_repeats=0 (auto without its timing probe: hierarchical on 2 nodes),
so that the mode, and with it the bits, do not depend on the machine's load.

Skipped where namespaces cannot be made (not root, no iproute2, no permission).
"""
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from tests.dist_pool import free_port
from tests.train_procs import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
HOSTS_SH = os.path.join(ROOT, "benchmarks", "netns_hosts.sh")
TRAIN = os.path.join(ROOT, "launch", "train.py")


def _namespaces_reason():
    """None when this process can create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (the ip command)"
    name = f"dxprobe{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"cannot create a network namespace here: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


REASON = _namespaces_reason()
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def _config(tmp_path):
    cfg = {
        "train_micro_batch_size_per_gpu": 32, "gradient_clipping": 0.0, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "torch_adam": True}},
        "extreme_classification": {"num_classes": 301, "embedding_dim": 32, "chunk_size": 16,
                                   "loss": {"type": "cosface", "scale": 30.0}, "topology": {"probe_repeats": 0}},
        "xc_train": {"data": "synthetic", "max_steps": 6, "eval_every": 0, "eval_samples": 256,
                     "log_every": 2, "hidden_dim": 64},
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                     if p]))


def _run(cmd, ok=True, timeout=400):
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, out[-5000:]
    return out


def _deepspeed_hosts(tmp_path, args, wrap=()):
    """launch/train.py on 2 hosts x 2 ranks through `deepspeed --hostfile --no_ssh --node_rank`."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("host0 slots=2\nhost1 slots=2\n")
    cmd = [os.path.join(BIN, "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "{node}",
           "--master_addr", "{master}", "--master_port", str(free_port()), TRAIN] + args
    return [HOSTS_SH, "-H", "2", "--"] + list(wrap) + cmd


def _torchrun_hosts(args):
    cmd = [os.path.join(BIN, "torchrun"), "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", "{node}",
           "--master_addr", "{master}", "--master_port", str(free_port()), TRAIN] + args
    return [HOSTS_SH, "-H", "2", "--"] + cmd


def _summary(path):
    with open(path) as fh:
        return json.load(fh)


def _flatten(prefix, obj, out):
    import torch
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}", v, out)
    return out


def _weights(tag_dir):
    """Every tensor of a checkpoint: the backbone (DeepSpeed's model states: weights and optimizer moments)
    and each rank's head shard (weights and optimizer state)."""
    import torch
    states = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), weights_only=False)
    out = _flatten("module", states["module"], {})
    _flatten("optimizer", states.get("optimizer"), out)  # ZeRO 0: the optimizer state is in the model file
    head_dir = os.path.join(tag_dir, "ds_xc_head")
    for name in sorted(os.listdir(head_dir)):
        if name.startswith("shard_"):
            _flatten(name, torch.load(os.path.join(head_dir, name), weights_only=True), out)
    return out


def test_two_hosts_equal_one_host_and_resume_bitwise(tmp_path):
    import torch
    cfg = _config(tmp_path)
    one, two, parts = (str(tmp_path / n) for n in ("one_host", "two_hosts", "resumed"))
    # the one-host reference: 4 local ranks started directly (the launcher is what the 2x2 runs test)
    run_ranks(["--deepspeed_config", cfg, "--save_dir", one, "--summary_json", one + ".json"], world=4,
              timeout=400, env={"PYTHONPATH": _env()["PYTHONPATH"]})
    out = _run(_deepspeed_hosts(tmp_path, ["--deepspeed_config", cfg, "--save_dir", two, "--summary_json",
                                           two + ".json", "--verbose", "--set", "xc_train.save_every=2"]))
    assert "2 node(s) x 2 rank(s)" in out and "hierarchical reduction" in out  # the layout came from the launcher
    assert "the head's row exchange runs in two rank-aligned stages" in out  # head_collectives auto follows
    ref, got = _summary(one + ".json"), _summary(two + ".json")
    assert ref["world_size"] == got["world_size"] == 4 and got["steps"] == 6
    assert got["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4, abs=1e-5)
    assert abs(got["top1"] - ref["top1"]) <= 1 / 256 and abs(got["top5"] - ref["top5"]) <= 1 / 256
    a, b = _weights(os.path.join(one, "step6")), _weights(os.path.join(two, "step6"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)

    # the step-4 checkpoint the 2x2 run wrote on its way (save_every 2), alone in a folder: resumed to step 6
    os.makedirs(parts)
    shutil.copytree(os.path.join(two, "step4"), os.path.join(parts, "step4"))
    with open(os.path.join(parts, "latest"), "w") as fh:
        fh.write("step4")
    out = _run(_torchrun_hosts(["--deepspeed_config", cfg, "--save_dir", parts, "--resume", "--summary_json",
                                parts + ".json"]))
    assert "at step 4" in out
    resumed = _summary(parts + ".json")
    assert resumed["steps"] == 2 and resumed["final_loss"] == got["final_loss"] and resumed["top1"] == got["top1"]
    full, cont = _weights(os.path.join(two, "step6")), _weights(os.path.join(parts, "step6"))
    assert full.keys() == cont.keys() and len(full) > 4
    for k in full:
        assert torch.equal(cont[k], full[k]), k


def test_checkpoint_folder_not_shared_is_refused(tmp_path):
    cfg = _config(tmp_path)
    save = f"/tmp/dsxc_unshared_{uuid.uuid4().hex[:8]}"
    os.makedirs(save)
    try:  # host 1 mounts its own empty tmpfs at the same path: a node-local folder
        wrap = ["sh", "-c", f'if [ "$NODE_RANK" = 1 ]; then exec unshare -m sh -c \'mount -t tmpfs none {save} '
                '&& exec "$@"\' sh "$@"; else exec "$@"; fi', "sh"]
        out = _run(_deepspeed_hosts(tmp_path, ["--deepspeed_config", cfg, "--save_dir", save, "--max_steps", "1"],
                                    wrap), ok=False)
    finally:
        shutil.rmtree(save, ignore_errors=True)
    assert f"the checkpoint folder '{save}' is not shared by all ranks" in out, out[-4000:]
    assert "filesystem every node mounts" in out


def test_one_nic_per_rank(tmp_path):
    cfg = _config(tmp_path)
    counters, summary = tmp_path / "nics.json", str(tmp_path / "nic.json")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("host0 slots=2\nhost1 slots=2\n")
    cmd = [HOSTS_SH, "-H", "2", "-n", "2", "-c", str(counters), "--", os.path.join(BIN, "deepspeed"), "--hostfile",
           str(hostfile), "--no_ssh", "--node_rank", "{node}", "--master_addr", "{master}", "--master_port",
           str(free_port()), "--no_python", "--no_local_rank", os.path.join(ROOT, "benchmarks", "rank_netns.sh"),
           sys.executable, TRAIN, "--deepspeed_config", cfg, "--max_steps", "3", "--summary_json", summary,
           "--verbose"]
    out = _run(cmd)
    assert "2 node(s) x 2 rank(s)" in out and "hierarchical reduction" in out
    got = _summary(summary)
    assert got["world_size"] == 4 and got["steps"] == 3 and got["final_loss"] == got["final_loss"]  # not NaN
    nics = json.loads(counters.read_text())
    assert nics["nics"] == 2 and len(nics["nic_tx_bytes"]) == 2
    for host in nics["nic_tx_bytes"]:  # both local ranks' NICs carried real traffic, not one NIC for the host
        assert len(host) == 2 and min(host) > 0.2 * max(host) and min(host) > 100_000, nics
