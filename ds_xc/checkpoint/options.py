"""The head's options recorded in a checkpoint, and what a resume with edited options may keep.

A head shard's state has a layout that depends on the configuration: an ANN sampler saves an
index and a step count, a kNN sampler a graph, uniform/full samplers only their fill stream; SGD
saves a momentum buffer and param groups with ``momentum``, AdamW moments, a step and ``betas``.
Loading one layout into the other used to fail half-way (``KeyError: 'steps'`` after DeepSpeed
had already loaded the backbone and the step, ``KeyError: 'betas'`` at the first step), and the
optimizer's ``load_state_dict`` silently put back the checkpoint's momentum, weight decay and lr.

So every shard records the options it was saved with (:func:`head_options`: the sampler, head
optimizer and loss sections), and :func:`compare_head_options` runs on every rank before
anything is loaded:

* a head optimizer type other than the checkpoint's (sgd <-> adamw), or a sampler type whose
  saved state has another layout (ann, knn, and uniform/full, which save the same fill stream
  and may be swapped): refused, every difference listed (nothing is loaded);
* other sampler options (code_bits, nlist, k, ...) changed: the weights, optimizer state and
  sampler stream load, the saved ANN index / kNN graph is dropped and rebuilt with the new
  options at the first forward;
* optimizer hyperparameters (lr, momentum, weight decay, betas, eps, nesterov, update mode,
  lr_schedule) and loss options changed: everything loads and the new values are used (the
  head optimizer keeps its configured param groups, ds_xc/head/optim.py); each change is logged.

A checkpoint written before options were recorded is judged by the layout of its state alone.
"""
from __future__ import annotations

import json
from typing import Optional

__all__ = ["head_options", "compare_head_options", "sampler_kind", "optimizer_kind"]

def _plain(section) -> dict:
    """A config section (pydantic model or dict) as plain JSON data (a checkpoint holds no objects)."""
    if hasattr(section, "model_dump"):
        section = section.model_dump(mode="json")
    return json.loads(json.dumps(section, default=str))


def head_options(head, optimizer_config=None, loss_config=None) -> dict:
    """The options a head shard is saved with: {"sampler": {...}, "optimizer": {...}, "loss": {...}}."""
    out = {"sampler": _plain(head.sampler_config)}
    if optimizer_config is not None:
        out["optimizer"] = _plain(optimizer_config)
    if loss_config is not None:
        out["loss"] = _plain(loss_config)
    return out


def sampler_kind(sampler_state: dict) -> str:
    """The layout of a saved sampler state: "ann" (an index), "knn" (a graph) or "plain" (a fill stream)."""
    if "index" in sampler_state:
        return "ann"
    if "graph" in sampler_state:
        return "knn"
    return "plain"


def optimizer_kind(optimizer_state: Optional[dict]) -> Optional[str]:
    """The head optimizer a saved optimizer state belongs to ("sgd", "adamw"; None: no state saved)."""
    if not isinstance(optimizer_state, dict) or not optimizer_state.get("param_groups"):
        return None
    group = optimizer_state["param_groups"][0]
    return "adamw" if "betas" in group else "sgd" if "momentum" in group else None


def _current_kinds(head, optimizer) -> tuple:
    kind = head.sampler_config.type
    sampler = kind if kind in ("ann", "knn") else "plain"
    opt = None
    if optimizer is not None:
        opt = "adamw" if "betas" in optimizer.param_groups[0] else "sgd"
    return sampler, opt


def _diff(saved: dict, current: dict, prefix: str) -> list:
    """["prefix.key: checkpoint X, this run Y", ...] for keys whose values differ."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if a != b:
            out.append((f"{prefix}.{key}", a, b))
    return out


def compare_head_options(state: dict, head, optimizer, current: dict, tag_dir: str) -> list:
    """Check a head shard ``state`` (read, not loaded) against this run's ``current`` options.

    Raises ValueError listing every difference when the saved state cannot be loaded into this
    head (sampler or optimizer type); otherwise returns the changes as messages to log, after
    dropping from ``state`` what the new options make stale (an ANN index / kNN graph built with
    other sampler options)."""
    extra = state["head"].get("_extra_state") or {}
    saved_sampler = extra.get("sampler") or {}
    saved = state.get("options") or {}
    kinds = (sampler_kind(saved_sampler), optimizer_kind(state.get("optimizer")))
    mine = _current_kinds(head, optimizer)
    diffs = []
    for section in ("sampler", "optimizer", "loss"):
        if section in saved and section in current:
            diffs += _diff(saved[section], current[section], section)
    refused = []
    if kinds[0] != mine[0]:  # uniform <-> full save the same fill stream: that change loads
        refused.append(("sampler.type", saved.get("sampler", {}).get("type", f"(a {kinds[0]} sampler state)"),
                        head.sampler_config.type))
    if None not in (kinds[1], mine[1]) and kinds[1] != mine[1]:
        refused.append(("optimizer.type", saved.get("optimizer", {}).get("type", kinds[1]), mine[1]))
    diffs = [d for d in diffs if d[0] not in {k for k, _, _ in refused}]
    if refused:
        rest = diffs
        raise ValueError(
            f"checkpoint {tag_dir!r} was saved with a head configured differently in ways its saved state "
            "cannot follow: " + "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, a, b in refused)
            + (f" (other differences: {'; '.join(f'{k}: {a!r} -> {b!r}' for k, a, b in rest)})" if rest else "")
            + ". Nothing was loaded. Resume with the checkpoint's settings, or start the new configuration from "
            "its weights only: python launch/export.py --load_dir DIR --out head.pt, then "
            "ds_xc.checkpoint.load_exported_into_head (docs/checkpoints.md)")
    notes = []
    stale = [d for d in diffs if d[0].startswith("sampler.")]
    if stale and (saved_sampler.get("index") is not None or saved_sampler.get("graph") is not None):
        for sampler_state in [saved_sampler] + list(state.get("replica_samplers") or []):  # 2-D: every replica's
            if "graph" in sampler_state:
                sampler_state.update(graph=None, built_at=None)
            elif "index" in sampler_state:
                sampler_state.update(index=None, built_at=None, dirty=None)
        notes.append(f"the saved {'kNN graph' if 'graph' in saved_sampler else 'ANN index'} was built with other "
                     "sampler options: it is dropped and rebuilt at the first forward")
    for key, a, b in diffs:
        notes.append(f"{key}: checkpoint {a!r}, this run {b!r}: the new value is used")
    return notes
