"""`raypage api-server --speculative-config` with the official openai client: greedy completions,
whole and streamed, are the offline engine's without speculation, and /metrics counts the drafts."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.cluster.remote_server import RemoteServer
from tests.spec_decode.test_ngram_engine import PROMPTS, SPEC

MAX_TOKENS = 48


@pytest.mark.slow
def test_served_speculation_matches_the_engine_without_it(tmp_path):
    plain = LLM(dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [output.outputs[0].text for output in plain.generate(PROMPTS[:2], params, use_tqdm=False)]
    plain.llm_engine.shutdown()
    args = ["--dtype", "float32", "--num-kv-blocks", "64", "--speculative-config", json.dumps(SPEC)]
    server = RemoteServer(
        [*args, "--served-model-name", "smollm2", "--disable-access-log"], tmp_path / "server.log"
    )
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        request = dict(
            model="smollm2", max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
        )
        for prompt, text in zip(PROMPTS[:2], expected, strict=True):
            assert client.completions.create(prompt=prompt, **request).choices[0].text == text
            stream = client.completions.create(prompt=prompt, stream=True, **request)
            assert "".join(chunk.choices[0].text for chunk in stream) == text
        metrics = httpx.get(server.base_url + "/metrics").text
        accepted = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("raypage:spec_decode_num_accepted_tokens_total")
        ]
        assert accepted and accepted[0] > 0
    finally:
        server.stop()
