"""Building the backbone optimizer from the DeepSpeed JSON's ``"optimizer": {"type": "Lamb" | "LARS"}``.

DeepSpeed's ``"type": "Lamb"`` constructs FusedLamb, a CUDA op: on a CPU machine the engine
fails at start. And it has no LARS. So ``ds_xc.initialize`` builds these two itself
(:func:`build_backbone_optimizer`) and hands DeepSpeed the instance as ``optimizer=`` with the
``optimizer`` section removed from the config it gives DeepSpeed. Why removed: DeepSpeed 0.19
prefers a client optimizer over the section, but still reads the section's type for its checks
(``"type": "Lamb"`` asserts dynamic loss scaling, i.e. fp16, even beside a client optimizer;
any other unknown type is refused), so the section must not reach it.

Which Lamb runs: DeepSpeed's FusedLamb when CUDA is present, the op builds and one probe step
runs, the model is stepped whole (ZeRO stage 0: under ZeRO 1/2 FusedLamb would take the
trust ratio of a flat partition of many layers) and no ds_xc-only option is set
(``exclude_bias_and_norm``); else ds_xc's :class:`~ds_xc.optim.Lamb`. The choice and its reason
are logged at INFO on every rank.

ZeRO: stage 1 and 2 flatten the parameters of a group into one buffer and give the optimizer
one flat partition per rank. :func:`attach_partition_layouts` then tells our optimizer where
each layer lies in that partition, so its trust ratio is still the layer's, summed over the
ranks holding its slices. DeepSpeed asks ``"zero_allow_untested_optimizer": true`` for any
client optimizer outside its Adam family; ds_xc sets it in the config it passes when it built
the optimizer itself. bf16 with ZeRO 1 (DeepSpeed's BF16_Optimizer) partitions alike, in buffers of
other names (``_LAYOUT_ATTRS``).
"""
from __future__ import annotations

import logging
import subprocess

import torch
import torch.distributed as dist

from ds_xc.config_base import ConfigError
from ds_xc.optim.config import backbone_type, parse_params
from ds_xc.optim.lamb import Lamb
from ds_xc.optim.lars import Lars
from ds_xc.optim.trust import PartitionLayout

log = logging.getLogger(__name__)

__all__ = ["attach_partition_layouts", "build_backbone_optimizer", "check_backbone_optimizer"]


def _stage(raw: dict) -> int:
    zero = raw.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


def check_backbone_optimizer(raw: dict) -> None:
    """Refuse, at start and on every rank, a Lamb / LARS section with a bad key or value (ConfigError).

    Every ZeRO stage (0, 1, 2) and precision (fp32, bf16) ds_xc supports works with both types
    (:func:`attach_partition_layouts`), so nothing else is refused here."""
    parse_params(raw)


