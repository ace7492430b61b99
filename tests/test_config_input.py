"""What a user's config and launch environment meet before anything starts (issue 59, the smaller ones).

* A key that appears twice in one JSON object, at any depth (top level, a section, an object in a
  list), in a JSON or hjson file or a ``--set`` value: a ConfigError naming each duplicated key's
  path, where the json module kept the last value silently.
* A top-level key that nearly spells a ds_xc section ("extreme_clasification", "xc-train"): "did you
  mean extreme_classification?" from parse_config, check_supported and launch/train.py's config,
  where it used to report ``num_classes`` missing; DeepSpeed's own keys are never taken for one.
* ``RANK`` set without ``MASTER_ADDR`` / ``MASTER_PORT`` (or another launcher variable): an error
  naming the missing variables and what to set, before DeepSpeed asks mpi4py for them.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import ds_xc
from ds_xc import ConfigError, parse_config
from ds_xc.engine import LaunchEnvError, check_launch_env, check_supported, init_distributed, load_raw_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD = '{"num_classes": 100, "embedding_dim": 8}'


def _file(tmp_path, text, name="c.json"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,keys", [
    ('{"train_batch_size": 8, "train_batch_size": 16, "extreme_classification": ' + HEAD + '}',
     ["'train_batch_size'"]),
    ('{"extreme_classification": {"num_classes": 100, "embedding_dim": 8, "optimizer": {"lr": 0.1, "lr": 0.2}}}',
     ["'extreme_classification.optimizer.lr'"]),
    ('{"extreme_classification": ' + HEAD + ', "x": [1, {"a": 1, "b": {"c": 1, "c": 2}, "a": 3}]}',
     ["'x[1].b.c'", "'x[1].a'"]),
    ('{"extreme_classification": ' + HEAD + ', "extreme_classification": {"num_classes": 5}}',
     ["'extreme_classification'"]),
])
def test_duplicate_keys_at_any_depth_are_refused(tmp_path, text, keys):
    path = _file(tmp_path, text)
    for load in (parse_config, load_raw_config):
        with pytest.raises(ConfigError) as info:
            load(path)
        msg = str(info.value)
        assert f"config file {path!r}: duplicate key" in msg and "keep one" in msg, msg
        for key in keys:
            assert key in msg, msg
    assert json.loads(text)  # what the json module made of it: the last value, silently


def test_duplicate_keys_in_hjson_are_refused_and_clean_files_load_as_before(tmp_path):
    hjson_text = '{\n  # comment\n  extreme_classification: {num_classes: 100, embedding_dim: 8, num_classes: 7}\n}'
    with pytest.raises(ConfigError, match=r"duplicate key 'extreme_classification.num_classes'"):
        parse_config(_file(tmp_path, hjson_text, "c.hjson"))
    clean = '{"train_batch_size": 8, "extreme_classification": {"num_classes": 100, "embedding_dim": 8}, ' \
            '"l": [{"a": 1}, {"a": 2}], "n": {"a": {"a": 1}}}'
    assert load_raw_config(_file(tmp_path, clean)) == json.loads(clean)  # the same key in different objects is fine
    assert parse_config(_file(tmp_path, clean)).extreme_classification.num_classes == 100


def _launch_train():
    name = "ds_xc_launch_train_cfg"
    if name not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "launch", "train.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_launch_refuses_duplicates_and_suggests_the_section(tmp_path):
    train = _launch_train()
    raw = {"extreme_classification": {"num_classes": 10}}
    with pytest.raises(SystemExit, match=r"--set extreme_classification.loss: duplicate key 'type'"):
        train.apply_override(raw, 'extreme_classification.loss={"type": "arcface", "type": "cosface"}')
    train.apply_override(raw, 'extreme_classification.loss={"type": "arcface", "margin": 0.3}')
    assert raw["extreme_classification"]["loss"] == {"type": "arcface", "margin": 0.3}
    path = _file(tmp_path, '{"train_batch_size": 8, "extreme_clasification": ' + HEAD + '}')
    args = train.parse_args(["--deepspeed_config", path])
    with pytest.raises(ConfigError, match="did you mean extreme_classification?") as info:
        ds_xc.parse_config(train.build_config(args))  # what launch/train.py's main does first
    assert "num_classes" not in str(info.value)


@pytest.mark.parametrize("key,meant", [("extreme_clasification", "extreme_classification"),
                                       ("Extreme_Classification", "extreme_classification"),
                                       ("xc-train", "xc_train"), ("xc_trian", "xc_train"),
                                       ("gradient_compresion", "gradient_compression"),
                                       ("adaptive-lr", "adaptive_lr")])
def test_a_misspelt_section_is_named_with_a_suggestion(key, meant):
    raw = {"train_batch_size": 8, key: json.loads(HEAD)}
    for check in (parse_config, check_supported):
        with pytest.raises(ConfigError) as info:
            check(raw)
        msg = str(info.value)
        assert f"top-level section {key!r} is not a ds_xc section: did you mean {meant}?" in msg, msg
    # with the real section present too (launch/train.py adds an empty one), the misspelling still wins
    with pytest.raises(ConfigError, match=f"did you mean {meant}"):
        parse_config(dict(raw, extreme_classification={}))


def test_deepspeed_keys_are_not_taken_for_misspelt_sections():
    """Every top-level key DeepSpeed's config constants name passes (e.g. gradient_clipping, train_batch_size)."""
    import deepspeed.runtime.constants as ds_constants
    keys = {v for k, v in vars(ds_constants).items() if k.isupper() and isinstance(v, str) and v.isidentifier()}
    assert {"gradient_clipping", "train_batch_size", "gradient_accumulation_steps"} <= keys
    from ds_xc.config import check_section_names
    check_section_names({key: {} for key in keys | {"compression_training", "train", "optimizer", "scheduler"}})


def test_rank_without_master_addr_names_the_missing_variables(monkeypatch):
    assert not dist.is_initialized()
    for name in ("MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(LaunchEnvError) as info:
        init_distributed(timeout_s=5)  # the old code went on to DeepSpeed's MPI discovery: "No module named 'mpi4py'"
    assert isinstance(info.value, ConfigError) and isinstance(info.value, RuntimeError)
    msg = str(info.value)
    assert msg.startswith("RANK=1 is set but MASTER_ADDR, MASTER_PORT are not: ") and "MASTER_ADDR: the host" in msg
    assert "MASTER_PORT: a free port" in msg and "unset RANK" in msg
    assert not dist.is_initialized()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(LaunchEnvError, match=r"^RANK=1 is set but MASTER_PORT is not"):
        check_launch_env()
    check_launch_env({"RANK": "0", "OMPI_COMM_WORLD_RANK": "0"})  # under mpirun DeepSpeed's discovery runs
    check_launch_env({})  # no RANK: one process, ds_xc fills the variables in
    check_launch_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_launch_with_rank_but_no_master_addr_says_what_to_set():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
    env.update(RANK="0", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--max_steps", "1"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "RANK=0 is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not" in out.stderr, out.stderr[-3000:]
    assert "mpi4py" not in out.stderr
