"""How close a run came to the machine's compute floor.

The floor is the run's arithmetic (FLOPs from the model's shapes: the projections, the LM head
of each sampled token and attention over each token's context) done at this machine's best
measured matmul rate, in the engine's dtype, through the same linear path the model uses, on
torch's intra-op threads. Nothing in the forward pass can run faster than that, so the share says
how much of the time went to everything else: attention's memory traffic, elementwise operators,
Python, scheduling.
"""

from __future__ import annotations

import time

import torch

from engine.models.arch_config import ArchConfig
from kernels.linear import best_weight_form, linear, prepare_weight

# The timed matmul: a prefill-sized batch through the widest projection (gate and up).
RATE_ROWS = 512
RATE_REPEATS = 20


def linear_flops_per_token(arch: ArchConfig) -> int:
    """2 × the weights of every layer's projections (QKV, output, gate/up, down)."""
    h, d = arch.hidden_size, arch.head_dim
    per_layer = (
        h * (arch.num_heads + 2 * arch.num_kv_heads) * d
        + arch.num_heads * d * h
        + h * 2 * arch.intermediate_size
        + arch.intermediate_size * h
    )
    return 2 * per_layer * arch.num_layers


def run_flops(arch: ArchConfig, requests: list[tuple[int, int, int]]) -> int:
    """FLOPs of a run of (prompt tokens, output tokens, sequences per prompt) requests.

    The prompt is computed once; each of its sequences then feeds back all but its last token. A
    token at position p attends over p + 1 keys: 4 × heads × head_dim FLOPs per key and layer.
    """
    per_token = linear_flops_per_token(arch)
    lm_head = 2 * arch.vocab_size * arch.hidden_size
    attention = 4 * arch.num_heads * arch.head_dim * arch.num_layers

    def attended_keys(first: int, last: int) -> int:  # sum of p + 1 over positions first..last-1
        return (last * (last + 1) - first * (first + 1)) // 2

    total = 0
    for prompt, output, sequences in requests:
        total += prompt * per_token + attention * attended_keys(0, prompt)
        fed_back = output - 1
        total += sequences * (
            fed_back * per_token + output * lm_head + attention * attended_keys(prompt, prompt + fed_back)
        )
    return total


def measured_matmul_rate(arch: ArchConfig, dtype: torch.dtype) -> float:
    """Best FLOP/s of the model's widest projection on a prefill-sized batch, on this machine now."""
    weight = torch.randn(2 * arch.intermediate_size, arch.hidden_size).to(dtype)
    weight = prepare_weight(weight, best_weight_form(weight))
    x = torch.randn(RATE_ROWS, arch.hidden_size).to(dtype)
    best = float("inf")
    with torch.inference_mode():
        linear(x, weight)  # the first call pays for kernel selection
        for _ in range(RATE_REPEATS):
            start = time.perf_counter()
            linear(x, weight)
            best = min(best, time.perf_counter() - start)
    return 2 * RATE_ROWS * arch.hidden_size * 2 * arch.intermediate_size / best
