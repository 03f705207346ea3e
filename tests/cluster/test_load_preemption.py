"""256 concurrent streaming clients against a real `raypage api-server` whose KV cache is far too small
for them, so the scheduler must preempt: every request completes, each greedy output equals
transformers' greedy output for the same prompt, generated alone (the unloaded reference), no KV block
is left in use, and the server's memory returns to its post-warm-up level."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.cluster.remote_server import RemoteServer
from tests.model.hf_reference import hf_greedy
from tests.model.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow  # about two minutes here

MODEL = "tiny"
NUM_CLIENTS = 256
# 64 distinct prompts of ten token ids, each sent by four clients.
NUM_PROMPTS = 64
PROMPT_LEN = 10
WARM_UP_CLIENTS = 64
# The tiny model has no end-of-sequence token: every request generates exactly MAX_TOKENS.
MAX_TOKENS = 16
# A prompt and its 16 tokens fill two 16-token blocks: 32 running sequences need 64 blocks and 32
# hold half of them, so running requests outgrow the cache and are preempted.
NUM_KV_BLOCKS = 32
MAX_NUM_SEQS = 32
ENGINE_FLAGS = [
    *("--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS)),
    # Every client admitted: this test is about holding the load, tests/cluster/test_backpressure.py
    # about refusing what is past the bound (the default, 3 × max_num_seqs, would refuse 160 here).
    *("--max-waiting-requests", str(NUM_CLIENTS)),
    "--disable-access-log",
]
CLIENT_TIMEOUT_S = 300.0  # only so that nothing hangs forever; nothing here is timed
MEMORY_TOLERANCE = 0.05
SETTLE_TIMEOUT_S = 30.0


def prompt(index: int) -> list[int]:
    """Client `index`'s prompt, as token ids (so that transformers is given the very same ones)."""
    return random.Random(index % NUM_PROMPTS).sample(range(100, 40_000), PROMPT_LEN)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-preemption") / "model")


@pytest.fixture(scope="module")
def reference(model: Path) -> list[str]:
    """transformers' greedy text for each distinct prompt, one prompt at a time."""
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    return [
        tokenizer.decode(hf_greedy(hf, prompt(index), MAX_TOKENS), skip_special_tokens=True)
        for index in range(NUM_PROMPTS)
    ]


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[RemoteServer]:
    server = RemoteServer(
        ["--model", str(model), "--served-model-name", MODEL, *ENGINE_FLAGS], model.parent / "server.log"
    )
    yield server
    server.stop()


async def stream_text(client: openai.AsyncOpenAI, index: int) -> tuple[str, str | None]:
    """(text, finish reason) of client `index`'s greedy streamed completion."""
    stream = await client.completions.create(
        model=MODEL, prompt=prompt(index), max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    text, finish_reason = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish_reason = chunk.choices[0].finish_reason or finish_reason
    return text, finish_reason


async def all_at_once(server: RemoteServer, indexes: range) -> list[tuple[str, str | None]]:
    async with client_for(server) as client:
        return await asyncio.gather(*(stream_text(client, index) for index in indexes))


def client_for(server: RemoteServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def tree_rss(server: RemoteServer) -> int:
    """Resident bytes of the server and every process under it (the engine core)."""
    root = psutil.Process(server.process.pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += process.memory_info().rss
    return total


def settled_rss(server: RemoteServer, at_most: int | None = None) -> int:
    """The lowest of the tree's RSS samples taken 0.5 s apart: six of them, or with `at_most`, until
    one is at most that (for SETTLE_TIMEOUT_S at most)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    samples = [tree_rss(server)]
    while time.monotonic() < deadline and (len(samples) < 6 if at_most is None else min(samples) > at_most):
        time.sleep(0.5)
        samples.append(tree_rss(server))
    return min(samples)


def test_256_streaming_clients_with_preemption_match_the_unloaded_run(
    reference: list[str], server: RemoteServer
) -> None:
    expected = [(reference[index % NUM_PROMPTS], "length") for index in range(NUM_CLIENTS)]

    # A first, smaller wave primes the allocators' caches; memory is measured from there.
    warm_up = asyncio.run(all_at_once(server, range(WARM_UP_CLIENTS)))
    assert warm_up == expected[:WARM_UP_CLIENTS]
    server.wait_until_idle(SETTLE_TIMEOUT_S)
    rss_after_warm_up = settled_rss(server)

    preemptions_before = server.metric("raypage:num_preemptions_total")
    results = asyncio.run(all_at_once(server, range(NUM_CLIENTS)))
    preemptions = server.metric("raypage:num_preemptions_total") - preemptions_before

    assert preemptions > 0, "the cache was meant to be too small for the load"
    mismatched = [index for index in range(NUM_CLIENTS) if results[index] != expected[index]]
    assert not mismatched, f"clients {mismatched} got other text than transformers for their prompts"
    server.wait_until_idle(SETTLE_TIMEOUT_S)
    rss_after_load = settled_rss(server, at_most=int(rss_after_warm_up * (1 + MEMORY_TOLERANCE)))
    print(
        f"\n{NUM_CLIENTS} clients, {NUM_KV_BLOCKS} KV blocks, {preemptions:.0f} preemptions; server RSS "
        f"{rss_after_warm_up / 2**20:.1f} MiB after warm-up, {rss_after_load / 2**20:.1f} MiB after the load"
    )
    assert rss_after_load <= rss_after_warm_up * (1 + MEMORY_TOLERANCE)
