"""Rotary position angles of every RoPE scaling a supported checkpoint may name, computed as
transformers computes them (modeling_rope_utils.py): default, linear, llama3, YaRN and dynamic NTK.

`rope_angles` returns the angle of each (position, frequency) pair and the factor the cos and sin
tables are multiplied by (YaRN's attention factor; 1 elsewhere).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.models.rope_scaling import check_rope_scaling, rope_type


def _inverse_frequencies(head_dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if isinstance(theta, torch.Tensor):
        return 1.0 / (theta.unsqueeze(-1) ** exponents)
    return 1.0 / (theta**exponents)


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent rescaling of the rotary frequencies."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    head_dim: int, theta: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between, and the
    attention factor 0.1 ln(factor) + 1 (or the mscale ratio)."""
    factor = scaling.get("factor") or max_position / scaling["original_max_position_embeddings"]
    original = scaling.get("original_max_position_embeddings") or max_position

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = _inverse_frequencies(head_dim, theta)
    interpolation = extrapolation / factor
    keep = 1 - ramp  # the share of each frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _dynamic_ntk_angles(
    head_dim: int, theta: float, factor: float, positions: torch.Tensor, original: int
) -> torch.Tensor:
    """Dynamic NTK: the base grows with the sequence length past the original context. Each position
    is rotated with the base of the length that ends at it, which is what transformers' generation
    does token by token (its cache keeps each key as it was rotated); within the original context
    the base is the configured one."""
    lengths = torch.clamp(positions + 1, min=original)
    bases = theta * ((factor * lengths / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return positions.unsqueeze(-1) * _inverse_frequencies(head_dim, bases)


def rope_angles(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, table_len: int, original_len: int
) -> tuple[torch.Tensor, float]:
    """Angles [table_len, head_dim / 2] (float32) and the cos/sin multiplier of a RoPE setting;
    `original_len` is the checkpoint's max_position_embeddings."""
    positions = torch.arange(table_len, dtype=torch.int64).float()
    name = rope_type(scaling)
    inv_freq, attention_factor = _inverse_frequencies(head_dim, theta), 1.0
    if name == "linear":
        positions = positions / scaling["factor"]  # type: ignore[index]
    elif name == "llama3":
        inv_freq = _llama3(inv_freq, scaling)  # type: ignore[arg-type]
    elif name == "yarn":
        inv_freq, attention_factor = _yarn(head_dim, theta, scaling, original_len)  # type: ignore[arg-type]
    elif name == "dynamic":
        return _dynamic_ntk_angles(head_dim, theta, scaling["factor"], positions, original_len), 1.0  # type: ignore[index]
    elif name != "default":
        check_rope_scaling(scaling, "rotary embedding")
    return torch.outer(positions, inv_freq), attention_factor
