"""The ground floor of the configuration: section names, the section base model, ConfigError,
and turning pydantic's errors into messages that name the key path.

Both ds_xc/config.py (extreme_classification, xc_train) and ds_xc/config_compression.py
(gradient_compression) build on this module, so neither imports the other upwards.
"""
from __future__ import annotations

import json
import os
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["HEAD_SECTION", "TRAIN_SECTION", "COMPRESSION_SECTION", "ConfigError", "Section", "validation_error",
           "validate_section", "load_raw", "parse_json"]

HEAD_SECTION = "extreme_classification"
TRAIN_SECTION = "xc_train"
COMPRESSION_SECTION = "gradient_compression"  # validated by ds_xc.config_compression


class ConfigError(ValueError):
    """An invalid ds_xc configuration. The message names the key path, the value and what is allowed."""


class Section(BaseModel):
    """Base of every section model: unknown keys are refused, defaults validated too."""
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=False)


_TAGGED_UNIONS = {"loss", "sampler"}  # pydantic puts the tag into the error location; we drop it


def _format_loc(loc: tuple) -> str:
    parts: list[str] = []
    skip = False
    for item in loc:
        if skip:
            skip = False
            continue
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
            continue
        parts.append(str(item))
        skip = item in _TAGGED_UNIONS
    return ".".join(parts)


def _describe_error(err: dict, prefix: str) -> str:
    loc = err.get("loc", ())
    kind, msg = err.get("type", ""), err.get("msg", "")
    path = ".".join(p for p in (prefix, _format_loc(loc)) if p)
    if kind == "union_tag_invalid":
        # error location stops at the union field itself
        return f"{path}.type: {msg}"
    if kind == "extra_forbidden":
        return f"{path}: unknown key (value {err.get('input')!r}); remove it or check the spelling"
    if kind == "union_tag_not_found":
        allowed = err.get("ctx", {}).get("expected_tags", "")
        return f"{path}.type: required key is missing; expected one of {allowed}"
    if kind == "value_error":
        return f"{path}: {msg.removeprefix('Value error, ')}"
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind.startswith("literal_error"):
        return f"{path}: got {err.get('input')!r}; {msg.lower()}"
    return f"{path}: got {err.get('input')!r}; {msg}"


def validation_error(exc: ValidationError, prefix: str) -> ConfigError:
    """Turn a pydantic error into a ConfigError listing every problem with its key path."""
    lines = [_describe_error(e, prefix) for e in exc.errors()]
    return ConfigError("invalid ds_xc config:\n  " + "\n  ".join(lines))


def validate_section(model: type[BaseModel], value: Any, prefix: str) -> BaseModel:
    """Validate one section (a dict or an instance of ``model``), raising ConfigError."""
    if isinstance(value, model):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{prefix}: expected a JSON object (dict), got {type(value).__name__} {value!r}")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(exc, prefix) from None


class _Pairs(list):
    """One JSON object's (key, value) pairs in file order, as the parser met them (duplicates kept)."""


def _no_duplicates(value: Any, path: str, found: list) -> Any:
    """``value`` with every ``_Pairs`` turned into a dict; each key met twice in one object is appended
    to ``found`` as its key path (``a.b[2].c``)."""
    if isinstance(value, _Pairs):
        out: dict = {}
        for key, item in value:
            where = f"{path}.{key}" if path else str(key)
            if key in out and where not in found:
                found.append(where)
            out[key] = _no_duplicates(item, where, found)
        return out
    if isinstance(value, list):
        return [_no_duplicates(item, f"{path}[{i}]", found) for i, item in enumerate(value)]
    return value


def parse_json(text: str, source: str, loads=json.loads) -> Any:
    """``text`` parsed as JSON (or by ``loads``, e.g. ``hjson.loads``), refusing a key that appears twice in
    one object at any depth: the json module would keep the last value silently. The ConfigError names
    ``source`` and each duplicated key's path."""
    found: list = []
    value = _no_duplicates(loads(text, object_pairs_hook=_Pairs), "", found)
    if found:
        keys = ", ".join(repr(k) for k in found)
        raise ConfigError(f"{source}: duplicate key{'s' if len(found) > 1 else ''} {keys}: the same key appears "
                          "more than once in one object, and JSON readers keep only its last value; keep one")
    return value


def load_raw(config: Union[str, os.PathLike, dict]) -> dict:
    """The whole config as a dict: ``config`` itself, or the JSON (or hjson) file it names (a key that appears
    twice in one of its objects is refused: :func:`parse_json`)."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"the config must be a JSON object (dict) or a path to a JSON file, got "
                          f"{type(config).__name__} {config!r:.80}")
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as fh:
        text = fh.read()
    if not text.strip():  # hjson reads "" as {}: an empty file (or one being written) is refused, not "no sections"
        raise ConfigError(f"config file {path!r} is empty; expected a JSON object")
    try:
        raw = parse_json(text, f"config file {path!r}")
    except json.JSONDecodeError:
        try:  # DeepSpeed accepts hjson (comments); so do we when hjson is installed
            import hjson
            raw = parse_json(text, f"config file {path!r}", hjson.loads)  # anything but an object is refused below
        except ConfigError:
            raise
        except ImportError:
            raise ConfigError(f"config file {path!r} is not valid JSON") from None
        except Exception as exc:  # hjson error: report file and reason
            raise ConfigError(f"config file {path!r} is not valid JSON/hjson: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} holds a JSON {type(raw).__name__}; expected an object (dict)")
    return raw
