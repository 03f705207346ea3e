"""Linear layers on weights prepared for the CPU's matmul compute what the plain weights did: oneDNN's
prepacked bf16 weights bit for bit, packed panels and float32-widened weights within one bf16
rounding of a float64 reference; a tied LM head keeps the embedding usable in every form."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.fused_ops import silu_and_mul
from kernels.linear import (
    WeightForm,
    best_weight_form,
    linear,
    onednn_computes_in,
    panel_kernel_serves,
    prepare_weight,
)
from parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    prepare_linear_weights,
)

BF16 = torch.bfloat16
needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_computes_in(BF16), reason="this CPU's oneDNN has no bf16 linear"
)
needs_panels = pytest.mark.skipif(
    not panel_kernel_serves(), reason="the panel kernel needs AVX-512 BF16 without AMX"
)
HALF_FORMS = [
    pytest.param(WeightForm.PANELS, marks=needs_panels),
    pytest.param(WeightForm.ONEDNN_PREPACKED, marks=needs_onednn_bf16),
    WeightForm.WIDENED,
]


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


def assert_one_rounding_from(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 rounding of a float64 reference rounded to bf16: float32's own summation
    order can tip a value to the neighbouring bf16 number, never further, and seldom."""
    assert got.dtype == BF16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    assert (got != want).float().mean() < 0.01


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_prepacked_layers_match_plain_ones(rows: int) -> None:
    model, _ = two_layers(rows)
    x = torch.randn(rows, 96, dtype=BF16)
    with torch.inference_mode():
        plain = model(x)
        prepare_linear_weights(model, WeightForm.ONEDNN_PREPACKED)
        packed = model(x)
    assert all(layer.weight.is_mkldnn for layer in model)
    torch.testing.assert_close(packed, plain, rtol=0, atol=0)


@pytest.mark.parametrize("form", HALF_FORMS)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_prepared_layers_round_a_float32_product_once(form: WeightForm, rows: int) -> None:
    model, (column_weight, bias, row_weight) = two_layers(rows)
    x = torch.randn(rows, 96, dtype=BF16)
    with torch.inference_mode():
        prepare_linear_weights(model, form)
        hidden = model[0](x)
        out = model[1](hidden)
    assert_one_rounding_from(hidden, (x.double() @ column_weight.double().T + bias.double()).to(BF16))
    assert_one_rounding_from(out, (hidden.double() @ row_weight.double().T).to(BF16))


@needs_panels
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [
        (1, 2, 16),  # one pair of inputs, one vector of outputs
        (9, 576, 960),  # a full tile and a one-row tile; panels of 48 columns only
        (64, 576, 3088),  # a last panel of one vector (3,088 = 64 x 48 + 16)
        (5, 1536, 32),  # a last (and only) panel of two vectors
        (300, 1536, 48),  # rows in chunks of the input (at most 96 rows at 1,536 inputs): 3 x 80 + 60
        (100, 1536, 576),  # two chunks of 56 and 44 rows, each against 12 panels
        (2048, 1024, 96),  # many chunks of 144 rows, each against two panels
    ],
)
def test_panels_cover_every_tile_and_panel_shape(rows: int, in_features: int, out_features: int) -> None:
    torch.manual_seed(rows + in_features + out_features)
    weight = torch.randn(out_features, in_features, dtype=BF16)
    bias = torch.randn(out_features, dtype=BF16)
    x = torch.randn(2, rows, in_features, dtype=BF16)[1]  # not at the start of its storage
    with torch.inference_mode():
        packed = prepare_weight(weight, WeightForm.PANELS)
        got = linear(x, packed, bias)
        got_no_bias = linear(x.unsqueeze(0), packed).squeeze(0)  # leading dimensions pass through
    assert_one_rounding_from(got, (x.double() @ weight.double().T + bias.double()).to(BF16))
    assert_one_rounding_from(got_no_bias, (x.double() @ weight.double().T).to(BF16))


@pytest.mark.parametrize("form", HALF_FORMS)
@pytest.mark.parametrize(("rows", "size"), [(1, 16), (8, 48), (64, 1536), (300, 80)])
def test_gate_up_projection_applies_silu_and_mul(form: WeightForm, rows: int, size: int) -> None:
    """silu(gate) * up against float64, rounded where torch rounds: each projection, the SiLU, the
    product. One bf16 step in a projection moves the result by a step or two, seldom."""
    torch.manual_seed(rows + size)
    gate_weight, up_weight = torch.randn(size, 96, dtype=BF16), torch.randn(size, 96, dtype=BF16)
    layer = MergedColumnParallelLinear(96, [size, size], dtype=BF16)
    layer.weight_loader(layer.weight, gate_weight, 0)
    layer.weight_loader(layer.weight, up_weight, 1)
    x = torch.randn(rows, 96, dtype=BF16)
    gate = (x.double() @ gate_weight.double().T).to(BF16).double()
    up = (x.double() @ up_weight.double().T).to(BF16).double()
    want = ((gate / (1 + torch.exp(-gate))).to(BF16).double() * up).to(BF16)
    with torch.inference_mode():
        prepare_linear_weights(layer, form)
        got = layer.silu_and_mul(x)
        unfused = silu_and_mul(layer(x))
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-2)
    assert (got != want).float().mean() < 0.03
    # The fused epilogue rounds exactly as the projection followed by the separate op does.
    torch.testing.assert_close(got, unfused, rtol=0, atol=0)


@needs_panels
def test_panels_refuse_wrong_inputs_by_name() -> None:
    packed = prepare_weight(torch.randn(32, 8, dtype=BF16), WeightForm.PANELS)
    with pytest.raises(RuntimeError, match="input must be bf16 with 8 features"):
        linear(torch.randn(3, 6, dtype=BF16), packed)
    with pytest.raises(RuntimeError, match="must split into 1 shards of a multiple of 16"):
        torch.ops.raypage.pack_panels(torch.randn(24, 8, dtype=BF16))
    with pytest.raises(RuntimeError, match="must hold two shards"):
        torch.ops.raypage.panel_silu_and_mul(torch.randn(3, 8, dtype=BF16), packed)


def test_shapes_the_panel_kernel_cannot_take_get_another_form() -> None:
    odd_outputs = torch.empty(24, 8, dtype=BF16)
    assert best_weight_form(odd_outputs) is not WeightForm.PANELS
    assert best_weight_form(torch.empty(32, 7, dtype=BF16)) is not WeightForm.PANELS
    assert best_weight_form(torch.empty(32, 8, dtype=torch.float16)) is not WeightForm.PANELS
    assert best_weight_form(torch.empty(48, 8, dtype=BF16), shards=2) is not WeightForm.PANELS  # 24 a shard


@pytest.mark.parametrize("form", HALF_FORMS)
def test_tied_lm_head_prepares_a_copy_and_the_embedding_still_looks_up(form: WeightForm) -> None:
    table = torch.randn(64, 32, dtype=BF16)
    embedding = loaded(VocabParallelEmbedding(64, 32, BF16), table)
    head = ParallelLMHead(64, 32, BF16)
    head.tie_to(embedding)
    model = nn.ModuleDict({"embed": embedding, "head": head})
    hidden = torch.randn(5, 32, dtype=BF16)
    with torch.inference_mode():
        reference = (hidden.double() @ table.double().T).to(BF16)
        prepare_linear_weights(model, form)
        assert_one_rounding_from(head.compute_logits(hidden), reference)
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
