"""`quantization="int8"`: a bf16 checkpoint's projections quantized at load into int8 blocks.

The bytes are those of gguf-py's own Q8_0 quantization of the same weights; SmolLM2's weights
written as a Hugging Face checkpoint and served from them pick the dense bf16 model's next token at
95% of positions or more, from projections of about half the bf16 bytes; int8 where the kernels
cannot run is an error naming the setting.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import save_file

from engine import LLM
from engine.models.quantized_weights import int8_blocks
from kernels.build import cpu_kernels_available
from kernels.gguf_blocks import BlockLinearWeight
from tests.model.next_token_checks import INT8_PATH_STEPS, greedy_sequences, top_tokens
from tests.model.test_hf_parity import PROMPTS
from tests.model.tiny_models import write_tiny_model


def test_int8_blocks_are_gguf_q8_0_bytes():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 256, generator=generator).to(torch.bfloat16)
    weight[3, :32] = 0  # a block of zeros: scale 0, quants 0
    weight[5, :32] = torch.arange(32) - 16.5  # exact halves after scaling: ggml rounds them away from zero
    blocks = int8_blocks(weight)
    expected = quants.quantize(weight.float().numpy(), GGMLQuantizationType.Q8_0)
    assert blocks.shape == (48, 256) and blocks.format == "Q8_0"
    np.testing.assert_array_equal(blocks.raw.numpy(), expected)


@pytest.fixture(scope="module")
def smollm2_folder(hf_smollm2, hf_tokenizer, tmp_path_factory):
    """The packaged SmolLM2's weights as a bf16 Hugging Face checkpoint (transformers will not save
    a model it read from GGUF, so the tensors are written directly; the tied LM head once)."""
    folder = tmp_path_factory.mktemp("smollm2") / "model"
    folder.mkdir()
    tensors = {
        name: tensor.to(torch.bfloat16).contiguous()
        for name, tensor in hf_smollm2.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(tensors, folder / "model.safetensors")
    config = hf_smollm2.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_smollm2).__name__]
    (folder / "config.json").write_text(json.dumps(config))
    hf_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.skipif(not cpu_kernels_available(), reason="the int8 kernels are the compiled CPU kernels")
def test_int8_smollm2_picks_the_bf16_models_tokens(smollm2_folder):
    # Real weights: their quantization error and the activations' leave the greedy choice alone at
    # nearly every position (a random model's near-uniform logits would turn on any rounding). Every
    # product on the int8 path.
    dense = LLM(str(smollm2_folder), dtype="bfloat16", num_kv_blocks=64)
    try:
        sequences = greedy_sequences(dense, PROMPTS, 24)
        expected = top_tokens(dense, sequences)
    finally:
        dense.llm_engine.shutdown()
    quantized = LLM(
        str(smollm2_folder),
        dtype="bfloat16",
        num_kv_blocks=64,
        quantization="int8",
        **INT8_PATH_STEPS,
    )
    try:
        runner = quantized.llm_engine.engine_core.engine_core.executor.worker.model_runner
        projection = runner.model.model.stage_layers[0].self_attn.qkv_proj.weight
        got = top_tokens(quantized, sequences)
    finally:
        quantized.llm_engine.shutdown()
    assert isinstance(projection, BlockLinearWeight)
    rows, columns = projection.shape
    assert projection.nbytes <= 0.6 * rows * columns * 2  # about half of bf16's two bytes a weight
    pairs = [
        (a, b) for want, have in zip(expected, got, strict=True) for a, b in zip(want, have, strict=True)
    ]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.95


def test_int8_where_the_kernels_cannot_run_is_an_error(tmp_path):
    folder = write_tiny_model(tmp_path / "model")
    with pytest.raises(ValueError, match="quantization int8: the quantized kernels take bfloat16"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16, quantization="int8")
