"""Back-pressure and deadlines of a real `raypage api-server` over a tiny random Llama: past
max_num_seqs + max_waiting_requests a request gets 503 with Retry-After while the admitted ones
finish as they would alone, and a request past its `timeout` is aborted with its KV blocks freed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from cluster.cli import build_parser, main
from cluster.openai.api_server import server_settings
from tests.cluster.remote_server import RemoteServer
from tests.model.tiny_models import write_tiny_model

MODEL = "tiny"
MAX_NUM_SEQS, MAX_WAITING = 2, 2
ENGINE_FLAGS = [
    *("--dtype", "float32", "--num-kv-blocks", "128"),
    *("--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING)),
]
# The tiny model has no end-of-sequence token: each request generates exactly max_tokens. Long
# enough that the admitted requests are still running (hundreds of engine steps) when the one
# past the bound arrives, and that a deadline of a fraction of a second passes mid-generation.
ADMITTED_MAX_TOKENS = 200
LONG_MAX_TOKENS = 400
SHORT_TIMEOUT_S = 0.3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    folder = tmp_path_factory.mktemp("tiny-backpressure")
    model = write_tiny_model(folder / "model")
    args = ["--model", str(model), "--served-model-name", MODEL, "--disable-access-log", *ENGINE_FLAGS]
    server = RemoteServer(args, folder / "server.log")
    yield server
    server.stop()


def unfinished_requests(server: RemoteServer) -> float:
    return server.metric("raypage:num_requests_running") + server.metric("raypage:num_requests_waiting")


def wait_until_idle(server: RemoteServer, timeout_s: float = 10.0) -> None:
    """Until nothing runs or waits and no KV block is in use (the blocks were freed)."""
    deadline = time.monotonic() + timeout_s
    while unfinished_requests(server) or server.metric("raypage:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s:\n{server.log_tail()}"
        time.sleep(0.1)


def test_requests_past_the_bound_get_503_and_the_admitted_ones_finish(server: RemoteServer) -> None:
    admitted = MAX_NUM_SEQS + MAX_WAITING
    prompts = [f"Once upon a time {index}" for index in range(admitted)]
    alone = server.greedy_texts(MODEL, prompts, ADMITTED_MAX_TOKENS)

    async def stream(api: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        chunks = await api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=ADMITTED_MAX_TOKENS, temperature=0, stream=True
        )
        text, finish_reason = "", None
        async for chunk in chunks:
            text += chunk.choices[0].text
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        return text, finish_reason

    async def run() -> list[tuple[str, str | None]]:
        api = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
        )
        streams = [asyncio.create_task(stream(api, prompt)) for prompt in prompts]
        deadline = time.monotonic() + 60
        while unfinished_requests(server) < admitted:  # all admitted: two running, two waiting
            assert time.monotonic() < deadline and not any(task.done() for task in streams)
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as raw:
            body = {"model": MODEL, "prompt": "One too many", "max_tokens": 4}
            for extra in ({}, {"stream": True}):
                refused = await raw.post("/v1/completions", json={**body, **extra})
                assert refused.status_code == 503, refused.text
                assert int(refused.headers["Retry-After"]) >= 1
                error = refused.json()["error"]
                assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
                assert f"max_num_seqs={MAX_NUM_SEQS} + max_waiting_requests={MAX_WAITING}" in error["message"]
        return await asyncio.gather(*streams)

    assert asyncio.run(run()) == [(text, "length") for text in alone]
    wait_until_idle(server)
    # Nothing was left behind: the server admits again.
    assert server.client().completions.create(model=MODEL, prompt=prompts[0], max_tokens=4).choices[0].text


def test_a_request_past_its_timeout_is_aborted_and_frees_its_blocks(server: RemoteServer) -> None:
    aborted_before = server.metric("raypage:request_success_total", 'finished_reason="abort"')
    with pytest.raises(openai.APIStatusError) as raised:
        server.client().completions.create(
            model=MODEL, prompt="Once", max_tokens=LONG_MAX_TOKENS, extra_body={"timeout": SHORT_TIMEOUT_S}
        )
    assert raised.value.status_code == 504
    error = raised.value.body
    assert error["param"] == "timeout" and f"timeout of {SHORT_TIMEOUT_S:g} s" in error["message"]
    wait_until_idle(server)
    assert server.metric("raypage:request_success_total", 'finished_reason="abort"') == aborted_before + 1


def test_a_stream_past_its_timeout_ends_with_an_error_and_frees_its_blocks(server: RemoteServer) -> None:
    aborted_before = server.metric("raypage:request_success_total", 'finished_reason="abort"')
    messages = [{"role": "user", "content": "Tell me a long story."}]
    text = ""
    # Usually mid-stream (an error event after some chunks: APIError); on a machine too slow to
    # produce the first token in time, before the stream starts (a 504 status: APIStatusError).
    with pytest.raises(openai.APIError, match="did not finish within its timeout"):
        chunks = server.client().chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=LONG_MAX_TOKENS,
            stream=True,
            extra_body={"timeout": SHORT_TIMEOUT_S},
        )
        for chunk in chunks:
            text += chunk.choices[0].delta.content or ""
    wait_until_idle(server)
    assert server.metric("raypage:request_success_total", 'finished_reason="abort"') == aborted_before + 1


@pytest.mark.parametrize("timeout", [0, -1, 1e9, "soon"])
def test_an_invalid_timeout_is_a_400_naming_the_field(server: RemoteServer, timeout: object) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4, "timeout": timeout}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "timeout"


def test_the_server_flags_are_checked_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["api-server", "--request-timeout", "2.5", "--drain-timeout-s", "4"])
    assert server_settings(args).request_timeout_s == 2.5 and args.drain_timeout_s == 4
    for flags, name in (
        (["--request-timeout", "0"], "request_timeout_s"),
        (["--drain-timeout-s", "-1"], "--drain-timeout-s"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["api-server", *flags])
        assert exited.value.code == 2 and name in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["api-server", "--max-waiting-requests", "-2"])
    assert "--max-waiting-requests" in capsys.readouterr().err
