"""Linear weights prepared once at load for this CPU's fastest bf16 and fp16 matmul.

Which matmul is fastest depends on the CPU, and each way wants the weight in another form:

- **Packed in panels** for raypage's own kernel (`kernels/csrc/panel_gemm.cpp`) where the CPU
  multiplies bf16 pairs natively (AVX-512 BF16) but has no AMX, such as AMD's Zen 4 and Zen 5. There
  it runs SmolLM2's projections faster than oneDNN's brgemm at decode batch sizes, with weights
  streamed from memory, and level or faster at prefill sizes (`python -m benchmarks.bench_linear`;
  docs/performance.md). The packed weight is a bf16 tensor of shape [shards, out / 16, in / 2, 32]
  whose values only the kernel reads; bf16 weights whose output size splits into shards of a multiple of 16 and
  whose input size is even. A fused gate and up projection is packed as two shards, so that one
  kernel call computes SiLU(gate) * up without writing either projection out (`silu_and_mul_linear`).
- **oneDNN prepacked** where oneDNN computes in the weight's own dtype otherwise (AMX, where its tile
  matmuls are several times faster than any `vdpbf16ps` loop, and AVX512-FP16 for fp16). `F.linear`
  on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout at every call; for the small
  batches of decoding that reorder costs as much as the matmul. Reordering once at load time (what
  inductor's freezing does) leaves only the matmul, bit for bit the same.
- **Widened to float32** where neither computes in the weight's dtype (AVX2 machines such as AMD
  Zen 3). There torch's bf16 matmul falls back to a generic kernel many times slower than float32
  sgemm (docs/performance.md, "On an AVX2 machine"). The weight is kept
  in float32 (twice its memory), each call widens the activations and rounds the product back to
  their dtype.
- float32 weights, and every weight off the CPU, stay as they are.

Every form computes each output as a float32 sum of exact products of the bf16 (or fp16) values,
rounded to the activations' dtype once, so they differ from one another only by the order of the
float32 additions.
"""

from __future__ import annotations

import functools
from enum import Enum

import torch
import torch.nn.functional as F

from kernels.build import cpu_kernels_available
from kernels.fused_ops import silu_and_mul
from kernels.gguf_blocks import BlockLinearWeight

HALF_DTYPES = (torch.bfloat16, torch.float16)
_PANEL_COLUMNS = 16  # the packed form's output sizes come in multiples of one vector of 16 floats


class WeightForm(Enum):
    """How a linear weight is kept for the matmul at every call."""

    PLAIN = "plain"
    PANELS = "panels"
    ONEDNN_PREPACKED = "onednn_prepacked"
    WIDENED = "float32"


@functools.cache
def panel_kernel_serves() -> bool:
    """Whether the panel kernel is built here (AVX-512 BF16 without AMX, kernels compiled)."""
    return cpu_kernels_available() and torch.ops.raypage.panel_linear_serves()


def onednn_computes_in(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN multiplies `dtype` (bf16 or fp16) natively."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def best_weight_form(weight: torch.Tensor, shards: int = 1) -> WeightForm:
    """The form in which this machine multiplies by `weight` ([out, in], `shards` blocks of rows
    stacked: a fused projection's parts) fastest."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in HALF_DTYPES:
        return WeightForm.PLAIN
    out_features, in_features = weight.shape
    if (
        weight.dtype == torch.bfloat16
        and out_features % (shards * _PANEL_COLUMNS) == 0
        and in_features % 2 == 0
        and panel_kernel_serves()
    ):
        return WeightForm.PANELS
    return WeightForm.ONEDNN_PREPACKED if onednn_computes_in(weight.dtype) else WeightForm.WIDENED


def prepare_weight(weight: torch.Tensor, form: WeightForm, shards: int = 1) -> torch.Tensor:
    """`weight` in `form`: packed panels (each of `shards` blocks of rows on its own) or an opaque
    oneDNN tensor that only `linear` reads, a float32 copy, or itself."""
    weight = weight.detach()
    if form is WeightForm.PANELS:
        return torch.ops.raypage.pack_panels(weight.contiguous(), shards)
    if form is WeightForm.ONEDNN_PREPACKED:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    if form is WeightForm.WIDENED:
        return weight.float()
    return weight


def linear(
    x: torch.Tensor, weight: torch.Tensor | BlockLinearWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T + b in x's dtype, for a weight in any of `prepare_weight`'s forms or in GGUF blocks."""
    if isinstance(weight, BlockLinearWeight):
        return weight.linear(x, bias)
    if weight.dim() == 4:  # packed panels
        return torch.ops.raypage.panel_linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dtype != x.dtype:  # a widened weight: compute in float32, round once at the end
        return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor | BlockLinearWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of the projection x W^T + b = [gate | up] ([..., 2d] -> [..., d]). With W in
    panels of two shards and no bias, one kernel call whose epilogue applies the SiLU and the product,
    rounding where `silu_and_mul` does; otherwise the projection, then `silu_and_mul`."""
    if isinstance(weight, torch.Tensor) and weight.dim() == 4 and weight.shape[0] == 2 and bias is None:
        return torch.ops.raypage.panel_silu_and_mul(x, weight)
    return silu_and_mul(linear(x, weight, bias))
