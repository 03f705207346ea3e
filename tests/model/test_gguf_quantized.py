"""GGUF files served from their quantized blocks (bf16 activations on the CPU).

The packaged Q4_1 SmolLM2 against the same file dequantized at load (`quantization="none"`): the
next token chosen at each position of greedy continuations agrees on at least 95% of the positions
the dense model does not tie, the others near ties (the int8 rounding of the activations is the
only difference), and loading it grows the process by at
most 1.1x the file plus 25 MB. A tiny Llama written as Q8_0/Q4_1 GGUF: tensor parallelism splits
the blocks (TP = 2 equals TP = 1); a projection in a format without a kernel is dequantized with a
warning naming it, or refused with `quantization="strict"`; a truncated file names the tensor.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import gguf
import pytest

from engine import LLM, SamplingParams
from engine.models.model_files import packaged_model_path
from kernels.build import cpu_kernels_available
from tests.model.next_token_checks import (
    INT8_PATH_STEPS,
    agreement_up_to_near_ties,
    greedy_sequences,
    position_logprobs,
)
from tests.model.test_hf_parity import PROMPTS
from tests.model.tiny_gguf import write_gguf
from tests.model.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="needs the compiled CPU kernels")

Q = gguf.GGMLQuantizationType
MAX_TOKENS = 24


def test_the_packaged_q4_1_model_picks_the_dequantized_models_tokens():
    # Every product on the int8 path. Where the choices differ, the quantized pick must be a near
    # tie of the dense one's.
    dense = LLM(dtype="bfloat16", quantization="none", num_kv_blocks=64)
    try:
        sequences = greedy_sequences(dense, PROMPTS, MAX_TOKENS)
        expected = position_logprobs(dense, sequences)
    finally:
        dense.llm_engine.shutdown()
    quantized = LLM(dtype="bfloat16", num_kv_blocks=64, **INT8_PATH_STEPS)
    try:
        got = position_logprobs(quantized, sequences)
    finally:
        quantized.llm_engine.shutdown()
    assert agreement_up_to_near_ties(expected, got, decided_only=True) >= 0.95


MEMORY_PROBE = """
import gc, json, psutil, torch
from engine.config import EngineConfig
from engine.config_resolve import resolve_engine_config
from engine.models.loader import load_model
from engine.models.model_files import ModelSource
from kernels.build import cpu_kernels_available
cpu_kernels_available()
config = resolve_engine_config(EngineConfig.from_flat(dtype="bfloat16", quantization=QUANTIZATION))
before = psutil.Process().memory_info().rss
model = load_model(ModelSource.of(config.model), config.model.hf_config, torch.bfloat16,
                   torch.device("cpu"), None, config.model.quantization)
gc.collect()
print(json.dumps(psutil.Process().memory_info().rss - before))
"""


@pytest.mark.parametrize("quantization", [None, "none"])
def test_loading_the_packaged_gguf_grows_memory_by_little_more_than_the_file(quantization):
    # A fresh process: the growth of resident memory from the weights alone.
    probe = MEMORY_PROBE.replace("QUANTIZATION", repr(quantization))
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    growth = json.loads(result.stdout.strip().splitlines()[-1])
    limit = 1.1 * packaged_model_path().stat().st_size + 25e6
    if quantization is None:
        assert growth <= limit, f"grew {growth / 1e6:.0f} MB, limit {limit / 1e6:.0f} MB"
    else:  # dequantized to bf16 at load: the limit is what keeping the blocks buys
        assert growth > limit


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return folder, json.loads((folder / "config.json").read_text())


def projections_as(q_type, down_type=None, vocabulary=False):
    """Every projection in `q_type` (the down projections in `down_type` if given; with
    `vocabulary`, the embedding and LM head in `q_type` too)."""
    kept = ("_proj.weight", "embed_tokens.weight", "lm_head.weight") if vocabulary else ("_proj.weight",)

    def block_format(name: str):
        if name.endswith("down_proj.weight") and down_type is not None:
            return down_type
        return q_type if name.endswith(kept) else None

    return block_format


def test_tensor_parallel_splits_the_blocks(tiny_llama, tmp_path):
    # Row-parallel layers split each row's blocks in halves of whole blocks; column-parallel ones,
    # the embedding and the LM head split their rows. bf16 rounds the two layouts' sums
    # differently, which a random model's near ties can turn into another token: compared position
    # by position on the same sequences, where the choices differ TP = 2's pick must be a near tie
    # of TP = 1's (a misplaced block would not be).
    folder, config = tiny_llama
    path = write_gguf(
        folder, config, tmp_path / "model.gguf", projections_as(Q.Q8_0, Q.Q4_1, vocabulary=True)
    )
    tops = {}
    for tp in (1, 2):
        llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, tensor_parallel_size=tp)
        try:
            if tp == 1:
                sequences = greedy_sequences(llm, PROMPTS, MAX_TOKENS)
            tops[tp] = position_logprobs(llm, sequences)
        finally:
            llm.llm_engine.shutdown()
    assert agreement_up_to_near_ties(tops[1], tops[2]) >= 0.9


def test_a_format_without_a_kernel_is_dequantized_with_a_warning_or_refused(tiny_llama, tmp_path, caplog):
    folder, config = tiny_llama
    path = write_gguf(folder, config, tmp_path / "model.gguf", projections_as(Q.Q8_0, Q.Q5_0))
    with pytest.raises(
        ValueError, match=r"tensor 'blk.0.ffn_down.weight' is Q5_0, which the quantized kernels"
    ):
        LLM(str(path), dtype="bfloat16", num_kv_blocks=32, quantization="strict")
    with caplog.at_level(logging.WARNING, logger="engine.models.gguf_loader"):
        llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=32)
    try:
        assert "tensor blk.0.ffn_down.weight is Q5_0, which the quantized kernels do not read" in caplog.text
        assert len(
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
        )
    finally:
        llm.llm_engine.shutdown()


def test_a_truncated_gguf_names_the_tensor_it_cuts(tiny_llama, tmp_path):
    folder, config = tiny_llama
    path = write_gguf(folder, config, tmp_path / "model.gguf", projections_as(Q.Q8_0))
    path.write_bytes(
        path.read_bytes()[:-5000]
    )  # (the tokenizer from the folder: gguf-py's reader fails first)
    with pytest.raises(
        ValueError, match=r"tensor '[\w.]+' \(\w+, shape .*the file ends at .* \(truncated\?\)"
    ):
        LLM(str(path), tokenizer=str(folder), dtype="bfloat16", num_kv_blocks=32)
