"""Which checkpoint tensors the quantized kernels multiply by, and `quantization="int8"`.

The attention and MLP projections, the LM head and the embedding (an LM head tied to it multiplies
by its blocks) are the tensors kept in blocks: a GGUF file's as it stores them
(engine/models/gguf_loader.py), and with `quantization="int8"` any checkpoint's float tensors
quantized at load into int8 blocks.

The int8 blocks are GGUF's Q8_0 layout: each run of 32 weights of a row has its own scale
(max |w| / 127, stored as float16) and its weights rounded to int8. So the same packed kernels
(kernels/quant_linear.py) multiply by them, with the activations quantized to int8 per block of 32
as well (W8A8). A scale per block of 32 rather than vLLM's one per output channel: finer steps where
a row's magnitudes vary along it, for 1/16 of a byte a weight more, and one kernel for both.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.gguf_blocks import GGUFBlocks

logger = logging.getLogger(__name__)

KEPT_IN_BLOCKS = re.compile(r"(_proj|^lm_head|^model\.embed_tokens)\.weight$")

Q8_0 = GGMLQuantizationType.Q8_0
INT8_BLOCK = GGML_QUANT_SIZES[Q8_0][0]


def int8_blocks(weight: torch.Tensor) -> GGUFBlocks:
    """A 2-D weight whose rows are whole blocks of 32, quantized as ggml's Q8_0 (the same bytes as
    `gguf.quants.quantize(weight, Q8_0)`)."""
    rows, columns = weight.shape
    blocks = weight.float().reshape(rows, columns // INT8_BLOCK, INT8_BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    scaled = blocks * torch.where(scale == 0, 0.0, 1.0 / scale)
    # ggml's rounding, halves away from zero, in its own steps: floor(|x| + 0.5) can round up a
    # value just below one half once the sum is rounded to float32.
    magnitude = scaled.abs()
    whole = magnitude.floor()
    quants = (scaled.sign() * (whole + (2 * (magnitude - whole)).floor())).to(torch.int8)
    raw = torch.cat([scale.half().view(torch.uint8), quants.view(torch.uint8)], dim=-1)
    return GGUFBlocks(raw.reshape(rows, -1), int(Q8_0), (rows, columns))


def quantize_to_int8(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with every float tensor kept in blocks quantized to int8 blocks; a
    GGUF file's blocks pass as they are, and a weight whose rows are not whole blocks of 32 stays in
    its dtype."""
    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor) and KEPT_IN_BLOCKS.search(name) and tensor.dim() == 2:
            if tensor.shape[1] % INT8_BLOCK == 0:
                tensor = int8_blocks(tensor)
            else:
                logger.warning(
                    "quantization int8: %s has rows of %d, not whole blocks of %d: kept in %s",
                    name,
                    tensor.shape[1],
                    INT8_BLOCK,
                    tensor.dtype,
                )
        yield name, tensor
