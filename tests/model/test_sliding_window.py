"""A tiny Mistral (a sliding window of 16 tokens on every layer) against transformers in float32:
prompts three windows long, chunked prefill over blocks of 8 (16 for Triton, in its interpreter
here), two requests sharing a long prefix and the prefix cache hit again afterwards. The KV cache manager frees every block wholly before
the window as sequences grow, so the later chunks and every decode run over freed blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.model.hf_reference import hf_greedy
from tests.model.tiny_models import write_tiny_model

WINDOW = 16
SHARED = list(range(400, 440))  # 40 tokens: five blocks of 8
PROMPTS = [
    [*SHARED, 7, 8, 9, 10, 11, 12, 13, 14],  # three windows
    [*SHARED, 3, 1, 4, 1, 5, 9, 2, 6, 5],  # the same prefix, another tail
    list(range(1000, 1011)),  # shorter than the window
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory):
    folder = write_tiny_model(
        tmp_path_factory.mktemp("mistral") / "model", family="mistral", sliding_window=WINDOW
    )
    # Eager attention: transformers' own sliding-window mask, written out.
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return folder, hf


@pytest.mark.parametrize(
    ("attention_backend", "block_size"),
    [("cpu_paged", 8), ("sdpa", 8), ("triton", 16)],
    ids=["cpu_paged", "sdpa", "triton"],
)
def test_tiny_mistral_slides_like_transformers(mistral, attention_backend, block_size):
    folder, hf = mistral
    llm = LLM(
        str(folder),
        dtype="float32",
        attention_backend=attention_backend,
        num_kv_blocks=32,
        block_size=block_size,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    assert kv.sliding_window == WINDOW
    assert llm.llm_engine.config.model.max_model_len == 512  # the model's context, not the window
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = {tuple(prompt): hf_greedy(hf, prompt, MAX_TOKENS) for prompt in PROMPTS}
    hits_before = scheduler.prefix_cache_hits
    # Together (the second prompt shares the first's cached prefix), then the second alone again.
    for prompts in (PROMPTS, PROMPTS[1:2]):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for output, prompt in zip(outputs, prompts, strict=True):
            assert output.outputs[0].token_ids == expected[tuple(prompt)]
    assert scheduler.prefix_cache_hits > hits_before
    assert kv.num_free_blocks == kv.num_blocks


def test_a_sequence_longer_than_the_whole_cache_slides_through_it(mistral):
    """Six blocks of 8 (48 slots) hold a window and a chunk of 16, so a prompt of 60 tokens and 12
    new ones run to the end, as transformers computes them."""
    folder, hf = mistral
    llm = LLM(
        str(folder), dtype="float32", num_kv_blocks=6, block_size=8, max_num_batched_tokens=16, max_num_seqs=4
    )
    prompt = list(range(2000, 2060))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
