"""The FastAPI app in-process over a scripted engine: middleware, error shapes, stream framing and
cancellation, without loading a model (the real server is tested in test_openai_server*.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
import pytest

from cluster.cli import build_parser, main
from cluster.engine_args import engine_settings_from_args
from cluster.openai import ServerSettings, build_app
from cluster.openai.api_server import server_settings
from cluster.openai.streaming import merge_streams, run_until_disconnect
from engine.exceptions import EngineDeadError
from engine.frontend.input_processor import InputProcessor
from engine.frontend.tokenizer import load_tokenizer
from engine.models.model_files import ModelSource, packaged_model_path
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

MODEL = "fake"
MAX_MODEL_LEN = 64
WORDS = [" one", " two", " three"]


class ScriptedEngine:
    """Answers every request with WORDS, one token per step, honoring the output kind.

    `fail_after` raises EngineDeadError after that many tokens; `hang` never finishes.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(
            model=SimpleNamespace(model="/models/fake", max_model_len=MAX_MODEL_LEN)
        )
        self.input_processor = InputProcessor(
            tokenizer, MAX_MODEL_LEN, len(tokenizer), tokenizer.eos_token_id
        )
        self.errored = False
        self.prefix_cache_resettable = True
        self.fail_after: int | None = None
        self.hang = False
        self.closed: list[str] = []

    async def generate(
        self, prompt, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        if self.errored:
            raise EngineDeadError("core died")
        ids = [self.tokenizer(word, add_special_tokens=False).input_ids[0] for word in WORDS]
        try:
            for step in range(len(WORDS)):
                await asyncio.sleep(0)
                if self.fail_after == step:
                    raise EngineDeadError("core died")
                while self.hang:
                    await asyncio.sleep(3600)
                last = step == len(WORDS) - 1
                if sampling_params.output_kind == RequestOutputKind.FINAL_ONLY and not last:
                    continue
                start = step if sampling_params.output_kind == RequestOutputKind.DELTA else 0
                yield self._output(request_id, prompt, ids, start, step + 1, sampling_params.n, last)
        finally:
            self.closed.append(request_id)

    def _output(self, request_id, prompt, ids, start, end, n, last) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=index,
                text="".join(WORDS[start:end]),
                token_ids=ids[start:end],
                finish_reason="length" if last else None,
            )
            for index in range(n)
        ]
        return RequestOutput(
            request_id=request_id,
            prompt=prompt.get("prompt"),
            prompt_token_ids=prompt["prompt_token_ids"],
            outputs=completions,
            finished=last,
        )

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError("core died")

    async def reset_prefix_cache(self) -> bool:
        return self.prefix_cache_resettable

    def get_stats(self) -> dict:
        return {"num_running_reqs": 0, "num_waiting_reqs": 0, "kv_cache_usage": 0.0}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSource(packaged_model_path(), "gguf"))


@pytest.fixture
def engine(tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tokenizer)


def call(
    engine: ScriptedEngine,
    method: str,
    path: str,
    api_key: str | None = None,
    reasoning_parser: str | None = None,
    **kwargs,
) -> httpx.Response:
    """One request to a fresh app over `engine`."""
    settings = ServerSettings(
        [MODEL], api_key=api_key, max_request_body_bytes=1000, reasoning_parser=reasoning_parser
    )
    app = build_app(engine, settings)

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(run())


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    return error["message"]


