"""Config validation: every kind of error names the key path, the value and what is allowed."""
import json

import pytest

import ds_xc
from ds_xc import ClassParallelHead, ConfigError, parse_config
from ds_xc.config import HeadConfig

BASE = {"num_classes": 100, "embedding_dim": 8}


def _err(section: dict, key="extreme_classification") -> str:
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 8, key: section})
    return str(info.value)


def test_valid_config_keeps_defaults_and_ignores_deepspeed_keys():
    c = parse_config({"train_batch_size": 8, "zero_optimization": {"stage": 1},
                      "extreme_classification": dict(BASE, loss={"type": "arcface"})})
    head = c.extreme_classification
    assert head.loss.type == "arcface" and head.loss.margin == 0.5 and head.loss.scale == 64.0
    assert head.sampler.type == "full" and head.chunk_size == 0 and head.optimizer.type == "sgd"
    assert c.xc_train.data == "text"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_out_of_range_names_path_value_and_bound():
    msg = _err(dict(BASE, sampler={"type": "uniform", "sample_rate": 1.5}))
    assert "extreme_classification.sampler.sample_rate" in msg and "1.5" in msg and "less than or equal to 1" in msg


def test_zero_sample_rate_rejected():
    msg = _err(dict(BASE, sampler={"type": "uniform", "sample_rate": 0}))
    assert "extreme_classification.sampler.sample_rate" in msg and "greater than 0" in msg


def test_unknown_key_is_rejected():
    msg = _err(dict(BASE, chunksize=4))
    assert "extreme_classification.chunksize" in msg and "unknown key" in msg


def test_key_of_another_loss_is_rejected():
    msg = _err(dict(BASE, loss={"type": "softmax", "margin": 0.3}))
    assert "extreme_classification.loss.margin" in msg and "unknown key" in msg


def test_unknown_sampler_lists_allowed_types():
    msg = _err(dict(BASE, sampler={"type": "magic"}))
    assert "extreme_classification.sampler.type" in msg and "'magic'" in msg and "'uniform'" in msg


def test_missing_type_tag():
    msg = _err(dict(BASE, loss={"scale": 3.0}))
    assert "extreme_classification.loss.type" in msg and "missing" in msg


def test_missing_required_key():
    msg = _err({"embedding_dim": 8})
    assert "extreme_classification.num_classes: required key is missing" in msg


def test_wrong_type():
    msg = _err(dict(BASE, embedding_dim="wide"))
    assert "extreme_classification.embedding_dim" in msg and "'wide'" in msg and "integer" in msg


def test_bad_literal_lists_choices():
    msg = _err(dict(BASE, dtype="float16"))
    assert "extreme_classification.dtype" in msg and "'float16'" in msg and "'bfloat16'" in msg


def test_cross_field_rule():
    msg = _err(dict(BASE, optimizer={"nesterov": True, "momentum": 0.0}))
    assert "extreme_classification.optimizer" in msg and "nesterov" in msg


def test_betas_bounds():
    msg = _err(dict(BASE, optimizer={"type": "adamw", "betas": [0.9, 1.0]}))
    assert "betas[1]=1.0" in msg


def test_several_errors_reported_together():
    msg = _err({"num_classes": 1, "embedding_dim": 0})
    assert "num_classes" in msg and "embedding_dim" in msg


def test_section_must_be_an_object():
    msg = _err([1, 2])
    assert "extreme_classification: expected a JSON object" in msg


def test_train_section_validated():
    msg = _err({"data": "imagenet"}, key="xc_train")
    assert "xc_train.data" in msg and "'imagenet'" in msg


def test_path_and_hjson(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{\n // a comment, as DeepSpeed allows\n "extreme_classification": ' + json.dumps(BASE) + "\n}")
    assert parse_config(str(p)).extreme_classification.num_classes == 100


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ConfigError, match="bad.json"):
        parse_config(str(bad))
    empty = tmp_path / "empty.json"  # hjson would read "" as {}: refused as empty, not as "no section"
    empty.write_text(" \n")
    with pytest.raises(ConfigError, match="empty.json' is empty"):
        parse_config(str(empty))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a JSON list"):
        parse_config(str(listed))
    listed.write_text("[\n // hjson: a comment, then a list of pairs\n [1, 2]\n]")
    with pytest.raises(ConfigError, match="holds a JSON list"):
        parse_config(str(listed))


def test_from_config_accepts_dict_and_model():
    a = ClassParallelHead.from_config(dict(BASE, loss={"type": "cosface", "margin": 0.4}))
    b = ClassParallelHead.from_config(HeadConfig(**BASE))
    assert a.loss_fn.margin == 0.4 and a.weight.shape == (100, 8)
    assert b.weight.shape == (100, 8)
    with pytest.raises(ConfigError, match="extreme_classification.sampler.sample_rate"):
        ClassParallelHead.from_config(dict(BASE, sampler={"type": "uniform", "sample_rate": -1}))


def test_head_arguments_validated_like_config():
    with pytest.raises(ConfigError, match="extreme_classification.loss.type"):
        ClassParallelHead(8, 10, loss="arcfase")
    with pytest.raises(ConfigError, match="extreme_classification.optimizer.update"):
        ClassParallelHead(8, 10, update="sparse")


def test_public_api():
    for name in ("ClassParallelHead", "parse_config", "ConfigError", "initialize"):
        assert hasattr(ds_xc, name)


def test_config_reference_page_is_up_to_date():
    import subprocess
    import sys
    root = __file__.rsplit("/tests/", 1)[0]
    proc = subprocess.run([sys.executable, f"{root}/launch/config_docs.py", "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
