"""SmolLM2 in bfloat16 decodes the same greedy tokens whichever CPU attention backend runs it: the C++
`cpu_paged` kernel rounds scores and probabilities to bf16 where the torch `sdpa` path does (the
float32 parity with transformers runs on the default backend in test_hf_parity.py)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from kernels.build import cpu_kernels_available
from tests.model.test_hf_parity import PROMPTS

pytestmark = [
    pytest.mark.slow,  # two engines
    pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here"),
]


def greedy_tokens(monkeypatch: pytest.MonkeyPatch, backend: str) -> list[list[int]]:
    monkeypatch.setenv("RAYPAGE_ATTENTION_BACKEND", backend)
    llm = LLM(dtype="bfloat16", num_kv_blocks=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def test_bf16_greedy_tokens_match_between_cpu_paged_and_sdpa(monkeypatch):
    assert greedy_tokens(monkeypatch, "cpu_paged") == greedy_tokens(monkeypatch, "sdpa")
