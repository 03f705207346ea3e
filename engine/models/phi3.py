"""Phi-3: Llama's decoder, with a checkpoint that already fuses Q, K and V (`qkv_proj`) and gate and
up (`gate_up_proj`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.models.decoder import CausalLM


class Phi3ForCausalLM(CausalLM):
    """Phi-3 and Phi-3.5 mini/medium. The fused checkpoint tensors are split back into the
    projections they stack, so each rank cuts its shard of Q, K and V (and of gate and up) as for
    Llama."""

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        config = self.config
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                yield from _split(
                    name, tensor, "qkv_proj", {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
                )
            elif ".gate_up_proj." in name:
                half = tensor.shape[0] // 2
                yield from _split(name, tensor, "gate_up_proj", {"gate_proj": half, "up_proj": half})
            else:
                yield name, tensor


def _split(
    name: str, tensor: torch.Tensor, fused: str, parts: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The rows of a fused checkpoint tensor under the names of the projections they stack."""
    if tensor.shape[0] != sum(parts.values()):
        raise ValueError(
            f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, the config implies {sum(parts.values())}"
        )
    for part, rows in zip(parts, tensor.split(list(parts.values())), strict=True):
        yield name.replace(f".{fused}.", f".{part}."), rows
