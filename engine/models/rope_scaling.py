"""The RoPE scalings a checkpoint may name, read without torch (the scheduling core reads the
model's context length through the config): which are supported, and the context each serves.
engine/models/rope.py computes their angles."""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_type(scaling: dict[str, Any] | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_rope_scaling(scaling: dict[str, Any] | None, where: object) -> None:
    """An unsupported scaling is an error at load, never a silently different model."""
    name = rope_type(scaling)
    if name not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"model {where}: rope scaling type {name!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )


def rope_max_positions(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The longest context the scaled RoPE serves, as vLLM derives it: YaRN's original length times
    its factor, dynamic NTK's length times its factor, the configured length otherwise."""
    name = rope_type(scaling)
    if name == "yarn":
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings  # type: ignore[union-attr]
        return max(int(original * scaling["factor"]), max_position_embeddings)  # type: ignore[index]
    if name == "dynamic":
        return int(max_position_embeddings * scaling["factor"])  # type: ignore[index]
    return max_position_embeddings
