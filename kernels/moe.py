"""A mixture-of-experts block's routing and its experts' gated MLPs, for all tokens in one call.

`select_experts` turns router logits into each token's top-k experts and their weights;
`fused_experts` runs every token through its experts and sums the results by those weights. The
experts' weights are stacked: w13 [E, 2I, H] (each expert's gate rows over its up rows) and
w2 [E, H, I]. A call may hold only some of the model's experts (expert parallelism): those from
`first_expert` on; pairs routed to others add nothing, another rank adds them.

Three implementations, one contract: the C++ kernel on the CPU (kernels/csrc/moe.cpp: the pairs
grouped by expert, one pass over the experts' weights spread over the threads), a Triton grouped
GEMM on CUDA (kernels/triton_moe.py), and `fused_experts_torch`, a plain per-expert loop that runs
where neither does and is the tests' oracle. Each rounds where the torch loop rounds: every
projection to the activations' dtype, SiLU and the product as `silu_and_mul`, the weighted sum in
float32 rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.build import cpu_kernels_available

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def select_experts(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """(weights float32 [T, top_k], expert ids int64 [T, top_k]): the softmax over all experts in
    float32, its top k, rescaled to sum to one where `renormalize` (Mixtral; Qwen3-MoE's
    norm_topk_prob), as transformers' routers do."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    hidden: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    first_expert: int = 0,
) -> Tensor:
    """sum_k topk_weights[t, k] * w2[e] (silu(gate_e x_t) * up_e x_t) for each token t, e its k-th
    expert less `first_expert` (experts outside w13's are skipped), in hidden's dtype [T, H]."""
    if hidden.is_cuda:
        from kernels.triton_moe import triton_fused_experts  # imports triton: CUDA only

        return triton_fused_experts(hidden, topk_weights, topk_ids, w13, w2, first_expert)
    if hidden.dtype in _KERNEL_DTYPES and w13.dtype == hidden.dtype and cpu_kernels_available():
        return torch.ops.raypage.moe_experts(
            hidden.contiguous(),
            topk_ids.long().contiguous(),
            topk_weights.float().contiguous(),
            w13.contiguous(),
            w2.contiguous(),
            first_expert,
        )
    return fused_experts_torch(hidden, topk_weights, topk_ids, w13, w2, first_expert)


def fused_experts_torch(
    hidden: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    first_expert: int = 0,
) -> Tensor:
    """`fused_experts` as a loop over the experts in plain torch (the oracle: no raypage kernel)."""
    num_tokens, top_k = topk_ids.shape
    local = (topk_ids - first_expert).flatten()
    held = (local >= 0) & (local < w13.shape[0])
    down = hidden.new_zeros(num_tokens * top_k, hidden.shape[-1])
    counts = torch.bincount(local[held], minlength=w13.shape[0])
    for expert in counts.nonzero().flatten().tolist():
        pairs = (local == expert).nonzero().flatten()
        gate, up = F.linear(hidden[pairs // top_k], w13[expert]).chunk(2, dim=-1)
        down[pairs] = F.linear(F.silu(gate) * up, w2[expert])
    weights = torch.where(held, topk_weights.flatten().float(), 0.0)
    combined = (down.float() * weights[:, None]).view(num_tokens, top_k, -1).sum(dim=1)
    return combined.to(hidden.dtype)
