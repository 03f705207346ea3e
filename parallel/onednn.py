"""Linear layers on oneDNN's prepacked weights, for bf16 and fp16 on the CPU.

`F.linear` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout at every call;
for the small batches of decoding that reorder costs as much as the matmul itself. Reordering once
at load time (what inductor's freezing does) leaves only the matmul. The results are the same
oneDNN kernel's, bit for bit. float32 stays on `F.linear` (MKL's sgemm), which has no such cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether this machine's oneDNN can run `weight` prepacked (a bf16/fp16 CPU matrix)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if weight.dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) reordered into oneDNN's layout; an opaque tensor only `linear` reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, for a plain weight or one from `prepack_weight`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
