"""Graceful drain of a real `raypage api-server` over a tiny random Llama: SIGTERM during 20 streams.
The streams that fit the drain timeout complete as they would alone, the rest end with
finish_reason "abort"; meanwhile /health and new requests get 503; the server exits 0 and no
process of its tree remains."""

from __future__ import annotations

import asyncio
import signal

import httpx
import openai
import psutil

from tests.cluster.remote_server import RemoteServer
from tests.model.tiny_models import write_tiny_model

MODEL = "tiny"
NUM_STREAMS = 20
DRAIN_TIMEOUT_S = 2.0
# The tiny model has no end-of-sequence token: each request generates exactly max_tokens. Half the
# streams need a few dozen engine steps after the signal (well within the drain timeout), the other
# half thousands of steps of a batch of 20: past the timeout even at half a millisecond a step, which
# no engine reaches, so the test does not depend on how fast this machine is.
SHORT_MAX_TOKENS, LONG_MAX_TOKENS = 24, 4000
MAX_MODEL_LEN = 4096


async def stream(
    api: openai.AsyncOpenAI, prompt: str, max_tokens: int, started: asyncio.Event
) -> tuple[str, str]:
    chunks = await api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    started.set()  # the stream's response begins with the request's first output
    text, finish_reason = "", None
    async for chunk in chunks:
        text += chunk.choices[0].text
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    assert finish_reason is not None
    return text, finish_reason


async def watch_drain(server: RemoteServer) -> tuple[httpx.Response, httpx.Response]:
    """/health and a new request, once the server answers that it drains (until it stops listening)."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as raw:
        while server.process.poll() is None:
            health = await raw.get("/health")
            if health.status_code == 503:
                body = {"model": MODEL, "prompt": "Too late", "max_tokens": 4}
                return health, await raw.post("/v1/completions", json=body)
            await asyncio.sleep(0.02)
    raise AssertionError("the server exited without ever answering that it drains")


def test_sigterm_drains_the_streams_then_exits_0_leaving_no_process(tmp_path) -> None:
    model = write_tiny_model(tmp_path / "model", max_position_embeddings=MAX_MODEL_LEN)
    args = [
        *("--model", str(model), "--served-model-name", MODEL, "--disable-access-log"),
        # Blocks for every stream's whole length: the long ones run until the drain aborts them.
        *("--dtype", "float32", "--num-kv-blocks", "5120", "--max-num-seqs", str(NUM_STREAMS)),
        *("--drain-timeout-s", str(DRAIN_TIMEOUT_S)),
    ]
    server = RemoteServer(args, tmp_path / "server.log")
    try:
        api = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = [f"Once upon a time {index}" for index in range(NUM_STREAMS)]
        lengths = [SHORT_MAX_TOKENS if index % 2 else LONG_MAX_TOKENS for index in range(NUM_STREAMS)]
        # The short streams' greedy completions on the idle server, one at a time.
        alone = {
            index: api.completions.create(
                model=MODEL, prompt=prompts[index], max_tokens=SHORT_MAX_TOKENS, temperature=0
            )
            .choices[0]
            .text
            for index in range(NUM_STREAMS)
            if lengths[index] == SHORT_MAX_TOKENS
        }
        tree = psutil.Process(server.process.pid).children(recursive=True)
        assert tree, "the server runs its engine core in a child process"

        async def run() -> tuple[list[tuple[str, str]], tuple[httpx.Response, httpx.Response]]:
            async_api = openai.AsyncOpenAI(
                base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
            )
            started = [asyncio.Event() for _ in prompts]
            streams = [
                asyncio.create_task(stream(async_api, prompt, max_tokens, event))
                for prompt, max_tokens, event in zip(prompts, lengths, started, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
            server.process.send_signal(signal.SIGTERM)
            watched = await watch_drain(server)
            return await asyncio.gather(*streams), watched

        results, (health, refused) = asyncio.run(run())
        assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert "draining" in refused.json()["error"]["message"]
        for index, (text, finish_reason) in enumerate(results):
            if index in alone:
                assert (text, finish_reason) == (alone[index], "length"), index
            else:
                assert finish_reason in ("length", "abort"), index
        assert any(finish_reason == "abort" for _, finish_reason in results), "no stream outlasted the drain"
        assert server.process.wait(timeout=60) == 0, server.log_tail()
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, f"left behind: {alive}"
        assert "aborting" in server.log_tail(20_000)
    finally:
        server.stop()
