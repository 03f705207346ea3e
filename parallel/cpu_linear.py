"""Linear weights prepared once at load for this CPU's fastest bf16 and fp16 matmul.

Which matmul is fastest depends on the CPU, and each way wants the weight in another form:

- **oneDNN prepacked** where oneDNN computes in the weight's own dtype (AVX-512 BF16, AMX,
  AVX512-FP16). `F.linear` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout at
  every call; for the small batches of decoding that reorder costs as much as the matmul. Reordering
  once at load time (what inductor's freezing does) leaves only the matmul, bit for bit the same.
- **Widened to float32** where it does not (AVX2 machines such as AMD Zen 3). There torch's bf16
  matmul falls back to a generic kernel about ten times slower than float32 sgemm (64 rows × 576 →
  3,072 on two threads: 20.5 ms against 2.0 ms). The weight is kept in float32 (twice its memory),
  each call widens the activations and rounds the product back to their dtype. A product of two
  bf16 (or fp16) values is exact in float32, and the fallback accumulates in float32 too, so the
  results differ from it only by the order of the float32 additions.
- float32 weights, and every weight off the CPU, stay as they are.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.bfloat16, torch.float16)


class WeightForm(Enum):
    """How a linear weight is kept for the matmul at every call."""

    PLAIN = "plain"
    ONEDNN_PREPACKED = "onednn_prepacked"
    WIDENED = "float32"


def _onednn_computes_in(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def best_weight_form(weight: torch.Tensor) -> WeightForm:
    """The form in which this machine multiplies by `weight` ([out, in]) fastest."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in HALF_DTYPES:
        return WeightForm.PLAIN
    return WeightForm.ONEDNN_PREPACKED if _onednn_computes_in(weight.dtype) else WeightForm.WIDENED


def prepare_weight(weight: torch.Tensor, form: WeightForm) -> torch.Tensor:
    """`weight` in `form`: an opaque oneDNN tensor that only `linear` reads, a float32 copy, or itself."""
    weight = weight.detach()
    if form is WeightForm.ONEDNN_PREPACKED:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    if form is WeightForm.WIDENED:
        return weight.float()
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b in x's dtype, for a weight in any of `prepare_weight`'s forms."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dtype != x.dtype:  # a widened weight: compute in float32, round once at the end
        return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)
