"""Linear layers on weights prepared for the CPU's matmul compute what the plain weights did: oneDNN's
prepacked bf16 weights bit for bit, float32-widened ones within one bf16 rounding of a float64
reference; a tied LM head keeps the embedding usable either way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel.cpu_linear import WeightForm, best_weight_form
from parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    prepare_linear_weights,
)

BF16 = torch.bfloat16
needs_onednn_bf16 = pytest.mark.skipif(
    best_weight_form(torch.empty(2, 2, dtype=BF16)) is not WeightForm.ONEDNN_PREPACKED,
    reason="this CPU's oneDNN has no bf16 linear",
)


def loaded(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.data.copy_(bias)
    return layer


def two_layers(seed: int) -> tuple[nn.Sequential, list[torch.Tensor]]:
    """A column- then a row-parallel bf16 layer (96 -> 160 with bias -> 48) and their weights."""
    torch.manual_seed(seed)
    column_weight, bias = torch.randn(160, 96, dtype=BF16), torch.randn(160, dtype=BF16)
    row_weight = torch.randn(48, 160, dtype=BF16)
    model = nn.Sequential(
        loaded(ColumnParallelLinear(96, 160, bias=True, dtype=BF16), column_weight, bias),
        loaded(RowParallelLinear(160, 48, dtype=BF16), row_weight),
    )
    return model, [column_weight, bias, row_weight]


def rounded_reference(
    x: torch.Tensor, column_weight: torch.Tensor, bias: torch.Tensor, row_weight: torch.Tensor
) -> torch.Tensor:
    """Both layers in float64, each output rounded to bf16 as a bf16 layer's is."""
    hidden = (x.double() @ column_weight.double().T + bias.double()).to(BF16)
    return (hidden.double() @ row_weight.double().T).to(BF16)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_prepacked_layers_match_plain_ones(rows: int) -> None:
    model, weights = two_layers(rows)
    x = torch.randn(rows, 96, dtype=BF16)
    with torch.inference_mode():
        plain = model(x)
        prepare_linear_weights(model)
        packed = model(x)
    assert all(layer.weight.is_mkldnn for layer in model)
    torch.testing.assert_close(packed, plain, rtol=0, atol=0)
    torch.testing.assert_close(packed.float(), rounded_reference(x, *weights).float(), rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_widened_layers_round_a_float32_product_once(rows: int) -> None:
    model, (column_weight, bias, row_weight) = two_layers(rows)
    x = torch.randn(rows, 96, dtype=BF16)
    with torch.inference_mode():
        prepare_linear_weights(model, WeightForm.WIDENED)
        hidden = model[0](x)
        out = model[1](hidden)
    assert all(layer.weight.dtype == torch.float32 for layer in model)
    assert hidden.dtype == out.dtype == BF16
    # Against float64 on the same bf16 inputs: within one bf16 rounding (float32's own summation
    # order can tip a value to the neighbouring bf16 number, never further).
    hidden_reference = (x.double() @ column_weight.double().T + bias.double()).to(BF16)
    out_reference = (hidden.double() @ row_weight.double().T).to(BF16)
    for got, want in ((hidden, hidden_reference), (out, out_reference)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    assert (hidden != hidden_reference).float().mean() < 0.01


@pytest.mark.parametrize(
    "form", [pytest.param(WeightForm.ONEDNN_PREPACKED, marks=needs_onednn_bf16), WeightForm.WIDENED]
)
def test_tied_lm_head_prepares_a_copy_and_the_embedding_still_looks_up(form: WeightForm) -> None:
    table = torch.randn(50, 32, dtype=BF16)
    embedding = loaded(VocabParallelEmbedding(50, 32, BF16), table)
    head = ParallelLMHead(50, 32, BF16)
    head.tie_to(embedding)
    model = nn.ModuleDict({"embed": embedding, "head": head})
    hidden = torch.randn(5, 32, dtype=BF16)
    with torch.inference_mode():
        reference = (hidden.double() @ table.double().T).to(BF16)
        prepare_linear_weights(model, form)
        torch.testing.assert_close(
            head.compute_logits(hidden).float(), reference.float(), rtol=2**-7, atol=1e-3
        )
        torch.testing.assert_close(embedding(torch.tensor([3, 49])), table[[3, 49]], rtol=0, atol=0)
    assert head.tied_logits_weight is not None
    assert embedding.weight.dtype == BF16 and not embedding.weight.is_mkldnn


def test_float32_weights_stay_plain() -> None:
    weight = torch.randn(4, 8)
    layer = loaded(ColumnParallelLinear(8, 4), weight)
    assert best_weight_form(layer.weight) is WeightForm.PLAIN
    prepare_linear_weights(layer)
    assert not layer.weight.is_mkldnn
    torch.testing.assert_close(layer.weight.data, weight, rtol=0, atol=0)
