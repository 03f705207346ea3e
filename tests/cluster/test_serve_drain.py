"""Back-pressure and drain under Ray Serve: the deployments take no more requests at once than the
engine admits, their graceful shutdown is the drain timeout, and SIGTERM to `raypage serve` lets
the streams in flight finish and leaves no process behind."""

from __future__ import annotations

import asyncio
import signal

import openai
import psutil
import pytest

from cluster.serve.args import parse_app_args
from cluster.serve_app import (
    DRAIN_POLL_S,
    UNBOUNDED_MAX_ONGOING_REQUESTS,
    ingress_options,
    llm_server_options,
)
from engine.config import DEFAULT_WAITING_BATCHES
from tests.cluster.remote_server import RemoteServer
from tests.model.tiny_models import write_tiny_model

MODEL = "tiny"
# Long enough (hundreds of engine steps) that the streams are still running when Serve starts
# stopping the replica; the drain timeout is far longer than they need.
STREAM_MAX_TOKENS = 200


def test_serve_takes_no_more_requests_than_the_engine_admits() -> None:
    settings = parse_app_args({"max_num_seqs": 8, "max_waiting_requests": 5, "drain_timeout_s": 12})
    options = llm_server_options(settings)
    assert options["max_ongoing_requests"] == 8 + 5
    assert options["graceful_shutdown_timeout_s"] == 12
    assert options["graceful_shutdown_wait_loop_s"] == DRAIN_POLL_S

    # The default waiting queue, several replicas behind a separate ingress, an explicit override.
    settings = parse_app_args({"max_num_seqs": 8, "ingress": "separate", "num_replicas": 2})
    assert llm_server_options(settings)["max_ongoing_requests"] == 8 * (1 + DEFAULT_WAITING_BATCHES)
    assert ingress_options([settings])["max_ongoing_requests"] == 2 * 8 * (1 + DEFAULT_WAITING_BATCHES)
    assert llm_server_options(parse_app_args({"max_ongoing_requests": 7}))["max_ongoing_requests"] == 7
    unbounded = llm_server_options(parse_app_args({"max_waiting_requests": -1}))
    assert unbounded["max_ongoing_requests"] == UNBOUNDED_MAX_ONGOING_REQUESTS
    assert parse_app_args({"request_timeout_s": 2.5}).server.request_timeout_s == 2.5
    with pytest.raises(ValueError, match="drain_timeout_s"):
        parse_app_args({"drain_timeout_s": -1})
    with pytest.raises(ValueError, match="max_waiting_requests"):
        parse_app_args({"max_waiting_requests": -2})


async def stream(
    api: openai.AsyncOpenAI, prompt: str, max_tokens: int, started: asyncio.Event
) -> tuple[str, str]:
    chunks = await api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    started.set()
    text, finish_reason = "", None
    async for chunk in chunks:
        text += chunk.choices[0].text
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return text, finish_reason


@pytest.mark.slow
def test_sigterm_to_raypage_serve_drains_the_streams_and_leaves_no_process(tmp_path) -> None:
    model = write_tiny_model(tmp_path / "model")
    args = [
        *("--model", str(model), "--served-model-name", MODEL, "--proxy-mode", "python", "--num-cpus", "2"),
        *("--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "8", "--drain-timeout-s", "30"),
        *("--log-stats-interval", "0"),
    ]
    server = RemoteServer(args, tmp_path / "serve.log", command="serve", stop_timeout_s=90)
    try:
        api = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = [f"Once upon a time {index}" for index in range(4)]
        alone = [
            api.completions.create(model=MODEL, prompt=prompt, max_tokens=STREAM_MAX_TOKENS, temperature=0)
            .choices[0]
            .text
            for prompt in prompts
        ]
        tree = psutil.Process(server.process.pid).children(recursive=True)

        async def run() -> list[tuple[str, str]]:
            async_api = openai.AsyncOpenAI(
                base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
            )
            started = [asyncio.Event() for _ in prompts]
            streams = [
                asyncio.create_task(stream(async_api, prompt, STREAM_MAX_TOKENS, event))
                for prompt, event in zip(prompts, started, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
            server.process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams)

        assert asyncio.run(run()) == [(text, "length") for text in alone]
        assert server.process.wait(timeout=120) == 0, server.log_tail()
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    finally:
        server.stop()
