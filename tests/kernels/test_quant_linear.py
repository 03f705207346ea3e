"""The quantized linear kernels (kernels/quant_linear.py) against gguf's own dequantization followed by
a float64 matmul, for every block format they read: random weights quantized by gguf, and for the
K-quants, which gguf does not quantize, random blocks.

Tolerances, derived rather than tuned:

- The int8 path (decoding; prefill chunks too where the kernel has no AMX tiles) rounds each
  activation to a multiple of max|x| / 127 over its block of 32, or of 256 for the K-quants (as
  llama.cpp's Q8_K), an error of at most max|x| / 254 per value; so output n of row m is off by at
  most sum over blocks b of (max|x_b| / 254) * sum over i in b of |W[n, i]|. That bound holds for
  every format (the weight's own quantization is in the reference already), and is checked with a
  margin for float32 rounding.
- Float32 rounding: the kernels sum exact products (integer dots, or the float32 matmul of the
  dequantized weight) in another order than the reference, which stays within a few ulps of
  sum |W| |x| per output: 1e-5 of that sum. Activations that are exactly int8 blocks (values
  k * 2^-5, k in -127..127, one of them 127) are quantized without error, so there both paths must
  agree to that float32 bound alone, and so must the prefill path for any activations.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from kernels.build import cpu_kernels_available
from kernels.quant_linear import (
    GEMV_MAX_ROWS,
    QuantizedWeight,
    dequantize,
    embedding_rows,
    gemv_serves,
    pack_gguf_weight,
    panel_matmul,
    quantized_linear,
    supported_ggml_types,
)

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here"
)

FORMATS = [T.Q8_0, T.Q4_1, T.Q4_0, T.Q6_K, T.Q4_K, T.Q5_K]
# Bytes of a K-quant block of 256 and where its float16 scales are.
K_QUANT_BYTES = {T.Q4_K: (144, (0, 2)), T.Q5_K: (176, (0, 2)), T.Q6_K: (210, (208,))}
# (out, in): an output size that is no multiple of the 16-row groups, then SmolLM2-135M's gate (or
# up) and down projections and a slice of its LM head (576 -> 49152). K-quants take rows of whole
# blocks of 256, which 576 is not: for them the same with 512 and 768.
SHAPES = [(67, 128), (1536, 576), (576, 1536), (2064, 576)]
K_SHAPES = [(67, 256), (1536, 512), (576, 1536), (2064, 768)]
ROWS = [1, 3, 16, 21, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1]


def format_shapes(first: int | None = None) -> list:
    """Every format with its shapes (the first `first` of them)."""
    return [
        pytest.param(ggml_type, shape, id=f"{ggml_type.name}-{shape[1]}to{shape[0]}")
        for ggml_type in FORMATS
        for shape in (K_SHAPES if ggml_type in K_QUANT_BYTES else SHAPES)[:first]
    ]


FLOAT32_SLACK = 1e-5  # of sum |W| |x| per output


@functools.cache
def gguf_weight(ggml_type: T, shape: tuple[int, int]) -> tuple[np.ndarray, torch.Tensor]:
    """(raw GGUF blocks, their dequantized float64 values) of a random weight."""
    rng = np.random.default_rng(hash((int(ggml_type), shape)) % 2**32)
    if ggml_type in K_QUANT_BYTES:
        raw = random_k_blocks(rng, ggml_type, shape)
    else:
        raw = gguf_quants.quantize(rng.standard_normal(shape, dtype=np.float32), ggml_type)
    return raw, torch.from_numpy(gguf_quants.dequantize(raw, ggml_type)).double()


def random_k_blocks(rng: np.random.Generator, ggml_type: T, shape: tuple[int, int]) -> np.ndarray:
    """K-quant blocks of random bytes (gguf has no K-quant quantizers): every byte of quants,
    sub-scales and mins is valid as it comes; the float16 scales (Q6_K's d at the end of a block,
    the others' d and dmin at its start) are set to small positive values."""
    block_bytes, scale_offsets = K_QUANT_BYTES[ggml_type]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        scale = rng.uniform(0.5, 1.0, blocks.shape[:2]).astype(np.float16) / np.float16(2048)
        blocks[..., offset : offset + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return blocks.reshape(shape[0], -1)


def packed(ggml_type: T, shape: tuple[int, int]) -> QuantizedWeight:
    raw, _ = gguf_weight(ggml_type, shape)
    return pack_gguf_weight(torch.from_numpy(raw), int(ggml_type), shape)


def activation_bound(x: torch.Tensor, weight: torch.Tensor, ggml_type: T) -> torch.Tensor:
    """The largest error int8 per-block activations can add to x @ weight.T (see the module docstring)."""
    block = 256 if ggml_type in K_QUANT_BYTES else 32
    step = x.double().unflatten(-1, (-1, block)).abs().amax(-1) / 254
    return step @ weight.abs().unflatten(-1, (-1, block)).sum(-1).T


def float32_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return FLOAT32_SLACK * (x.double().abs() @ weight.abs().T)


def int8_blocks(rows: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """Activations each block of which quantizes to int8 without error: k * 2^-5, max |k| = 127."""
    k = torch.randint(-127, 128, (rows, in_features // 32, 32), generator=generator)
    k[..., 0] = 127
    return (k * 2.0**-5).reshape(rows, in_features).float()


@pytest.mark.parametrize(("ggml_type", "shape"), format_shapes())
def test_dequantize_matches_gguf(ggml_type: T, shape: tuple[int, int]) -> None:
    _, reference = gguf_weight(ggml_type, shape)
    torch.testing.assert_close(dequantize(packed(ggml_type, shape)).double(), reference, rtol=0, atol=0)


@pytest.mark.parametrize(("ggml_type", "shape"), format_shapes(first=2))
def test_embedding_rows_match_gguf(ggml_type: T, shape: tuple[int, int]) -> None:
    # Ids in any order and shape, repeated, the last row of a padded group among them.
    _, reference = gguf_weight(ggml_type, shape)
    ids = torch.tensor([[shape[0] - 1, 0, 17], [5, 5, shape[0] // 2]])
    torch.testing.assert_close(
        embedding_rows(packed(ggml_type, shape), ids, torch.float32).double(), reference[ids], rtol=0, atol=0
    )
    bf16 = embedding_rows(packed(ggml_type, shape), ids, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16, reference[ids].to(torch.bfloat16), rtol=0, atol=0)


def test_embedding_id_outside_the_table() -> None:
    with pytest.raises(RuntimeError, match="id 80 outside the table's 80 rows"):
        embedding_rows(packed(T.Q8_0, (67, 256)), torch.tensor([3, 80]), torch.float32)


@pytest.mark.parametrize(("ggml_type", "shape"), format_shapes())
@pytest.mark.parametrize("rows", ROWS)
def test_random_activations_within_their_quantization_bound(
    ggml_type: T, shape: tuple[int, int], rows: int
) -> None:
    _, weight = gguf_weight(ggml_type, shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    error = (quantized_linear(x, packed(ggml_type, shape)).double() - x.double() @ weight.T).abs()
    allowed = float32_bound(x, weight)
    if gemv_serves(rows, x.dtype):
        allowed += activation_bound(x, weight, ggml_type)
    assert (error <= allowed).all(), f"{(error - allowed).max().item()} over the bound"


@pytest.mark.parametrize(("ggml_type", "shape"), format_shapes(first=2))
@pytest.mark.parametrize("rows", ROWS)
def test_int8_activations_exact_up_to_float32_order(ggml_type: T, shape: tuple[int, int], rows: int) -> None:
    _, weight = gguf_weight(ggml_type, shape)
    x = int8_blocks(rows, shape[1], torch.Generator().manual_seed(rows))
    error = (quantized_linear(x, packed(ggml_type, shape)).double() - x.double() @ weight.T).abs()
    assert (error <= float32_bound(x, weight)).all()


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [100, GEMV_MAX_ROWS])
def test_rows_in_several_spans(ggml_type: T, rows: int) -> None:
    """8192 features: the kernel takes 64 rows at a time against all of a thread's weights (their
    int8 quants stay in its L2), the last span partial at 100 rows. Exact int8 activations, so the
    float32 bound holds on either path."""
    shape = (67, 8192)
    _, weight = gguf_weight(ggml_type, shape)
    x = int8_blocks(rows, shape[1], torch.Generator().manual_seed(rows))
    error = (quantized_linear(x, packed(ggml_type, shape)).double() - x.double() @ weight.T).abs()
    assert (error <= float32_bound(x, weight)).all()


@pytest.mark.parametrize("rows", [2, GEMV_MAX_ROWS + 2])  # both paths where AMX tiles serve, even
def test_leading_dims_and_bias(rows: int) -> None:
    shape = (67, 256)
    weight = packed(T.Q4_1, shape)
    x = int8_blocks(rows, shape[1], torch.Generator().manual_seed(0)).reshape(2, rows // 2, shape[1])
    bias = torch.randn(shape[0])
    out = quantized_linear(x, weight, bias)
    assert out.shape == (2, rows // 2, shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out, quantized_linear(x, weight) + bias)


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROWS)
def test_bf16_activations(ggml_type: T, rows: int) -> None:
    """bf16 in, bf16 out. Beyond the float32 bounds, the result is rounded to bf16 (half an ulp,
    2^-9 of it); the prefill path also multiplies by the weight rounded to bf16 panels (2^-9 of
    each |W|)."""
    shape = (576, 1536)
    _, weight = gguf_weight(ggml_type, shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = quantized_linear(x, packed(ggml_type, shape))
    assert out.dtype == torch.bfloat16
    reference = x.double() @ weight.T
    allowed = float32_bound(x, weight) + 2**-9 * reference.abs()
    if gemv_serves(rows, x.dtype):
        allowed += activation_bound(x, weight, ggml_type)
    else:
        allowed += 2**-9 * (x.double().abs() @ weight.abs().T)
    assert ((out.double() - reference).abs() <= allowed).all()


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_panel_path(ggml_type: T, dtype: torch.dtype) -> None:
    """The panels, which prefill chunks take on CPUs with AMX (and other dtypes everywhere):
    float32 panels within float32 rounding, bf16 ones also within the weight's rounding to bf16 (2^-9
    of each |W|); float32 sums either way."""
    shape = (576, 1536)
    _, weight = gguf_weight(ggml_type, shape)
    x = torch.randn(GEMV_MAX_ROWS + 1, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    out = panel_matmul(x, packed(ggml_type, shape))
    assert out.dtype == torch.float32
    allowed = float32_bound(x, weight)
    if dtype == torch.bfloat16:
        allowed += 2**-9 * (x.double().abs() @ weight.abs().T)
    assert ((out.double() - x.double() @ weight.T).abs() <= allowed).all()


@pytest.mark.parametrize(
    ("ggml_type", "bytes_per_weight"),
    [
        (T.Q4_0, 18 / 32),
        (T.Q4_1, 20 / 32),
        (T.Q8_0, 34 / 32),
        (T.Q4_K, (144 + 4) / 256),
        (T.Q5_K, (176 + 4) / 256),
        (T.Q6_K, 210 / 256),
    ],
    ids=lambda value: value.name if isinstance(value, T) else None,
)
def test_packed_bytes(ggml_type: T, bytes_per_weight: float) -> None:
    """The file's bytes, but for Q4_K's and Q5_K's 6-bit sc and m, a byte each (4 more a block of 256)."""
    weight = packed(ggml_type, (576, 1536))
    assert weight.nbytes == 576 * 1536 * bytes_per_weight


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_inf_activations_give_nan(value: float) -> None:
    weight = packed(T.Q4_1, (67, 256))
    x = torch.ones(2, 256)
    x[0, 40] = value
    out = quantized_linear(x, weight)
    assert out[0].isnan().all() and out[1].isfinite().all()


def test_supported_types() -> None:
    assert supported_ggml_types() == {
        int(T.Q4_0): "Q4_0",
        int(T.Q4_1): "Q4_1",
        int(T.Q8_0): "Q8_0",
        int(T.Q4_K): "Q4_K",
        int(T.Q5_K): "Q5_K",
        int(T.Q6_K): "Q6_K",
    }


@pytest.mark.parametrize("ggml_type", [T.F16, T.Q5_0, T.Q3_K], ids=lambda t: t.name)
def test_unsupported_type_is_named(ggml_type: T) -> None:
    with pytest.raises(ValueError, match=f"ggml type {int(ggml_type)} has no quantized CPU kernel"):
        pack_gguf_weight(torch.zeros(64, dtype=torch.uint8), int(ggml_type), (1, 32))


@pytest.mark.parametrize(("ggml_type", "in_features"), [(T.Q8_0, 48), (T.Q6_K, 128)], ids=["Q8_0", "Q6_K"])
def test_input_size_not_whole_blocks(ggml_type: T, in_features: int) -> None:
    block_size = 256 if ggml_type == T.Q6_K else 32
    with pytest.raises(
        ValueError,
        match=rf"{ggml_type.name} weight of shape \(4, {in_features}\).*multiple of the block size {block_size}",
    ):
        pack_gguf_weight(torch.zeros(4 * 51, dtype=torch.uint8), int(ggml_type), (4, in_features))


def test_bytes_not_matching_the_shape() -> None:
    raw, _ = gguf_weight(T.Q4_1, (67, 256))
    with pytest.raises(ValueError, match="takes 10720 uint8 bytes, got 10700"):
        pack_gguf_weight(torch.from_numpy(raw).view(-1)[:-20], int(T.Q4_1), (67, 256))


def test_dequantize_rows_start_at_a_group() -> None:
    with pytest.raises(ValueError, match="must start at a multiple of 16"):
        dequantize(packed(T.Q8_0, (67, 256)), first_row=8, rows=16)


def test_activation_size_mismatch() -> None:
    with pytest.raises(ValueError, match="x ends in 96 features, the weight takes 256"):
        quantized_linear(torch.zeros(1, 96), packed(T.Q8_0, (67, 256)))
