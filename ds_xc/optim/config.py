"""The ``optimizer`` section of the DeepSpeed JSON for the types ds_xc builds itself: Lamb, LARS.

The keys are DeepSpeed's Lamb ones (lr, betas, eps, weight_decay, max_coeff, min_coeff,
bias_correction, eps_inside_sqrt), so that an existing ``"type": "Lamb"`` section works
unchanged, plus ``exclude_bias_and_norm`` (ours). LARS takes lr, momentum, weight_decay,
trust_coefficient, eps and exclude_bias_and_norm. Any other key is refused, naming the key
and the allowed ones (DeepSpeed would pass it to the constructor and fail with a TypeError).
"""
from __future__ import annotations

from pydantic import Field, field_validator

from ds_xc.config_base import ConfigError, Section, validate_section

__all__ = ["OPTIMIZER_TYPES", "LambParams", "LarsParams", "backbone_type", "parse_params"]


class LambParams(Section):
    """LAMB (You et al. 2019): Adam moments, a layer-wise trust ratio clamped to [min_coeff, max_coeff]."""
    lr: float = Field(1e-3, ge=0.0, description="Learning rate (a DeepSpeed scheduler may set it at every step).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam moment decays, each in [0, 1).")
    eps: float = Field(1e-8, ge=0.0, description="Added to sqrt(v_hat) (inside the sqrt with eps_inside_sqrt).")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay, added to the update "
                                "before its trust ratio.")
    max_coeff: float = Field(10.0, ge=0.0, description="Upper clamp of the trust ratio.")
    min_coeff: float = Field(0.01, ge=0.0, description="Lower clamp of the trust ratio.")
    bias_correction: bool = Field(True, description="Bias-correct the moments (Adam's 1 - beta^t).")
    eps_inside_sqrt: bool = Field(False, description="sqrt(v_hat + eps) instead of sqrt(v_hat) + eps.")
    exclude_bias_and_norm: bool = Field(False, description="1-D tensors (biases, norm layers) take trust ratio 1 "
                                        "and no weight decay (ds_xc's Lamb only: FusedLamb cannot).")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v):
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"got {list(v)}; each beta must be in [0, 1)")
        return v


class LarsParams(Section):
    """LARS (You et al. 2017): SGD with momentum and a layer-wise local learning rate."""
    lr: float = Field(0.1, ge=0.0, description="Global learning rate (a DeepSpeed scheduler may set it).")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="Momentum of the velocity.")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 weight decay, inside the local lr's denominator.")
    trust_coefficient: float = Field(0.001, gt=0.0, description="eta of the paper: local lr = eta * norm(w) / "
                                     "(norm(g) + weight_decay * norm(w) + eps).")
    eps: float = Field(0.0, ge=0.0, description="Added to the local lr's denominator.")
    exclude_bias_and_norm: bool = Field(False, description="1-D tensors (biases, norm layers) take local lr 1 "
                                        "and no weight decay.")


OPTIMIZER_TYPES = {"lamb": LambParams, "lars": LarsParams}  # DeepSpeed matches "type" case-insensitively


def backbone_type(raw: dict) -> str | None:
    """'lamb' or 'lars' when the config's ``optimizer`` section is one ds_xc builds, else None."""
    section = raw.get("optimizer")
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        return None
    kind = section["type"].lower()
    return kind if kind in OPTIMIZER_TYPES else None


def parse_params(raw: dict):
    """The validated params of the Lamb / LARS ``optimizer`` section (None for other types)."""
    kind = backbone_type(raw)
    if kind is None:
        return None
    section = raw["optimizer"]
    unknown = sorted(set(section) - {"type", "params"})
    if unknown:
        raise ConfigError(f"optimizer.{unknown[0]}: unknown key of the optimizer section; allowed: type, params")
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"optimizer.params: expected a JSON object (dict), got {type(params).__name__} {params!r}")
    model = OPTIMIZER_TYPES[kind]
    allowed = list(model.model_fields)
    for key in params:
        if key == "max_grad_norm":
            raise ConfigError("optimizer.params.max_grad_norm: not an optimizer parameter; use the top-level "
                              "'gradient_clipping' key (as DeepSpeed asks)")
        if key not in allowed:
            raise ConfigError(f"optimizer.params.{key}: unknown key for type {section['type']!r}; allowed: "
                              f"{', '.join(allowed)}")
    parsed = validate_section(model, params, "optimizer.params")
    if kind == "lamb" and parsed.min_coeff > parsed.max_coeff:
        raise ConfigError(f"optimizer.params.min_coeff={parsed.min_coeff} is above max_coeff={parsed.max_coeff}; "
                          "need min_coeff <= max_coeff")
    return parsed
