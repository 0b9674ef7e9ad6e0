"""Rotary position embedding tables built from a Hugging Face model config.

The kernel ``_C.ops.rotary_embedding`` reads one float32 row per position from a cache
``[max_position, rot_dim]`` holding ``cos(pos * inv_freq)`` in its first half and
``sin(pos * inv_freq)`` in its second. This module derives ``inv_freq`` from the config's RoPE
parameters (default, linear, dynamic NTK, Llama 3 and YaRN scaling) and fills that cache.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _get(config: Any, key: str, default: Any = None) -> Any:
    """config[key] for dicts, config.key for config objects; None counts as missing."""
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return default if value is None else value


def _rope_params(config: Any, layer_type: str | None = None) -> dict:
    """The RoPE dict with rope_theta and partial_rotary_factor merged in from the top level.

    transformers 5 spells it ``rope_parameters`` (theta inside; one dict per layer type for
    models such as Gemma 3); older config.json files spell it ``rope_scaling`` with
    ``rope_theta`` beside it, and name the type ``type``.
    """
    params = dict(_get(config, "rope_parameters") or _get(config, "rope_scaling") or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    elif params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"this config has RoPE parameters per layer type ({', '.join(params)}); pass layer_type")
    for key, default in (("rope_theta", 10000.0), ("partial_rotary_factor", 1.0)):
        if params.get(key) is None:
            params[key] = _get(config, key, default)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_dims(config: Any, layer_type: str | None = None) -> tuple[int, int]:
    """(head_size, rot_dim): rot_dim < head_size when only part of each head is rotated."""
    head_size = _get(config, "head_dim") or _get(config, "hidden_size") // _get(config, "num_attention_heads")
    rot_dim = _get(config, "rotary_dim")  # GPT-J spells the rotated part as a size
    return head_size, rot_dim or int(head_size * _rope_params(config, layer_type)["partial_rotary_factor"])


def rope_is_neox(config: Any) -> bool:
    """True for rotate-half pairs (i, i + rot_dim/2) as Llama / GPT-NeoX; False for GPT-J's (2i, 2i+1)."""
    return not (_get(config, "model_type") == "gptj" or _get(config, "rope_interleave", False))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): high frequencies kept, low ones interpolated by `factor`, a linear
    ramp between the dims that turn beta_fast and beta_slow times over the original context."""
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / original
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # dim whose wavelength fits `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = (high - low) or 0.001  # equal bounds would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    return inv_freq, float(attention)


def _llama3(inv_freq: torch.Tensor, p: dict, max_pos: int) -> torch.Tensor:
    """Llama 3.1: wavelengths beyond original/low_freq_factor divided by `factor`, those below
    original/high_freq_factor kept, a smooth blend in between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p.get("original_max_position_embeddings") or max_pos
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * (1 - smooth) + inv_freq * smooth


def _default_length(config: Any, p: dict) -> int:
    """Positions covered by default: the trained length, stretched by `factor` for the types
    whose config keeps the pre-scaling length (as vLLM does)."""
    max_pos = _get(config, "max_position_embeddings", 2048)
    if p["rope_type"] in ("linear", "dynamic"):
        return int(max_pos * p["factor"])
    if p["rope_type"] == "yarn":
        original = p.get("original_max_position_embeddings") or max_pos
        return max(max_pos, int(original * (p.get("factor") or 1)))
    return max_pos


def rope_inv_freq(
    config: Any, seq_len: int | None = None, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rot_dim / 2]`` (float64) and the factor that scales cos and sin.

    ``seq_len`` matters only for dynamic NTK scaling, whose base grows with the length covered
    (default: the cache length of :func:`rope_cos_sin_cache`). ``layer_type`` picks one entry
    of per-layer-type RoPE parameters (e.g. "sliding_attention").
    """
    p = _rope_params(config, layer_type)
    rope_type = p["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope type {rope_type!r} is not supported; supported types: {supported}")
    _, dim = rope_dims(config, layer_type)
    base, max_pos = float(p["rope_theta"]), _get(config, "max_position_embeddings", 2048)
    if rope_type == "dynamic":
        # NTK-aware: stretch the base so the lowest frequency spans factor x the trained length.
        factor, seq_len = p["factor"], max(seq_len or _default_length(config, p), max_pos)
        base *= (factor * seq_len / max_pos - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, p, max_pos), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, dim, base, p, max_pos)
    return inv_freq, 1.0


def rope_cos_sin_cache(config: Any, max_position: int | None = None, layer_type: str | None = None) -> torch.Tensor:
    """The float32 table ``[max_position, rot_dim]`` for ``_C.ops.rotary_embedding``.

    Row ``pos`` is ``[cos(pos * inv_freq), sin(pos * inv_freq)] * attention_factor``, computed in
    float64 so that far positions keep their precision. ``max_position`` defaults to the length
    the config's scaling covers. Dynamic NTK builds one static table with the base for that whole
    length (vLLM's choice); transformers instead rescales per batch length.
    """
    p = _rope_params(config, layer_type)
    length = max_position or _default_length(config, p)
    inv_freq, attention = rope_inv_freq(config, seq_len=length, layer_type=layer_type)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * attention).to(torch.float32)
