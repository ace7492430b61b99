"""The tuner's search space: which keys of the DeepSpeed JSON it may change, and the candidates.

A candidate is a small dict of tuned values (``sampler``: the sampler section's tuned keys,
``update``: the head optimizer's update mode). ``apply`` writes it into a deep copy of the
user's config: only the keys in TUNED_KEYS change (a tuned key the candidate does not name is
removed, so the library default applies), every other key of the file is kept as it was.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
from dataclasses import dataclass, field

from ds_xc.config import HEAD_SECTION, parse_config

__all__ = ["TUNED_KEYS", "Candidate", "apply", "default_candidate", "build_space", "stronger_or_equal",
           "RECALL_KNOBS"]

# the dotted keys under extreme_classification that the tuner owns
TUNED_KEYS = ("sampler.type", "sampler.sample_rate", "sampler.scan_rows", "sampler.rerank", "sampler.code_bits",
              "optimizer.update")
# knobs whose increase can only raise recall (at the same sampler type): the pruning's partial order
RECALL_KNOBS = ("sample_rate", "scan_rows", "rerank", "code_bits")
SAMPLE_RATES = (0.02, 0.05, 0.1)
SCAN_ROWS = (8192, 16384, 65536)
RERANKS = (64, 128, 256)
CODE_BITS = (256, 512)
UPDATES = ("lazy", "lazy_exact")


@dataclass(frozen=True)
class Candidate:
    """One point of the space: the sampler type and its tuned knobs, the optimizer's update mode.
    A knob at None is left to the library default (the key is absent from the output)."""
    type: str
    sample_rate: float | None = None
    scan_rows: int | None = None
    rerank: int | None = None
    code_bits: int | None = None
    update: str | None = None
    tag: str = field(default="", compare=False)

    def knobs(self) -> dict:
        return {k: getattr(self, k) for k in ("sample_rate", "scan_rows", "rerank", "code_bits", "update")
                if getattr(self, k) is not None}

    def label(self) -> str:
        short = {"sample_rate": "rate", "scan_rows": "scan", "rerank": "rerank", "code_bits": "bits",
                 "update": "upd"}
        body = " ".join(f"{short[k]}={v}" for k, v in self.knobs().items())
        return f"{self.tag + ': ' if self.tag else ''}{self.type}{' ' + body if body else ''}"

    def key(self) -> str:
        """A stable id of the candidate's values (the cache key's part)."""
        return hashlib.sha1(json.dumps({"type": self.type, **self.knobs()}, sort_keys=True).encode()).hexdigest()[:16]


def _resolved(cand: Candidate, name: str):
    """The value the library will use for a knob of the ann sampler (the default when None)."""
    from ds_xc.config import parse_sampler
    value = getattr(cand, name)
    if value is not None:
        return value
    return getattr(parse_sampler({"type": cand.type}), name, None)


def stronger_or_equal(a: Candidate, b: Candidate) -> bool:
    """True when a's recall can be no lower than b's: same sampler type and every recall knob of a
    at least b's (library defaults resolved)."""
    if a.type != b.type:
        return False
    return all((_resolved(a, k) or 0) >= (_resolved(b, k) or 0) for k in RECALL_KNOBS)


def apply(raw: dict, cand: Candidate) -> dict:
    """A deep copy of ``raw`` with the candidate's tuned keys written into extreme_classification;
    the tuned keys it leaves at None are removed (library default), all other keys untouched.
    A sampler type change drops the old sampler's keys that the new type does not have."""
    out = copy.deepcopy(raw)
    head = out.setdefault(HEAD_SECTION, {})
    sampler = dict(head.get("sampler", {}))
    if sampler.get("type", "full") != cand.type:
        from ds_xc.config import parse_sampler
        allowed = set(type(parse_sampler({"type": cand.type})).model_fields)
        sampler = {k: v for k, v in sampler.items() if k in allowed}
    sampler["type"] = cand.type
    for name in ("sample_rate", "scan_rows", "rerank", "code_bits"):
        value = getattr(cand, name)
        if value is None:
            sampler.pop(name, None)
        else:
            sampler[name] = value
    head["sampler"] = sampler
    optimizer = dict(head.get("optimizer", {}))
    if cand.update is None:
        optimizer.pop("update", None)
    else:
        optimizer["update"] = cand.update
    if optimizer or "optimizer" in head:
        head["optimizer"] = optimizer
    parse_config(out)  # the output must be a valid ds_xc config
    return out


def default_candidate(raw: dict) -> Candidate:
    """The library defaults for the user's sampler type: every tuned key but the type removed."""
    sampler = raw.get(HEAD_SECTION, {}).get("sampler", {"type": "full"})
    kind = sampler if isinstance(sampler, str) else sampler.get("type", "full")
    return Candidate(type=kind, tag="defaults")


def build_space(raw: dict, types=("ann", "uniform", "full")) -> list:
    """Every candidate of the grid for the sampler types named (the defaults first)."""
    out = [default_candidate(raw)]
    if "full" in types:
        out.append(Candidate(type="full", update="dense"))
    if "uniform" in types:
        out += [Candidate(type="uniform", sample_rate=r, update=u) for r, u in itertools.product(SAMPLE_RATES, UPDATES)]
    if "ann" in types:
        out += [Candidate(type="ann", sample_rate=r, scan_rows=s, rerank=k, code_bits=b, update=u)
                for r, s, k, b, u in itertools.product(SAMPLE_RATES, SCAN_ROWS, RERANKS, CODE_BITS, UPDATES)]
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique
