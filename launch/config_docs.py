"""Write docs/config.md, the reference of every ds_xc config section, from the pydantic models.

    python launch/config_docs.py            # rewrite docs/config.md
    python launch/config_docs.py --check    # exit 1 if docs/config.md is out of date
"""
from __future__ import annotations

import argparse
import os
import sys
import typing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pydantic import BaseModel  # noqa: E402

from ds_xc import config as cfg  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config.md")


def _bounds(field) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v:g}" if isinstance(v, float) else f"{sym} {v}")
    return ", ".join(parts)


def _type(annotation) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and type(None) in args and len(args) == 2:
        return _type(next(a for a in args if a is not type(None))) + " or null"  # Optional[X]
    if typing.get_origin(annotation) is typing.Union:
        return "object, chosen by `type`"
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        return "see below"
    return "`null`" if field.default is None else f"`{field.default!r}`"


def model_table(model: type[BaseModel], path: str) -> list[str]:
    lines = [f"### `{path}`", "", (model.__doc__ or "").strip(), "",
             "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        lines.append(f"| `{name}` | {_type(field.annotation)} | {_default(field)} | {_bounds(field)} | "
                     f"{field.description or ''} |")
    return lines + [""]


def render() -> str:
    out = ["# ds_xc configuration reference", "",
           "Generated from the pydantic models in `ds_xc/config.py`, `ds_xc/config_compression.py` and `ds_xc/config_schedule.py` by `python launch/config_docs.py`;",
           "a test fails when this page and the models disagree. Every section lives at the top level",
           "of the DeepSpeed JSON next to DeepSpeed's own keys. Unknown keys are errors, and an error",
           "names the key path, the value and what is allowed. A key that appears twice in one object of",
           "a config file (any depth; JSON readers keep the last silently) is an error naming its path, and",
           "a top-level key that nearly spells a ds_xc section (`extreme_clasification`, `xc-train`) is an",
           "error that suggests the section (DeepSpeed ignores keys it does not know).", ""]
    out += ["## extreme_classification", ""] + model_table(cfg.HeadConfig, "extreme_classification")
    out += ["`loss` is one of the following, chosen by `type`:", ""]
    for m in (cfg.SoftmaxLoss, cfg.CosFaceLoss, cfg.ArcFaceLoss, cfg.CombinedLoss, cfg.DSoftmaxLoss):
        out += model_table(m, f"extreme_classification.loss (type {m.model_fields['type'].annotation.__args__[0]!r})")
    out += ["`sampler` is one of the following, chosen by `type`:", ""]
    for m in typing.get_args(typing.get_args(cfg.SamplerConfig)[0]):
        out += model_table(m, f"extreme_classification.sampler (type {m.model_fields['type'].annotation.__args__[0]!r})")
    out += model_table(cfg.HeadOptimizerConfig, "extreme_classification.optimizer")
    out += model_table(cfg.TopologyConfig, "extreme_classification.topology")  # docs/multinode.md
    out += ["## xc_train", ""] + model_table(cfg.TrainConfig, "xc_train")
    from ds_xc import config_compression as ccfg
    out += ["## gradient_compression", "",
            "Compressed data-parallel reduction of the backbone's gradients (docs/compression.md); when",
            "present with a `method` other than none, `ds_xc.initialize` attaches it to the engine.", ""]
    out += model_table(ccfg.GradientCompressionConfig, "gradient_compression")
    out += model_table(ccfg.PriorConfig, "gradient_compression.prior")
    out += model_table(ccfg.HierarchyConfig, "gradient_compression.hierarchy")
    out += model_table(ccfg.PowerSGDConfig, "gradient_compression.powersgd")
    from ds_xc.optim import config as ocfg
    out += ["## optimizer (types Lamb and LARS)", "",
            "DeepSpeed's own `optimizer` section; for `\"type\": \"Lamb\"` and `\"type\": \"LARS\"` ds_xc builds the",
            "backbone optimizer itself (DeepSpeed's FusedLamb on GPUs where its op builds, else ds_xc's; see",
            "docs/optimizers.md) and validates `optimizer.params` here. Other types are DeepSpeed's.", ""]
    out += model_table(ocfg.LambParams, "optimizer.params (type 'Lamb')")
    out += model_table(ocfg.LarsParams, "optimizer.params (type 'LARS')")
    from ds_xc import config_schedule as scfg
    out += ["## adaptive_lr", "",
            "The adaptive learning-rate schedule (docs/convergence.md): warm-up scaled to the global batch, then",
            "decay on plateaus of the held-out metric or the smoothed training loss; `ds_xc.initialize` passes it",
            "to DeepSpeed as its `lr_scheduler`. Not together with DeepSpeed's `scheduler` section.", ""]
    out += model_table(scfg.AdaptiveLRConfig, "adaptive_lr")
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    text = render()
    if args.check:
        with open(OUT) as fh:
            if fh.read() != text:
                print(f"{OUT} is out of date: run python launch/config_docs.py")
                return 1
        return 0
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        fh.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
