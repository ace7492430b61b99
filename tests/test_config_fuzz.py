"""Config fuzzing (hypothesis): every invalid ``extreme_classification``, ``xc_train`` or
``gradient_compression`` section is rejected by ``ds_xc.parse_config`` with a ConfigError
naming the key path (never another exception, never a chained traceback), and valid
ones are accepted.

The cases come from the pydantic models themselves: each field's type, bounds
(ge/gt/le/lt, multiple_of) and allowed literals give values that must fail (out of
bounds, wrong types, unknown keys, unknown variant tags, non-object sections) and values
that must pass (inside the bounds; the few cross-field rules are then satisfied).
1,300 cases, about 10 s.
"""
import math
import typing

import annotated_types as at
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import ds_xc
from ds_xc import config as cfg
from ds_xc.compression.config import GradientCompressionConfig

SECTIONS = {cfg.HEAD_SECTION: cfg.HeadConfig, cfg.TRAIN_SECTION: cfg.TrainConfig,
            cfg.COMPRESSION_SECTION: GradientCompressionConfig}
LOSSES = [get.model_fields["type"].annotation.__args__[0] for get in typing.get_args(cfg.HeadConfig.model_fields["loss"].annotation)]
SAMPLERS = [get.model_fields["type"].annotation.__args__[0]
            for get in typing.get_args(cfg.HeadConfig.model_fields["sampler"].annotation)]


