"""Linear layers on oneDNN's prepacked bf16 weights compute what the plain weights did, bit for
bit, and the float32 result within bf16 rounding; a tied LM head keeps the embedding usable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    prepack_linear_weights,
)
from parallel.onednn import can_prepack

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(
    not can_prepack(torch.empty(2, 2, dtype=BF16)), reason="this CPU's oneDNN has no bf16 linear"
)


def loaded(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.data.copy_(bias)
    return layer


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_prepacked_layers_match_plain_ones(rows: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 96, dtype=BF16)
    column_weight, bias = torch.randn(160, 96, dtype=BF16), torch.randn(160, dtype=BF16)
    row_weight = torch.randn(48, 160, dtype=BF16)
    model = nn.Sequential(
        loaded(ColumnParallelLinear(96, 160, bias=True, dtype=BF16), column_weight, bias),
        loaded(RowParallelLinear(160, 48, dtype=BF16), row_weight),
    )
    with torch.inference_mode():
        plain = model(x)
        prepack_linear_weights(model)
        packed = model(x)
    assert all(layer.weight.is_mkldnn for layer in model)
    torch.testing.assert_close(packed, plain, rtol=0, atol=0)
    exact = (x.float() @ column_weight.float().T + bias.float()).to(BF16).float() @ row_weight.float().T
    torch.testing.assert_close(packed.float(), exact, rtol=2e-2, atol=2e-1)


def test_tied_lm_head_prepacks_a_copy_and_the_embedding_still_looks_up() -> None:
    table = torch.randn(50, 32, dtype=BF16)
    embedding = loaded(VocabParallelEmbedding(50, 32, BF16), table)
    head = ParallelLMHead(50, 32, BF16)
    head.tie_to(embedding)
    model = nn.ModuleDict({"embed": embedding, "head": head})
    hidden = torch.randn(5, 32, dtype=BF16)
    with torch.inference_mode():
        plain = head.compute_logits(hidden)
        prepack_linear_weights(model)
        torch.testing.assert_close(head.compute_logits(hidden), plain, rtol=0, atol=0)
        torch.testing.assert_close(embedding(torch.tensor([3, 49])), table[[3, 49]], rtol=0, atol=0)
    assert head.tied_logits_weight is not None and not embedding.weight.is_mkldnn


def test_float32_weights_stay_plain() -> None:
    layer = loaded(ColumnParallelLinear(8, 4), torch.randn(4, 8))
    prepack_linear_weights(layer)
    assert not layer.weight.is_mkldnn
