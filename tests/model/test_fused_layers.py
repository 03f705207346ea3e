"""Decoder layers fused into one C++ call each (engine/models/fused_layers.py) produce exactly the
tokens and log-probabilities of the layer-by-layer forward, through chunked prefills, prefix hits
and decodes batched together, with weights in bf16 panels or in GGUF blocks, and are fused only where
every operator has its CPU kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import LLM, SamplingParams
from kernels.attention.cpu_paged import amx_serves, tiled_serves
from kernels.build import cpu_kernels_available
from kernels.linear import panel_kernel_serves
from tests.model.tiny_gguf import write_gguf
from tests.model.tiny_models import write_tiny_model

needs_panels = pytest.mark.skipif(
    not panel_kernel_serves(), reason="the fused layer's kernels need AVX-512 BF16 without AMX"
)


def _bf16_cache(num_kv_heads: int) -> torch.Tensor:
    return torch.empty(2, num_kv_heads, 0, 16, 64, dtype=torch.bfloat16)


def attention_fuses(num_heads: int, num_kv_heads: int) -> bool:
    """Whether a fused layer's attention runs here for head_dim 64 over a bf16 cache of blocks of 16,
    prefill rows included."""
    if not cpu_kernels_available():
        return False
    query = torch.empty(0, num_heads, 64, dtype=torch.bfloat16)
    cache = _bf16_cache(num_kv_heads)
    return tiled_serves(query, cache) and not amx_serves(cache)


def gguf_layers_fuse(num_kv_heads: int) -> bool:
    """Whether a layer in GGUF blocks is fused here (its decode rows, at least): the kernels are
    built and AMX does not attend."""
    return cpu_kernels_available() and not amx_serves(_bf16_cache(num_kv_heads))


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


def small_bf16_llm(model: Path, max_num_batched_tokens: int) -> LLM:
    """bf16, 64 blocks of 16 tokens, up to 4 sequences a step."""
    return LLM(
        str(model),
        dtype="bfloat16",
        num_kv_blocks=64,
        block_size=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=4,
    )


def generate(llm: LLM) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in outputs]


@needs_panels
@pytest.mark.parametrize("family", ["llama", "qwen2"], ids=["llama", "qwen2-qkv-bias"])
def test_fused_layers_compute_what_the_layer_by_layer_forward_does(tmp_path, family):
    # head_dim 64 and a GQA group of 3, a shape the tiled prefill kernel is built for.
    folder = write_tiny_model(
        tmp_path / "model", family=family, hidden_size=192, intermediate_size=256, num_heads=3, num_kv_heads=1
    )
    llm = small_bf16_llm(folder, max_num_batched_tokens=48)
    layers = decoder_layers(llm)
    assert all(layer.fused is not None for layer in layers)
    fused = generate(llm)
    for layer in layers:
        layer.fused = None
    assert llm.reset_prefix_cache()
    assert generate(llm) == fused


@needs_panels
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


@needs_panels
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


def _by_format(name: str) -> Q | None:
    """The formats gguf-py writes; v in Q8_0 beside q and k in Q4_1, so the QKV projection holds two
    packs, multiplied side by side."""
    if name.endswith(("v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return Q.Q8_0
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return Q.Q4_1
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return Q.Q4_0
    return None


@pytest.mark.skipif(not gguf_layers_fuse(1), reason="AMX attends here, or no C++ kernels")
def test_layers_in_gguf_blocks_fused_compute_what_the_layer_by_layer_forward_does(tmp_path):
    # head_dim 64 and a GQA group of 4, a shape the tiled prefill kernel is built for. Steps up to
    # GEMV_MAX_ROWS (128) tokens run fused; the 150-token prompt's first chunk runs layer by layer
    # in both runs. Without the tiled kernel (AVX2) only steps of decode rows alone run fused.
    folder = write_tiny_model(
        tmp_path / "model", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=1
    )
    config = json.loads((folder / "config.json").read_text())
    path = write_gguf(folder, config, tmp_path / "model.gguf", _by_format)
    llm = small_bf16_llm(path, max_num_batched_tokens=160)
    try:
        layers = decoder_layers(llm)
        assert all(layer.fused is not None and layer.fused.max_tokens == 128 for layer in layers)
        assert len(layers[0].fused.qkv[1]) == 4  # two packs: (Q4_1, 320 rows), (Q8_0, 64 rows)
        prompts = [*PROMPTS, list(range(2000, 2150))]

        def generate_counting_rows() -> tuple[list, dict[str, list[int]]]:
            """The tokens and logprobs, and the rows (tokens) of each call of the fused layer and of
            the layers' RMS norms."""
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
            with torch.profiler.profile(record_shapes=True) as profile:
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            rows: dict[str, list[int]] = {
                "raypage::llama_decoder_layer": [],
                "raypage::fused_add_rms_norm": [],
            }
            for event in profile.events():
                if event.name in rows:
                    rows[event.name].append(event.input_shapes[0][0])
            return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in outputs], rows

        fused, fused_rows = generate_counting_rows()
        for layer in layers:
            layer.fused = None
        assert llm.reset_prefix_cache()
        plain, plain_rows = generate_counting_rows()
    finally:
        llm.llm_engine.shutdown()
    assert fused == plain
    fused_layer_rows = fused_rows["raypage::llama_decoder_layer"]
    assert fused_layer_rows and max(fused_layer_rows) <= (128 if attention_fuses(4, 1) else len(prompts))
    assert not plain_rows["raypage::llama_decoder_layer"]
    # The long chunk, layer by layer in both runs.
    assert (
        max(fused_rows["raypage::fused_add_rms_norm"]) == max(plain_rows["raypage::fused_add_rms_norm"]) > 128
    )