def fuzz(n: int):
    """n generated cases, reproducible (derandomized), no deadline (CI machines are shared)."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

junk_text = st.from_regex(r"x_[a-z]{1,8}", fullmatch=True)  # never a number, bool word or allowed literal


def _variants(annotation) -> dict:
    """{type tag: model} of a discriminated union annotation; {} otherwise."""
    if typing.get_origin(annotation) is not typing.Union:
        return {}
    return {m.model_fields["type"].annotation.__args__[0]: m for m in typing.get_args(annotation)
            if isinstance(m, type) and issubclass(m, BaseModel)}


def _kind(field):
    ann = field.annotation
    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Union and len(args) == 2 and type(None) in args:
        ann = next(a for a in args if a is not type(None))  # Optional[X] (null = a default rule): fuzzed as X
    if _variants(ann):
        return "union"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "model"
    if typing.get_origin(ann) is typing.Literal:
        return "literal"
    if typing.get_origin(ann) is tuple:
        return "tuple"
    return {bool: "bool", int: "int", float: "float"}[ann]


def _bounds(field):
    lo = hi = None
    lo_open = hi_open = False
    mult = None
    for m in field.metadata:
        if isinstance(m, at.Ge):
            lo = m.ge
        elif isinstance(m, at.Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, at.Le):
            hi = m.le
        elif isinstance(m, at.Lt):
            hi, hi_open = m.lt, True
        elif isinstance(m, at.MultipleOf):
            mult = m.multiple_of
    return lo, lo_open, hi, hi_open, mult


def _base(data) -> dict:
    """A valid config with all three sections; the head with a drawn loss and sampler."""
    return {cfg.HEAD_SECTION: {"num_classes": 1000, "embedding_dim": 64,
                               "loss": {"type": data.draw(st.sampled_from(LOSSES))},
                               "sampler": {"type": data.draw(st.sampled_from(SAMPLERS))}},
            cfg.TRAIN_SECTION: {}, cfg.COMPRESSION_SECTION: {}}


def _node(data, raw):
    """Draw a (path, model, dict) node of a config: a section or a nested object of it."""
    section = data.draw(st.sampled_from(sorted(SECTIONS)))
    path, model, node = [section], SECTIONS[section], raw[section]
    while True:
        nested = [(n, f) for n, f in model.model_fields.items() if _kind(f) in ("model", "union")]
        if not nested or not data.draw(st.booleans()):
            return path, model, node
        name, field = data.draw(st.sampled_from(nested))
        if _kind(field) == "union":
            sub = node.setdefault(name, {"type": data.draw(st.sampled_from(sorted(_variants(field.annotation))))})
            model = _variants(field.annotation)[sub["type"]]
        else:
            sub = node.setdefault(name, {})
            model = field.annotation
        path, node = path + [name], sub


# ---------------------------------------------------------------------- invalid values
def _invalid(data, field):
    kind = _kind(field)
    nullable = type(None) in typing.get_args(field.annotation)  # Optional[X]: null is valid
    wrong_type = [junk_text, st.just([1]), st.just({"a": 1})] + ([] if nullable else [st.none()])
    if kind in ("int", "float"):
        lo, lo_open, hi, hi_open, mult = _bounds(field)
        options = list(wrong_type)
        step = 1 if kind == "int" else 1e-3
        if lo is not None:
            options.append(st.just(lo if lo_open else lo - step))
            options.append(st.integers(-10**6, -1).map(lambda k, lo=lo: lo + k * (abs(lo) + 1)))
        if hi is not None:
            options.append(st.just(hi if hi_open else hi + step))
            options.append(st.integers(1, 10**6).map(lambda k, hi=hi: hi + k * (abs(hi) + 1)))
        if kind == "int":
            options.append(st.just(2.5))
        elif lo is not None or hi is not None:
            options += [st.just(math.nan), st.just(math.inf if hi is not None else -math.inf)]
        if mult and lo is not None:
            options.append(st.just(lo + 1))
        return data.draw(st.one_of(options))
    if kind == "bool":
        return data.draw(st.one_of(wrong_type + [st.just(2), st.just(-1)]))
    if kind == "literal":
        return data.draw(st.one_of([junk_text, st.just(7), st.none(), st.just([])]))
    if kind == "tuple":
        return data.draw(st.one_of([junk_text, st.just([0.5]), st.just([0.5, 0.5, 0.5]), st.just(["x_a", 0.5]),
                                    st.just([0.5, 1.5]), st.just([-0.1, 0.5]), st.just({"a": 1}), st.none()]))
    return data.draw(st.one_of([st.just(5), junk_text, st.just([1]), st.none()]
                               + ([st.just({})] if kind == "union" else [])))


def _rejects(raw, expect_path: str) -> str:
    try:
        ds_xc.parse_config(raw)
    except Exception as exc:  # noqa: BLE001 - the test is that it is a ConfigError
        assert isinstance(exc, cfg.ConfigError), f"{type(exc).__name__}: {exc}"
        assert exc.__cause__ is None and (exc.__suppress_context__ or exc.__context__ is None), \
            "a chained traceback"
        assert expect_path in str(exc), f"{expect_path!r} not named in: {exc}"
        return str(exc)
    raise AssertionError(f"accepted an invalid config: {expect_path}")


@fuzz(700)
@given(st.data())
def test_invalid_values_are_rejected_naming_the_key_path(data):
    raw = _base(data)
    path, model, node = _node(data, raw)
    name = data.draw(st.sampled_from(sorted(model.model_fields)))
    node[name] = _invalid(data, model.model_fields[name])
    _rejects(raw, ".".join(path + [name]))


@fuzz(250)
@given(st.data(), st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True))
def test_unknown_keys_are_rejected_naming_the_key_path(data, key):
    raw = _base(data)
    path, model, node = _node(data, raw)
    if key in model.model_fields:
        key = key + "_unknown"
    node[key] = data.draw(st.one_of(st.integers(), junk_text, st.none()))
    msg = _rejects(raw, ".".join(path + [key]))
    assert "unknown key" in msg


@fuzz(100)
@given(st.data(), st.one_of(st.integers(), junk_text, st.lists(st.integers(), max_size=2), st.none(),
                            st.floats(allow_nan=False)))
def test_sections_that_are_not_objects_are_rejected(data, value):
    raw = _base(data)
    section = data.draw(st.sampled_from(sorted(SECTIONS)))
    raw[section] = value
    msg = _rejects(raw, section)
    assert "expected a JSON object" in msg or "invalid ds_xc config" in msg


# ---------------------------------------------------------------------- valid values
def _valid(data, field):
    kind = _kind(field)
    if kind == "bool":
        return data.draw(st.booleans())
    if kind == "literal":
        return data.draw(st.sampled_from(typing.get_args(field.annotation)))
    if kind == "tuple":
        return data.draw(st.lists(st.floats(0.0, 0.999), min_size=2, max_size=2))
    lo, lo_open, hi, hi_open, mult = _bounds(field)
    if kind == "int":
        a = (lo + 1 if lo_open else lo) if lo is not None else -10**6
        b = (hi - 1 if hi_open else hi) if hi is not None else a + 10**6
        value = data.draw(st.integers(a, min(b, a + 10**9)))
        return value - value % mult if mult and value - value % mult >= a else value
    a = lo if lo is not None else -1e6
    b = hi if hi is not None else a + 1e6
    value = data.draw(st.floats(a, b, exclude_min=lo_open, exclude_max=hi_open, allow_nan=False))
    return value


def _satisfy_cross_field_rules(raw):
    head, train, comp = raw[cfg.HEAD_SECTION], raw[cfg.TRAIN_SECTION], raw[cfg.COMPRESSION_SECTION]
    s = head.get("sampler", {})
    if s.get("type") == "ann" and s.get("rerank", 256) and s.get("rerank", 256) < s.get("top_k", 64):
        s["rerank"] = 0
    o = head.get("optimizer", {})
    if o.get("nesterov") and o.get("momentum", 0.9) == 0.0:
        o["momentum"] = 0.5
    if comp.get("momentum_correction", 0.0) > 0.0:
        comp["error_feedback"] = True
    if comp.get("adam_variance") == "frozen" and (comp.get("warmup_steps") == 0 or not comp.get("error_feedback", True)
                                                  or comp.get("method") in ("none", "powersgd")):
        comp["adam_variance"] = "auto"  # frozen needs a warm-up and an element-selecting method with feedback
    if comp.get("density_warmup_steps") and comp.get("density_warmup_start", 0.25) < comp.get("density", 0.01):
        comp["density_warmup_start"] = comp.get("density", 0.01)  # the warm-up starts at or above the density
    loss = head.get("loss")
    if isinstance(loss, dict):
        if loss.get("type", "softmax") != "softmax":
            loss["softcap"] = 0.0  # margin losses' logits are bounded already: softcap is the softmax loss's
        if s.get("type", "full") != "full":
            loss["label_smoothing"] = loss["z_loss"] = 0.0  # over all C classes: not on a sampled head
        if isinstance(head.get("overlap"), dict) and head["overlap"].get("enabled"):
            loss["reduction"] = "mean"  # the overlap pipeline needs the batch's loss
    if head.get("input_parallel") == "replicated" and isinstance(head.get("overlap"), dict):
        head["overlap"]["enabled"] = False  # the overlap pipeline hides input_parallel data's gathers
    for name, least in (("text", 1_000), ("corpus", 10_000)):
        size = train.get(f"{name}_vocab_size", 0)
        if size and (size < least or train.get(f"{name}_mode", "word") == "word"):
            train[f"{name}_vocab_size"] = 0


@fuzz(300)
@given(st.data())
def test_valid_values_are_accepted(data):
    raw = _base(data)
    for _ in range(data.draw(st.integers(1, 4))):
        path, model, node = _node(data, raw)
        fields = [n for n, f in model.model_fields.items() if _kind(f) not in ("model", "union") and n != "type"]
        if fields:
            name = data.draw(st.sampled_from(fields))
            node[name] = _valid(data, model.model_fields[name])
    _satisfy_cross_field_rules(raw)
    parsed = ds_xc.parse_config(raw)
    assert parsed.extreme_classification.num_classes == raw[cfg.HEAD_SECTION]["num_classes"]


def test_the_fuzzer_covers_every_field():
    """Every leaf field's kind is one the generators know (a new kind must be taught to them)."""
    seen = []

    def walk(model):
        for name, field in model.model_fields.items():
            kind = _kind(field)
            seen.append(kind)
            if kind == "model":
                walk(field.annotation)
            elif kind == "union":
                for m in _variants(field.annotation).values():
                    walk(m)
    for model in SECTIONS.values():
        walk(model)
    assert len(seen) > 80 and {"int", "float", "bool", "literal", "tuple", "model", "union"} <= set(seen)


