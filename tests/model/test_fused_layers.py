"""Decoder layers fused into one C++ call each (engine/models/fused_layers.py) produce exactly the
tokens and log-probabilities of the layer-by-layer forward, through chunked prefills, prefix hits
and decodes batched together, and are fused only where every operator has its CPU kernel."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.linear import panel_kernel_serves
from tests.model.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(
    not panel_kernel_serves(), reason="the fused layer's kernels need AVX-512 BF16 without AMX"
)

# 60 and 100 tokens take several chunks of 48; the last prompt repeats the second's first 48 tokens
# (three whole blocks: a prefix hit).
PROMPTS = [
    [5, 17, 300, 42],
    list(range(100, 160)),
    list(range(1000, 1100)),
    [7],
    [*range(100, 148), 9, 9],
]


def decoder_layers(llm: LLM) -> list:
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    return list(runner.model.model.stage_layers)


def generate(llm: LLM) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in outputs]


@pytest.mark.parametrize("family", ["llama", "qwen2"], ids=["llama", "qwen2-qkv-bias"])
def test_fused_layers_compute_what_the_layer_by_layer_forward_does(tmp_path, family):
    # head_dim 64 and a GQA group of 3, a shape the tiled prefill kernel is built for.
    folder = write_tiny_model(
        tmp_path / "model", family=family, hidden_size=192, intermediate_size=256, num_heads=3, num_kv_heads=1
    )
    llm = LLM(
        str(folder),
        dtype="bfloat16",
        num_kv_blocks=64,
        block_size=16,
        max_num_batched_tokens=48,
        max_num_seqs=4,
    )
    layers = decoder_layers(llm)
    assert all(layer.fused is not None for layer in layers)
    fused = generate(llm)
    for layer in layers:
        layer.fused = None
    assert llm.reset_prefix_cache()
    assert generate(llm) == fused


def test_fused_layers_take_cascade_attention_as_the_layer_by_layer_forward_does(tmp_path):
    # 20 prompts sharing 144 tokens (9 blocks) of prefix: their decodes attend to it together.
    folder = write_tiny_model(
        tmp_path / "model", hidden_size=192, intermediate_size=256, num_heads=3, num_kv_heads=1
    )
    llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=256, block_size=16, max_num_seqs=32)
    prompts = [{"prompt_token_ids": [*range(200, 344), 7 * i, 3]} for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def generate_counting_cascades():
        with torch.profiler.profile() as profile:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        calls = sum(e.count for e in profile.key_averages() if e.key == "raypage::cascade_decode_attention")
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], calls

    fused, fused_cascades = generate_counting_cascades()
    for layer in decoder_layers(llm):
        layer.fused = None
    assert llm.reset_prefix_cache()
    plain, plain_cascades = generate_counting_cascades()
    assert fused == plain
    assert fused_cascades == plain_cascades > 0


def test_layers_whose_operators_lack_a_kernel_stay_unfused(tmp_path):
    folder = write_tiny_model(tmp_path / "model", hidden_size=192, num_heads=3, num_kv_heads=1)
    # float32 weights stay plain, not in panels; head_dim 16 has no tiled prefill kernel.
    assert not any(
        layer.fused for layer in decoder_layers(LLM(str(folder), dtype="float32", num_kv_blocks=16))
    )
    # The fused call's shapes in bf16, but over an int8 cache, which only the int8 path reads.
    int8 = LLM(str(folder), dtype="bfloat16", kv_cache_dtype="int8", num_kv_blocks=16)
    assert not any(layer.fused for layer in decoder_layers(int8))
    small_heads = write_tiny_model(tmp_path / "small", num_heads=4, num_kv_heads=2)
    assert not any(
        layer.fused for layer in decoder_layers(LLM(str(small_heads), dtype="bfloat16", num_kv_blocks=16))
    )