def sse_payloads(response: httpx.Response) -> list:
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_completion_shape(engine: ScriptedEngine) -> None:
    response = call(engine, "POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 2})
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert body["choices"][0] == {
        "index": 0,
        "text": "".join(WORDS),
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    # prompt_tokens_details is null, as in vLLM, unless enable_prompt_tokens_details is set.
    assert body["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": 6,
        "total_tokens": 7,
        "prompt_tokens_details": None,
    }


def test_stream_framing_and_usage(engine: ScriptedEngine) -> None:
    response = call(
        engine,
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(response)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    content = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"])
    assert content == "".join(WORDS)
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[1:-1]] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_reasoning_parser_makes_unclosed_reasoning_of_every_choice(engine: ScriptedEngine) -> None:
    # deepseek_r1: output without </think> (the scripted words) is reasoning cut short, all of it.
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2}
    chat = "/v1/chat/completions"
    whole = call(engine, "POST", chat, reasoning_parser="deepseek_r1", json=body).json()
    for choice in whole["choices"]:
        message = choice["message"]
        assert message["reasoning"] == message["reasoning_content"] == "".join(WORDS)
        assert message["content"] is None
    chunks = sse_payloads(
        call(engine, "POST", chat, reasoning_parser="deepseek_r1", json={**body, "stream": True})
    )
    choices = [choice for chunk in chunks[2:] for choice in chunk["choices"]]  # after the two roles
    for index in (0, 1):
        deltas = [choice["delta"] for choice in choices if choice["index"] == index]
        assert all(
            "content" not in delta and delta["reasoning"] == delta["reasoning_content"] for delta in deltas
        )
        assert "".join(delta["reasoning"] for delta in deltas) == "".join(WORDS)
    hidden = call(
        engine, "POST", chat, reasoning_parser="deepseek_r1", json={**body, "include_reasoning": False}
    )
    assert hidden.json()["choices"][0]["message"]["reasoning"] is None


def test_engine_death_mid_stream_is_an_error_event(engine: ScriptedEngine) -> None:
    engine.fail_after = 1
    response = call(engine, "POST", "/v1/completions", json={"prompt": "Hi", "stream": True})
    chunks = sse_payloads(response)
    assert chunks[0]["choices"][0]["text"] == WORDS[0]
    assert chunks[-1]["error"]["code"] == 503


def test_dead_engine_is_503(engine: ScriptedEngine) -> None:
    engine.errored = True
    assert_error(call(engine, "POST", "/v1/completions", json={"prompt": "Hi"}), 503)
    assert_error(call(engine, "GET", "/health"), 503)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "stream_options": {"include_usage": True}}, None),
        ({"prompt": []}, "prompt"),
        ({"prompt": "Hi", "n": 0}, "n"),
        ({"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "Hi", "suffix": "!"}, "suffix"),
        ({"prompt": [10**9]}, None),
        ({"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, None),
        ({"prompt": "Hi", "cache_salt": ""}, "cache_salt"),  # vLLM refuses an empty salt too
        ({"prompt": "Hi", "cache_salt": 7}, "cache_salt"),
    ],
)
def test_completion_bad_requests(engine: ScriptedEngine, body: dict, param: str | None) -> None:
    assert_error(call(engine, "POST", "/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, None),
        ({"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}, "tools"),
        # tool_choice "auto" on a server without --enable-auto-tool-choice (vLLM's 400)
        (
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tool_choice",
        ),
        (
            {"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "Hi"}], "cache_salt": ""}, "cache_salt"),
    ],
)
def test_chat_bad_requests(engine: ScriptedEngine, body: dict, param: str | None) -> None:
    assert_error(call(engine, "POST", "/v1/chat/completions", json=body), 400, param)


def test_unknown_fields_are_ignored(engine: ScriptedEngine) -> None:
    response = call(engine, "POST", "/v1/completions", json={"prompt": "Hi", "frobnicate": 1})
    assert response.status_code == 200


def test_unknown_route_and_method(engine: ScriptedEngine) -> None:
    assert_error(call(engine, "GET", "/v1/nothing"), 404)
    assert_error(call(engine, "GET", "/v1/completions"), 405)


def test_chunked_body_over_the_limit(engine: ScriptedEngine) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b" " * 300

    response = call(engine, "POST", "/v1/completions", content=chunks())
    assert "content-length" not in response.request.headers
    assert_error(response, 413)


def test_reset_prefix_cache_route(engine: ScriptedEngine) -> None:
    auth = {"Authorization": "Bearer k"}
    assert_error(call(engine, "POST", "/reset_prefix_cache", api_key="k"), 401)
    done = call(engine, "POST", "/reset_prefix_cache", api_key="k", headers=auth)
    assert done.status_code == 200
    engine.prefix_cache_resettable = False  # requests hold blocks: nothing was reset
    assert "running" in assert_error(call(engine, "POST", "/reset_prefix_cache", headers=auth), 409)


def test_api_key(engine: ScriptedEngine) -> None:
    assert_error(call(engine, "GET", "/v1/models", api_key="k"), 401)
    assert_error(call(engine, "GET", "/v1/models", api_key="k", headers={"Authorization": "Bearer kk"}), 401)
    ok = call(engine, "GET", "/v1/models", api_key="k", headers={"Authorization": "Bearer k"})
    assert ok.json()["data"][0]["id"] == MODEL
    assert call(engine, "GET", "/health", api_key="k").status_code == 200
    assert call(engine, "GET", "/metrics", api_key="k").status_code == 200


def test_run_until_disconnect_cancels_the_work(engine: ScriptedEngine) -> None:
    class Disconnecting:
        async def receive(self) -> dict:
            await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

    async def consume() -> None:
        async for _ in engine.generate({"prompt_token_ids": [1]}, SamplingParams(), "r"):
            pass

    engine.hang = True
    assert asyncio.run(run_until_disconnect(Disconnecting(), consume())) is None  # type: ignore[arg-type]
    assert engine.closed == ["r"]


def test_merge_streams_closes_the_rest_on_error() -> None:
    closed = []

    async def stream(name: str, fail: bool) -> AsyncIterator[str]:
        try:
            yield name
            if fail:
                raise ValueError("bad")
            await asyncio.sleep(3600)
        finally:
            closed.append(name)

    async def run() -> list:
        seen = []
        with pytest.raises(ValueError, match="bad"):
            async for item in merge_streams([stream("a", False), stream("b", True)]):
                seen.append(item)
        return seen

    assert sorted(asyncio.run(run())) == [(0, "a"), (1, "b")]
    assert sorted(closed) == ["a", "b"]


def test_api_server_flags() -> None:
    args = build_parser().parse_args(
        [
            "api-server",
            "--port",
            "9000",
            "--served-model-name",
            "a",
            "b",
            "--api-key",
            "k",
            "--max-num-seqs",
            "4",
            "--reasoning-parser",
            "deepseek_r1",
        ]
    )
    settings = server_settings(args)
    assert (settings.served_model_names, settings.api_key) == (["a", "b"], "k")
    assert settings.reasoning_parser == "deepseek_r1"
    assert engine_settings_from_args(args) == {"max_num_seqs": "4"}
    assert server_settings(build_parser().parse_args(["api-server"])).served_model_names == [
        "SmolLM2-135M-Instruct"
    ]


@pytest.mark.parametrize(
    "flags",
    [
        ["--port", "70000"],
        ["--max-request-body-bytes", "0"],
        ["--max-num-seqs", "0"],
        ["--reasoning-parser", "granite"],  # the error lists the known ones (argparse's choices)
    ],
)
def test_api_server_bad_flags_exit_before_loading(flags: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["api-server", *flags])
    assert exit_info.value.code == 2
    error_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert flags[0].lstrip("-").replace("-", "_") in error_line.replace("-", "_")