@pytest.mark.parametrize("raw,match", [([], "JSON object"), (5, "JSON object"), ("x_config", "does not exist")])
def test_a_config_that_is_not_an_object_is_rejected(raw, match):
    with pytest.raises(cfg.ConfigError, match=match):
        ds_xc.parse_config(raw)


# ---------------------------------------------------------------------- sections across the config
_JUNK_SECTION = st.one_of(st.just(5), junk_text, st.just([1]), st.just(2.5))
METHODS = list(typing.get_args(GradientCompressionConfig.model_fields["method"].annotation))


def _maybe(data, name, strategy):
    return data.draw(st.one_of(st.just(("absent", None)), strategy.map(lambda v: (name, v))))


@fuzz(300)
@given(st.data())
def test_cross_section_rules_are_checked_at_start_naming_the_keys(data):
    """``check_supported`` + ``parse_config`` (what ds_xc.initialize runs before building anything) on
    drawn fp16 / bf16 / zero_optimization / gradient_compression / overlap settings: a config that
    breaks a rule raises ConfigError naming one of the broken keys; one that breaks none passes."""
    from ds_xc.engine import check_supported
    raw, broken = {}, []
    for name in ("fp16", "bf16"):
        how = data.draw(st.sampled_from(["absent", "off", "on", "junk"]))
        if how != "absent":
            raw[name] = data.draw(_JUNK_SECTION) if how == "junk" else {"enabled": how == "on"}
        if how == "junk":
            broken.append(name)
    if raw.get("fp16") == {"enabled": True}:
        broken.append("fp16.enabled")
    stage = data.draw(st.one_of(st.sampled_from([0, 1, 2, 3, None, True, 1.0, "x_a"]), st.just("absent")))
    if stage != "absent":
        raw["zero_optimization"] = {"stage": stage} if data.draw(st.booleans()) else data.draw(_JUNK_SECTION)
        if not isinstance(raw["zero_optimization"], dict):
            broken.append("zero_optimization")
        elif type(stage) is not int or stage not in (0, 1, 2):
            broken.append("zero_optimization.stage")
    zstage = stage if type(stage) is int else 0
    if data.draw(st.booleans()):
        method = data.draw(st.sampled_from(METHODS))
        raw[cfg.COMPRESSION_SECTION] = {"method": method}
        bf16_on = isinstance(raw.get("bf16"), dict) and raw["bf16"].get("enabled") is True
        if method != "none" and zstage >= 2:
            broken.append("zero_optimization.stage")
        elif method != "none" and zstage == 1 and bf16_on:  # ZeRO-1 takes compression with fp32 only
            broken.append("bf16.enabled")
    head = {"num_classes": 100, "embedding_dim": 8}
    if data.draw(st.booleans()):
        ov = {k: data.draw(st.booleans()) for k in ("enabled", "chunk_backbone", "overlap_grad_reduce")}
        head["overlap"] = ov
        bf16 = isinstance(raw.get("bf16"), dict) and raw["bf16"]["enabled"]
        for key in ("chunk_backbone", "overlap_grad_reduce"):
            if ov["enabled"] and ov[key] and (zstage != 0 or bf16):
                broken.append(f"{cfg.HEAD_SECTION}.overlap.{key}")
    how = data.draw(st.sampled_from(["present", "present", "absent", "junk"]))
    if how != "absent":
        raw[cfg.HEAD_SECTION] = head if how == "present" else data.draw(_JUNK_SECTION)
    broken += [cfg.HEAD_SECTION] if how != "present" else []
    try:
        check_supported(raw)
        ds_xc.parse_config(raw)
    except Exception as exc:  # noqa: BLE001 - the test is that it is a ConfigError
        assert isinstance(exc, cfg.ConfigError), f"{type(exc).__name__}: {exc} for {raw}"
        assert broken and any(key in str(exc) for key in broken), f"{exc} names none of {broken} ({raw})"
    else:
        assert not broken, f"accepted {raw} although {broken} break the rules"
