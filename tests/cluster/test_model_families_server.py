"""The new families through `raypage api-server` and the official `openai` client: greedy
completions equal transformers' on the same checkpoint (Gemma 3: sliding and global layers,
a prompt three windows long; Qwen3-MoE: routed experts)."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.cluster.remote_server import RemoteServer
from tests.model.hf_reference import hf_greedy
from tests.model.tiny_families import SLIDING_WINDOW, write_family_model
from tests.model.tiny_moe import write_tiny_moe

MAX_TOKENS = 10
# A short prompt and one longer than three sliding windows.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a village between two rivers, there lived a baker who rose every morning "
    "before the sun to light the ovens, knead the dough and shape the loaves that the whole village "
    "would eat; one winter morning, the flour had run out, and",
]


@pytest.mark.parametrize("family", ["gemma3", "qwen3-moe"])
def test_served_family_matches_transformers(tmp_path, family):
    folder = (
        write_tiny_moe(tmp_path / family)
        if family == "qwen3-moe"
        else write_family_model(tmp_path / family, family)
    )
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer(PROMPTS[1])["input_ids"]) > 3 * SLIDING_WINDOW
    args = ["--model", str(folder), "--served-model-name", family, "--dtype", "float32", "--block-size", "8"]
    server = RemoteServer([*args, "--num-kv-blocks", "64", "--disable-access-log"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        for prompt in PROMPTS:
            reply = client.completions.create(
                model=family,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            prompt_ids = tokenizer(prompt)["input_ids"]
            expected = hf_greedy(hf, prompt_ids, MAX_TOKENS)
            assert reply.choices[0].text == tokenizer.decode(expected), family
    finally:
        server.stop()
