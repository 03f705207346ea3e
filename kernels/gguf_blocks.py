"""GGUF weights carried in their file's blocks from the loader to the matmul.

A GGUF projection is rows of whole quantization blocks (32 weights each, 256 for K-quants).
`GGUFBlocks` is such a tensor as read from the file, still in blocks: the loader yields it in place
of a dequantized tensor, and the sharded layers cut it like one (rows for column-parallel layers,
whole blocks of columns for row-parallel ones; a cut through a block is an error). Once a layer
holds all its rows, `BlockLinearWeight` packs them for the quantized kernels
(kernels/quant_linear.py), which multiply by them without ever widening the weight in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from gguf.quants import dequantize

from kernels.quant_linear import QuantizedWeight, embedding_rows, pack_gguf_weight, quantized_linear

# Block formats that gguf dequantizes without lookup grids (the i-quants set theirs up in `dequantize`).
_WHOLE_TENSOR_TYPES = frozenset(
    {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)


@dataclass(frozen=True)
class GGUFBlocks:
    """A 2-D weight [rows, columns] as its GGUF file stores it: `raw` (uint8) holds each row's
    blocks of format `ggml_type`."""

    raw: torch.Tensor  # [rows, bytes a row]
    ggml_type: int
    shape: tuple[int, int]

    @property
    def format(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)][0]

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks:
        """Rows [start, start + length) (dim 0), or those columns (dim 1), which must be whole blocks."""
        rows, columns = self.shape
        if dim == 0:
            return GGUFBlocks(self.raw.narrow(0, start, length), self.ggml_type, (length, columns))
        block = self.block_size
        if start % block or length % block:
            raise ValueError(
                f"columns [{start}, {start + length}) of a {self.format} weight would cut its blocks of "
                f"{block} weights; a tensor-parallel split of a quantized weight must keep them whole"
            )
        bytes_per_block = self.raw.shape[1] * block // columns
        raw = self.raw.narrow(1, start // block * bytes_per_block, length // block * bytes_per_block)
        return GGUFBlocks(raw, self.ggml_type, (rows, length))

    def split(self, sizes: list[int]) -> list[GGUFBlocks]:
        """Consecutive runs of rows, as `torch.Tensor.split` along dim 0."""
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        return [self.narrow(0, start, size) for start, size in zip(starts, sizes, strict=True)]

    def with_rows(self, raw: torch.Tensor) -> GGUFBlocks:
        """The same weight with its rows rearranged (`raw` is a permutation of this one's rows)."""
        return GGUFBlocks(raw, self.ggml_type, self.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight's values in float32, as gguf-py computes them."""
        values = dequantize_blocks(self.raw.contiguous().numpy(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(values).reshape(self.shape)


def dequantize_blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """gguf-py's dequantization of a tensor's bytes (uint8, rows of blocks) to a fresh float32 array."""
    if ggml_type.name in _WHOLE_TENSOR_TYPES:
        # The whole tensor in one numpy pass: gguf's own `dequantize` goes 16 rows at a time, a
        # third of a load's seconds in Python overhead for a small model.
        values = getattr(quants, ggml_type.name).dequantize_rows(raw)
    else:
        values = dequantize(raw, ggml_type)
    return values if values.flags.writeable else values.copy()


class BlockLinearWeight:
    """A linear weight [out_features, in_features] multiplied from GGUF blocks: the rows of each
    run of checkpoint tensors in one format packed together (a fused projection whose parts the file
    stores in different formats, as Q4_K_M files do with Q4_K and Q6_K, keeps a pack for each)."""

    def __init__(self, parts: Sequence[GGUFBlocks]) -> None:
        self.packs: list[QuantizedWeight] = []
        for ggml_type, run in groupby(parts, key=lambda part: part.ggml_type):
            run = list(run)
            raw = torch.cat([part.raw for part in run])
            shape = (sum(part.shape[0] for part in run), run[0].shape[1])
            self.packs.append(pack_gguf_weight(raw, ggml_type, shape))
        self.shape = (sum(pack.shape[0] for pack in self.packs), self.packs[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(pack.nbytes for pack in self.packs)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of an embedding table packed from one tensor, in `dtype`."""
        (pack,) = self.packs
        return embedding_rows(pack, ids, dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.packs) == 1:
            return quantized_linear(x, self.packs[0], bias)
        out = torch.cat([quantized_linear(x, pack) for pack in self.packs], dim=-1)
        return out if bias is None else out + bias