def _fused_lamb(params: list, kwargs: dict, stage: int):
    """(DeepSpeed's FusedLamb over ``params``, None) where it can run, else (None, the reason)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device (FusedLamb is a CUDA op)"
    if stage > 0:
        return None, f"ZeRO stage {stage} (FusedLamb would take the trust ratio of a whole flat partition)"
    if kwargs.get("exclude_bias_and_norm"):
        return None, "exclude_bias_and_norm=true (FusedLamb has no such option)"
    try:
        from deepspeed.ops.lamb import FusedLamb
        probe = torch.nn.Parameter(torch.ones(8, device="cuda"))
        probe.grad = torch.ones_like(probe)
        FusedLamb([probe]).step()  # builds (or loads) the op and runs it once
        torch.cuda.synchronize()
        fused_kwargs = {k: v for k, v in kwargs.items() if k != "exclude_bias_and_norm"}
        return FusedLamb(params, **fused_kwargs), None
    except (ImportError, RuntimeError, OSError, ValueError, AssertionError, subprocess.SubprocessError) as exc:
        return None, f"FusedLamb could not build or run ({type(exc).__name__}: {str(exc)[:200]})"


def build_backbone_optimizer(raw: dict, model_parameters, client_optimizer=None):
    """(optimizer, config for DeepSpeed) for a Lamb / LARS section; (``client_optimizer``, ``raw``) for any other.

    ``model_parameters``: tensors or param-group dicts, as ``deepspeed.initialize`` takes them.
    The returned config is a copy of ``raw`` without ``optimizer`` (and, under ZeRO, with
    ``zero_allow_untested_optimizer``: true); ``raw`` itself is not changed."""
    params = parse_params(raw)
    if params is None:
        return client_optimizer, raw
    if client_optimizer is not None:
        raise ConfigError(f"optimizer.type={raw['optimizer']['type']!r} and an optimizer passed to "
                          "initialize(optimizer=...): give one of them (remove the 'optimizer' section, or the argument)")
    kind, stage = backbone_type(raw), _stage(raw)
    kwargs = params.model_dump()
    groups = list(model_parameters)
    if kind == "lars":
        optimizer, why = Lars(groups, **kwargs), "DeepSpeed has no LARS"
    else:
        optimizer, why = _fused_lamb(groups, kwargs, stage)
        if optimizer is None:
            optimizer = Lamb(groups, **kwargs)
    name = type(optimizer).__module__ + "." + type(optimizer).__name__
    log.info("ds_xc: backbone optimizer %s runs %s%s", raw["optimizer"]["type"], name,
             f" ({why})" if why else " (DeepSpeed's CUDA op)")
    ds_raw = {k: v for k, v in raw.items() if k != "optimizer"}
    if stage > 0:
        ds_raw["zero_allow_untested_optimizer"] = True
    return optimizer, ds_raw


# where DeepSpeed's partitioning wrappers keep, per param group: the flat buffer of the group's parameters
# (the model's parameters are views into it), those parameters in buffer order, and this rank's fp32 partition
_LAYOUT_ATTRS = {"DeepSpeedZeroOptimizer": ("bit16_groups_flat", "round_robin_bit16_groups",
                                            "single_partition_of_fp32_groups"),
                 "BF16_Optimizer": ("bf16_groups_flat", "bf16_groups", "fp32_groups_flat_partition")}


def attach_partition_layouts(engine, optimizer) -> None:
    """Under ZeRO 1/2 (fp32: DeepSpeedZeroOptimizer; bf16 ZeRO 1: BF16_Optimizer), tell ``optimizer``
    (ours) where the layers lie in the flat partitions it steps. A no-op for ZeRO 0 and other optimizers.

    Each flat buffer is split in equal partitions over the group's data-parallel ranks (the last one
    padded); a parameter's offset is where its storage lies in the buffer."""
    if not isinstance(optimizer, (Lamb, Lars)) or int(engine.zero_optimization_stage()) == 0:
        return
    zero = engine.optimizer
    attrs = _LAYOUT_ATTRS.get(type(zero).__name__)
    if attrs is None or not all(hasattr(zero, a) for a in (*attrs, "real_dp_process_group")):
        raise ConfigError(f"zero_optimization.stage={engine.zero_optimization_stage()} with optimizer "
                          f"{type(optimizer).__name__}: DeepSpeed's {type(zero).__name__} does not expose the "
                          f"partition layout ds_xc reads; use zero_optimization.stage=0")
    flats, groups, parts = (getattr(zero, a) for a in attrs)
    for i, flat in enumerate(flats):
        group = zero.real_dp_process_group[i]
        size = flat.numel() // dist.get_world_size(group=group)
        start = dist.get_rank(group=group) * size
        segments = []
        for layer, p in enumerate(groups[i]):
            offset = (p.data_ptr() - flat.data_ptr()) // flat.element_size()  # the parameter is a view into flat
            lo, hi = max(offset, start), min(offset + p.numel(), start + size)
            if lo < hi:
                segments.append((lo - start, hi - lo, layer, p.dim()))
        part = parts[i]
        optimizer.layouts[part] = PartitionLayout(part.numel(), segments, len(groups[i]), group=group,
                                                  device=part.device)
    log.info("ds_xc: %s takes layer-wise trust ratios over ZeRO stage %d partitions (%s)", type(optimizer).__name__,
             engine.zero_optimization_stage(), type(zero).__name__)
