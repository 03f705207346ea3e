"""Linear layers computed from GGUF quantized weights as they are, on the CPU (kernels/csrc/quant_linear.cpp).

A GGUF model's weights are blocks of 32 small integers with a float16 scale (and for Q4_1 a float16
minimum; K-quants: 256 with a float16 scale, and 6- or 8-bit sub-scales and mins). Widening them to bf16 at load costs 3.5x the memory of Q4_1 and, as decoding is bound by
the weight bytes each step reads, about as much time. Here they stay quantized:

- `pack_gguf_weight` repacks a weight's blocks once at load, 16 output rows interleaved so that one
  vector instruction multiplies 4 quants of 16 rows by 4 activation values (the C++ file describes
  the layout); it takes as many bytes as the file (Q4_K and Q5_K 2.8% and 2.3% more: their 6-bit
  sub-scales and mins a byte each).
- `quantized_linear` multiplies by it. On the int8 path (`gemv_serves`: decoding, and prefill
  chunks too but where the kernel runs on AMX tiles) the activations are quantized to int8 in
  blocks of 32, as llama.cpp does, with a float32 scale per block (per 256 values for the K-quants,
  llama.cpp's Q8_K, so that the sub-blocks' integer dots add up before any float), and every output
  is a sum of exact integer dot products times the two scales: the weight is streamed from memory
  once for all the rows (a span of rows at a time). Otherwise (`panel_matmul`) panels of the weight are dequantized, to
  bf16 for bf16 activations and to float32 otherwise, and multiplied with torch's matmul: the
  dequantized weight's product up to summation order (and bf16's rounding of the weight).

The int8 path's only error beyond float32 rounding is the activations' int8 rounding: at most
half a step of max|x| / 127 per value, the maximum taken over its block of 32 (256 for K-quants).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.build import cpu_kernels_available

# The formats the kernels read: name -> (ggml's type id as in gguf.GGMLQuantizationType, weights
# per block, bytes per block).
_FORMATS = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
_NAMES = {ggml_type: name for name, (ggml_type, _, _) in _FORMATS.items()}
# Rows up to which the int8 dot-product kernel on AMX tiles is faster than bf16 panels and torch's
# matmul on AMX: timed one against the other on a Xeon, two threads, Q4_1 2048 -> 2048, they break
# even at 128 rows (2.4 ms and 2.3 ms), the kernel is 1.5x faster at 64 and 4x at 16. Without AMX
# the kernel (AVX-512 VNNI) is the faster at any number of rows: on a Zen 4 EPYC, two threads,
# Q4_K 2048 <-> 8192 at 512 and 2048 rows, 1.2-1.3x the panels' speed (AVX-512 BF16).
GEMV_MAX_ROWS = 128
# A dequantized panel: about the two cores' L2 (2 MiB each here), and never narrower than 256 rows,
# below which torch's matmul runs far slower on long rows (8192 -> 2048: 64 rows took 6x as long).
_PANEL_BYTES = 4 << 20
_MIN_PANEL_ROWS = 256
_GROUP_ROWS = 16  # the packed layout's rows per group; panels start at group boundaries


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight [out_features, in_features] kept in a GGUF block format, packed for the kernels.

    `quants` (uint8) and `scales` (float16) are the layout of kernels/csrc/quant_linear.cpp: only its
    ops read them. `format` is ggml's name of the block format (e.g. "Q4_1").
    """

    format: str
    shape: tuple[int, int]
    quants: torch.Tensor
    scales: torch.Tensor

    @property
    def ggml_type(self) -> int:
        return _FORMATS[self.format][0]

    @property
    def nbytes(self) -> int:
        """Bytes the kernels read for one product: the weight's whole packed form."""
        return self.quants.nbytes + self.scales.nbytes


def supported_ggml_types() -> dict[int, str]:
    """ggml type id -> name of every block format `pack_gguf_weight` takes."""
    return dict(_NAMES)


