"""A tiny random Llama behind `raypage api-server` under load: concurrent streams, clients that
leave mid-stream, exact metrics, and the engine core dying. The tests run in file order: the last
one kills the engine core."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.cluster.remote_server import RemoteServer
from tests.model.tiny_models import write_tiny_model

MODEL = "tiny"
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "64"]
PROMPT = "Once upon a time"
# The tiny model has no end-of-sequence token: every request generates exactly max_tokens.
MAX_TOKENS = 12
LONG_TOKENS = 4000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    folder = tmp_path_factory.mktemp("tiny-load")
    # Room for requests longer than clients stay: on a fast machine the tiny model decodes 400
    # tokens in about a second, close to how long a busy server may take to see a client leave.
    model = write_tiny_model(folder / "model", max_position_embeddings=LONG_TOKENS + 64)
    args = [
        *("--model", str(model), "--served-model-name", MODEL, "--disable-access-log"),
        "--enable-prompt-tokens-details",  # for the bench's prefix-cache hit rate
        *ENGINE_FLAGS,
    ]
    server = RemoteServer(args, folder / "server.log")
    yield server
    server.stop()


def async_client(server: RemoteServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def stream_completion(client: openai.AsyncOpenAI, index: int) -> tuple[str, str | None, int]:
    """(text, finish reason, completion tokens) of one streamed completion."""
    stream = await client.completions.create(
        model=MODEL,
        prompt=f"{PROMPT} {index}",
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish_reason, num_tokens = "", None, -1
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        if chunk.usage:
            num_tokens = chunk.usage.completion_tokens
    return text, finish_reason, num_tokens


def test_64_concurrent_streams_complete(server: RemoteServer) -> None:
    async def run() -> list:
        client = async_client(server)
        return await asyncio.gather(*(stream_completion(client, index) for index in range(64)))

    results = asyncio.run(run())
    assert all(
        finish == "length" and num_tokens == MAX_TOKENS and text for text, finish, num_tokens in results
    )
    server.wait_until_idle()


def test_clients_leaving_mid_stream_free_their_requests(server: RemoteServer) -> None:
    async def leave_after_first_chunk(client: openai.AsyncOpenAI) -> None:
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=LONG_TOKENS, stream=True
        )
        async for _ in stream:
            break
        await stream.close()  # drops the connection

    async def until_running(count: int) -> None:
        deadline = time.monotonic() + 30
        while server.metric("raypage:num_requests_running") < count:
            assert time.monotonic() < deadline, f"{count} requests never ran together"
            await asyncio.sleep(0.02)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as raw:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG_TOKENS}
            # Clients waiting for whole responses, cancelled (their connections dropped) once their
            # requests run, hundreds of steps before they could finish.
            waiting = [asyncio.create_task(raw.post("/v1/completions", json=body)) for _ in range(4)]
            await until_running(len(waiting))
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            client = async_client(server)
            await asyncio.gather(*(leave_after_first_chunk(client) for _ in range(50)))

    aborted_before = server.metric("raypage:request_success_total", 'finished_reason="abort"')
    asyncio.run(run())
    server.wait_until_idle(timeout_s=5.0)
    assert server.metric("raypage:request_success_total", 'finished_reason="abort"') - aborted_before == 54


def test_metrics_count_what_was_sent(server: RemoteServer) -> None:
    prompt_lengths = [5, 7, 9]
    names = [
        "raypage:prompt_tokens_total",
        "raypage:generation_tokens_total",
        "raypage:time_to_first_token_seconds_count",
        "raypage:inter_token_latency_seconds_count",
        "raypage:e2e_request_latency_seconds_count",
        "raypage:request_queue_time_seconds_count",
        "raypage:request_prompt_tokens_sum",
    ]
    before = {name: server.metric(name) for name in names}
    length_before = server.metric("raypage:request_success_total", 'finished_reason="length"')

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    for length in prompt_lengths:
        prompt = list(range(100, 100 + length))
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS)
        assert completion.usage.prompt_tokens == length and completion.usage.completion_tokens == MAX_TOKENS

    k = len(prompt_lengths)
    expected = {
        "raypage:prompt_tokens_total": sum(prompt_lengths),
        "raypage:generation_tokens_total": k * MAX_TOKENS,
        "raypage:time_to_first_token_seconds_count": k,
        "raypage:inter_token_latency_seconds_count": k * (MAX_TOKENS - 1),
        "raypage:e2e_request_latency_seconds_count": k,
        "raypage:request_queue_time_seconds_count": k,
        "raypage:request_prompt_tokens_sum": sum(prompt_lengths),
    }
    assert {name: server.metric(name) - before[name] for name in names} == expected
    assert server.metric("raypage:request_success_total", 'finished_reason="length"') - length_before == k


def test_bench_serve_measures_every_request(server: RemoteServer, tmp_path) -> None:
    result_path, plot_path = tmp_path / "serve.json", tmp_path / "serve.png"
    workload = ["--request-rate", "8", "inf", "--num-prompts", "6", "--input-len", "10", "--output-len", "5"]
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "cluster.cli", "bench", "serve", "--base-url", server.base_url),
            *workload,
            *("--output-json", str(result_path), "--plot", str(plot_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    runs = json.loads(result_path.read_text())["runs"]
    assert [run["request_rate"] for run in runs] == [8.0, "inf"]
    for run in runs:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert run["output_throughput"] == pytest.approx(6 * 5 / run["duration_s"])
        for metric in ("ttft", "tpot", "itl", "e2e_latency"):
            assert 0 < run[metric]["median_ms"] <= run[metric]["p99_ms"]
        assert run["ttft"]["median_ms"] < run["e2e_latency"]["median_ms"]
    assert plot_path.stat().st_size > 1000  # a PNG, drawn for more than one rate
    server.wait_until_idle()


def test_bench_serve_prefix_groups_reports_the_prefix_cache_hit_rate(server: RemoteServer, tmp_path) -> None:
    result_path = tmp_path / "prefix.json"
    # Two groups of 32-token (two-block) prefixes, 4 tokens of each prompt's own, one request at a time:
    # the first prompt of each group misses, the 6 others hit their two prefix blocks.
    workload = ["--dataset", "prefix-groups", "--num-groups", "2", "--prefix-len", "32", "--input-len", "4"]
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "cluster.cli", "bench", "serve", "--base-url", server.base_url),
            *workload,
            *("--num-prompts", "8", "--output-len", "2", "--max-concurrency", "1", "--seed", "7"),
            *("--output-json", str(result_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    record = json.loads(result_path.read_text())
    assert record["workload"]["dataset"] == "prefix-groups"
    (run,) = record["runs"]
    assert (run["completed"], run["failed"]) == (8, 0)
    assert run["prefix_cache_hit_rate"] == pytest.approx(6 * 32 / (8 * 36))
    assert "prefix-cache hit rate: 66.7% of prompt tokens" in completed.stdout
    server.wait_until_idle()


def test_dead_engine_core_fails_requests_fast(server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG_TOKENS}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            pending = asyncio.create_task(client.post("/v1/completions", json=body))
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: {")  # generating now
                killed = time.monotonic()
                os.kill(server.core_pid(), signal.SIGKILL)
                rest = [line async for line in lines if line]
            response = await pending
            assert time.monotonic() - killed < 5.0
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == 503
            assert '"code":503' in rest[-2] and rest[-1] == "data: [DONE]"
            assert (await client.post("/v1/completions", json=body)).status_code == 503
            assert (await client.get("/health")).status_code == 503

    asyncio.run(run())
