"""The compute floor's FLOP count against torch's own FLOP counter on a real forward pass (the
projections and the LM head) and a direct sum over positions (attention)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from cluster.bench.compute_floor import linear_flops_per_token, measured_matmul_rate, run_flops
from engine.models.arch_config import ArchConfig
from engine.models.llama import LlamaForCausalLM

ARCH = ArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def test_projection_flops_are_what_torch_counts_in_the_layers() -> None:
    model = LlamaForCausalLM(ARCH, torch.float32)
    tokens = 5
    hidden = torch.randn(tokens, ARCH.hidden_size)
    with FlopCounterMode(display=False) as counter:
        for layer in model.model.layers:
            layer.self_attn.qkv_proj(hidden)
            layer.self_attn.o_proj(hidden)
            layer.mlp.down_proj(layer.mlp.gate_up_proj.silu_and_mul(hidden))
    assert linear_flops_per_token(ARCH) * tokens == counter.get_total_flops()


def test_run_flops_add_the_lm_head_per_sampled_token_and_attention_per_key() -> None:
    prompt, output, sequences = 6, 4, 2
    attention_per_key = 4 * ARCH.num_heads * ARCH.head_dim * ARCH.num_layers
    prefill_keys = sum(p + 1 for p in range(prompt))
    decode_keys = sum(p + 1 for p in range(prompt, prompt + output - 1))
    expected = (
        prompt * linear_flops_per_token(ARCH)
        + prefill_keys * attention_per_key
        + sequences * (output - 1) * linear_flops_per_token(ARCH)
        + sequences * decode_keys * attention_per_key
        + sequences * output * 2 * ARCH.vocab_size * ARCH.hidden_size
    )
    assert run_flops(ARCH, [(prompt, output, sequences)]) == expected


def test_the_matmul_rate_is_a_positive_rate() -> None:
    assert measured_matmul_rate(ARCH, torch.float32) > 0