def pack_gguf_weight(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> QuantizedWeight:
    """Repack a weight's GGUF blocks (uint8, as stored in the file: each of the `shape[0]` rows
    whole blocks of 32 weights, 256 for K-quants) for `quantized_linear`. ValueError for a format
    the kernels do not read, a row length that is not whole blocks, or bytes that do not match the
    shape."""
    name = _NAMES.get(int(ggml_type))
    if name is None:
        raise ValueError(
            f"ggml type {ggml_type} has no quantized CPU kernel; supported: "
            + ", ".join(f"{n} ({t})" for t, n in _NAMES.items())
        )
    _, block_size, block_bytes = _FORMATS[name]
    out_features, in_features = shape
    if out_features <= 0 or in_features <= 0 or in_features % block_size:
        raise ValueError(
            f"{name} weight of shape {tuple(shape)}: the input size must be a positive multiple "
            f"of the block size {block_size}"
        )
    expected = out_features * in_features // block_size * block_bytes
    if raw.dtype != torch.uint8 or raw.numel() != expected:
        raise ValueError(
            f"{name} weight of shape {tuple(shape)} takes {expected} uint8 bytes, got {raw.numel()} of {raw.dtype}"
        )
    _require_kernels()
    quants, scales = torch.ops.raypage.quant_pack(
        raw.contiguous().view(-1), _FORMATS[name][0], out_features, in_features
    )
    return QuantizedWeight(name, (out_features, in_features), quants, scales)


def dequantize(
    weight: QuantizedWeight,
    first_row: int = 0,
    rows: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows [first_row, first_row + rows) of the weight as gguf.quants.dequantize gives them, in
    float32 or rounded to bf16; first_row a multiple of 16 (the packed groups). A transposed view:
    the kernel writes each group's rows as adjacent columns."""
    rows = weight.shape[0] - first_row if rows is None else rows
    if first_row < 0 or first_row % _GROUP_ROWS or rows < 0 or first_row + rows > weight.shape[0]:
        raise ValueError(
            f"rows [{first_row}, {first_row + rows}) of {weight.shape[0]}: they must start at a multiple of {_GROUP_ROWS}"
        )
    out = torch.empty(weight.shape[1], rows, dtype=dtype)
    torch.ops.raypage.quant_dequantize(weight.quants, weight.scales, weight.ggml_type, first_row, out)
    return out.T


def embedding_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape, int64) of the weight in float32 or bf16 as `dequantize` gives them:
    an embedding's lookups, shape [*ids.shape, in_features]."""
    _require_kernels()
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(flat.shape[0], weight.shape[1], dtype=dtype)
    torch.ops.raypage.quant_embedding(weight.quants, weight.scales, weight.ggml_type, flat, out)
    return out.reshape(*ids.shape, weight.shape[1])


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) for x of any leading dims ending in in_features, float32 or bf16 (other
    float dtypes take the panel path); the result has x's dtype, rounded to it once."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"x ends in {x.shape[-1]} features, the weight takes {in_features}")
    rows = x.reshape(-1, in_features)
    if gemv_serves(rows.shape[0], x.dtype):
        out = torch.ops.raypage.quant_gemv(
            rows, weight.quants, weight.scales, weight.ggml_type, out_features, bias
        )
    else:
        out = panel_matmul(rows, weight)
        if bias is not None:
            out += bias
        out = out.to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


def gemv_serves(rows: int, dtype: torch.dtype) -> bool:
    """Whether `quantized_linear` takes the int8 path for `rows` rows of `dtype` activations:
    float32 or bf16, and at most GEMV_MAX_ROWS rows where the kernel runs on AMX tiles."""
    return dtype in (torch.float32, torch.bfloat16) and (rows <= GEMV_MAX_ROWS or not _gemv_uses_tiles())


@functools.cache
def _gemv_uses_tiles() -> bool:
    return torch.ops.raypage.quant_gemv_uses_tiles()


def panel_matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, in] @ weight.T in float32, one dequantized panel of rows at a time: only a panel is
    ever widened, into one buffer that is still in cache when the matmul reads it. bf16 activations
    get bf16 panels (the CPU's bf16 matmul, AMX where it has it, with float32 sums): the weight's
    values rounded to bf16, no more error than the result's own rounding to bf16."""
    out_features, in_features = weight.shape
    dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    x = x.to(dtype)
    panel_rows = _PANEL_BYTES // (in_features * dtype.itemsize) // _GROUP_ROWS * _GROUP_ROWS
    panel_rows = min(max(panel_rows, _MIN_PANEL_ROWS), out_features)
    panel = torch.empty(in_features, panel_rows, dtype=dtype)  # transposed rows
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    for first in range(0, out_features, panel.shape[1]):
        columns = panel[:, : min(panel.shape[1], out_features - first)]
        torch.ops.raypage.quant_dequantize(weight.quants, weight.scales, weight.ggml_type, first, columns)
        out[:, first : first + columns.shape[1]] = torch.mm(x, columns)
    return out


def _require_kernels() -> None:
    if not cpu_kernels_available():
        raise RuntimeError(
            "the quantized linear kernels need raypage's C++ CPU kernels, which are not built here"
        )
