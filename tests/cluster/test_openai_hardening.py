"""Hostile and broken input against the FastAPI app over a scripted engine: every string checked as
Unicode, every number range-checked, chat messages validated, and no exception ever reaching the
server (a 500 error object on a connection that stays usable, logged with the request id).

A real uvicorn server (in a thread: the app needs no engine process) carries the keep-alive checks;
the same bugs against a real engine are in test_openai_server.py."""

from __future__ import annotations

import functools
import hmac
import logging
import threading
import time
from collections.abc import Iterator

import httpx
import jinja2.sandbox
import pydantic
import pytest
import uvicorn

from cluster.openai import ServerSettings, build_app, middleware
from cluster.openai.input_checks import find_invalid_string, format_path
from cluster.openai.protocol import MAX_STOP_STRINGS, CompletionRequest
from engine.frontend.tokenizer import load_tokenizer, render_chat_prompt
from engine.models.model_files import ModelSource, packaged_model_path
from tests.cluster.remote_server import free_port
from tests.cluster.test_openai_app import MODEL, ScriptedEngine, assert_error, call

JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = '"messages": [{"role": "user", "content": "Hi"}]'
packaged_tokenizer = functools.cache(lambda: load_tokenizer(ModelSource(packaged_model_path(), "gguf")))


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(packaged_tokenizer())


def post_raw(engine: ScriptedEngine, path: str, body: str) -> httpx.Response:
    # Lone surrogates are written as JSON escapes: the raw text itself stays valid UTF-8.
    return call(engine, "POST", path, content=body.encode(), headers=JSON)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, r'{"prompt": "Hi \ud800 there"}', "prompt"),
        (COMPLETIONS, r'{"prompt": ["ok", "\udfff"]}', "prompt"),
        (COMPLETIONS, r'{"prompt": "Hi", "stop": ["\ud800"]}', "stop"),
        (COMPLETIONS, r'{"prompt": "Hi", "model": "\ud800"}', "model"),
        (COMPLETIONS, r'{"prompt": "Hi", "logit_bias": {"\ud800": 1}}', "logit_bias"),
        (COMPLETIONS, r'{"prompt": "Hi", "user": "\udc00"}', "user"),
        (CHAT, r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages"),
        (
            CHAT,
            r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
            "messages",
        ),
        (
            CHAT,
            r'{"messages": [{"role": "user", "content": "x", "extra": {"deep": ["\ud800"]}}]}',
            "messages",
        ),
        (CHAT, "{" + USER + r', "chat_template_kwargs": {"k": "\ud800"}}', "chat_template_kwargs"),
        ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(engine, path: str, body: str, param: str | None) -> None:
    message = assert_error(post_raw(engine, path, body), 400, param)
    assert "not valid Unicode" in message and message.startswith(param)


def test_invalid_string_path() -> None:
    assert find_invalid_string({"a": [1, {"b": "ok"}], "c": "fine é"}) is None
    path = find_invalid_string({"messages": [{"content": "ok"}, {"content": ["x", "\ud800"]}]})
    assert format_path(path) == "messages[1].content[1]"
    # Nesting deeper than Python's recursion limit is walked without recursion.
    deep: list = ["\udc00"]
    for _ in range(5000):
        deep = [deep]
    assert len(find_invalid_string(deep)) == 5001


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, '{"prompt": "Hi", "temperature": NaN}', "temperature"),
        (COMPLETIONS, '{"prompt": "Hi", "top_p": Infinity}', "top_p"),
        (COMPLETIONS, '{"prompt": "Hi", "presence_penalty": -Infinity}', "presence_penalty"),
        (COMPLETIONS, '{"prompt": "Hi", "temperature": 1e400}', "temperature"),
        (COMPLETIONS, '{"prompt": "Hi", "priority": 100000000000000000000000}', "priority"),
        (COMPLETIONS, '{"prompt": "Hi", "top_k": 18446744073709551616}', "top_k"),
        (COMPLETIONS, '{"prompt": "Hi", "seed": 9223372036854775808}', "seed"),
        (COMPLETIONS, '{"prompt": "Hi", "n": 100000000000000000000}', "n"),
        (COMPLETIONS, '{"prompt": "Hi", "n": 1000, "temperature": 1}', "n"),
        (COMPLETIONS, '{"prompt": "Hi", "best_of": -1}', "best_of"),
        (COMPLETIONS, '{"prompt": "Hi", "max_tokens": 0}', "max_tokens"),
        (COMPLETIONS, '{"prompt": "Hi", "max_tokens": -5}', "max_tokens"),
        (COMPLETIONS, '{"prompt": "Hi", "min_tokens": -1}', "min_tokens"),
        (COMPLETIONS, '{"prompt": "Hi", "logprobs": -1}', "logprobs"),
        (COMPLETIONS, '{"prompt": "Hi", "logprobs": 1000}', "logprobs"),
        (COMPLETIONS, '{"prompt": "Hi", "temperature": -1}', "temperature"),
        (COMPLETIONS, '{"prompt": "Hi", "top_p": 1.5}', "top_p"),
        (COMPLETIONS, '{"prompt": "Hi", "top_k": -2}', "top_k"),
        (COMPLETIONS, '{"prompt": "Hi", "min_p": 2}', "min_p"),
        (COMPLETIONS, '{"prompt": "Hi", "frequency_penalty": 3}', "frequency_penalty"),
        (COMPLETIONS, '{"prompt": "Hi", "repetition_penalty": 0}', "repetition_penalty"),
        (COMPLETIONS, '{"prompt": "Hi", "logit_bias": {"99999999": 1}}', "logit_bias"),
        (COMPLETIONS, '{"prompt": "Hi", "logit_bias": {"1": "x"}}', "logit_bias"),
        (COMPLETIONS, '{"prompt": "Hi", "stop_token_ids": [-1]}', "stop_token_ids"),
        (COMPLETIONS, '{"prompt": [-1]}', "prompt"),
        (COMPLETIONS, '{"prompt": [[18446744073709551616]]}', "prompt"),
        (CHAT, "{" + USER + ', "logprobs": true, "top_logprobs": 21}', "top_logprobs"),
        (CHAT, "{" + USER + ', "logprobs": true, "top_logprobs": -1}', "top_logprobs"),
        (CHAT, "{" + USER + ', "max_completion_tokens": 1e30}', "max_completion_tokens"),
        ("/detokenize", '{"tokens": [18446744073709551616]}', "tokens"),
    ],
)
def test_numbers_out_of_range_are_400_naming_the_field(engine, path: str, body: str, param: str) -> None:
    assert_error(post_raw(engine, path, body), 400, param)


@pytest.mark.parametrize(
    "messages",
    [
        '[{"role": "wizard", "content": "Hi"}]',
        '[{"content": "Hi"}]',
        '[{"role": "user", "content": 5}]',
        '[{"role": "user", "content": {"text": "Hi"}}]',
        '[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
        '[{"role": "user", "content": [{"type": "text"}]}]',
        '["Hi"]',
        '"Hi"',
        "[]",
    ],
)
def test_bad_chat_messages_are_400(engine, messages: str) -> None:
    assert_error(post_raw(engine, CHAT, '{"messages": ' + messages + "}"), 400, "messages")


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool", "developer"])
def test_every_vllm_role_is_accepted(engine, role: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": role, "content": "x"}]}
    if role == "assistant":
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    assert call(engine, "POST", CHAT, json=body).status_code == 200


def test_a_request_chat_template_is_refused(engine) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "chat_template_kwargs": {"chat_template": "{{7*7}}"},
    }
    message = assert_error(call(engine, "POST", CHAT, json=body), 400, "chat_template_kwargs")
    assert "chat template" in message


def test_chat_templates_render_in_a_sandbox() -> None:
    """transformers renders chat templates with jinja2's ImmutableSandboxedEnvironment: a template
    reaching for Python internals fails (a TemplateError, which the routes answer with 400)."""
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.sandbox.SecurityError):
        render_chat_prompt(packaged_tokenizer(), [{"role": "user", "content": "x"}], chat_template=escape)
    mutate = "{% set _ = messages.append(1) %}{{ messages|length }}"
    with pytest.raises(jinja2.sandbox.SecurityError):
        render_chat_prompt(packaged_tokenizer(), [{"role": "user", "content": "x"}], chat_template=mutate)


def test_stop_list_length_is_bounded() -> None:
    with pytest.raises(pydantic.ValidationError, match="at most 256 items"):
        CompletionRequest(prompt="Hi", stop=["x"] * (MAX_STOP_STRINGS + 1))
    assert CompletionRequest(prompt="Hi", stop=["x"] * MAX_STOP_STRINGS).stop


# ---- the catch-all, over a real uvicorn server ----


class Broken(ScriptedEngine):
    """A scripted engine whose generate raises what no handler expects."""

    async def generate(self, prompt, sampling_params, request_id, priority=0):
        raise TypeError("surprise")
        yield  # an async generator


@pytest.fixture
def served() -> Iterator[tuple[str, ScriptedEngine]]:
    """A real uvicorn server over a scripted engine, in a thread, with a 4 MiB body limit."""
    scripted = ScriptedEngine(packaged_tokenizer())
    app = build_app(scripted, ServerSettings([MODEL], max_request_body_bytes=4 << 20, log_stats_interval=0))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", scripted
    server.should_exit = True
    thread.join(timeout=10)


def test_unexpected_exception_is_500_and_keeps_the_connection(
    served, caplog: pytest.LogCaptureFixture
) -> None:
    base_url, engine = served
    engine.__class__ = Broken
    with httpx.Client(base_url=base_url, limits=httpx.Limits(max_connections=1), timeout=30) as client:
        with caplog.at_level(logging.ERROR, logger="cluster.openai.catch_all"):
            failed = client.post(COMPLETIONS, json={"prompt": "Hi"}, headers={"X-Request-Id": "req-42"})
        assert_error(failed, 500)
        assert failed.headers["x-request-id"] == "req-42"
        assert "req-42" in caplog.text and "TypeError" in caplog.text
        engine.__class__ = ScriptedEngine
        # The same keep-alive connection serves the next request.
        assert client.post(COMPLETIONS, json={"prompt": "Hi"}).status_code == 200
        assert client.get("/health").headers["x-request-id"]  # a fresh id when none is sent


def test_hostile_bodies_keep_the_connection(served) -> None:
    """Invalid Unicode, NaN, deep nesting, a chunked body: each answered 4xx on one connection."""
    base_url, _ = served
    deep = "[" * 100_000 + "]" * 100_000
    bodies = [
        r'{"prompt": "Hi \ud800"}',
        '{"prompt": "Hi", "temperature": NaN}',
        '{"prompt": "Hi", "x": ' + deep + "}",
        deep,
        '{"prompt": "Hi", "stop": "\\udfff"}',
        "\udcff not even JSON".encode("utf-8", "surrogateescape").decode("latin-1"),
    ]
    with httpx.Client(base_url=base_url, limits=httpx.Limits(max_connections=1), timeout=30) as client:
        for body in bodies:
            response = client.post(COMPLETIONS, content=body.encode("latin-1"), headers=JSON)
            assert 400 <= response.status_code < 500, (body[:40], response.text)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
            for _ in range(5):
                yield b"x" * (1 << 20)

        assert_error(client.post(COMPLETIONS, content=chunks(), headers=JSON), 413)
        assert client.post(COMPLETIONS, json={"prompt": "Hi"}).status_code == 200


def test_request_id_that_is_unsafe_is_replaced(engine) -> None:
    response = call(engine, "GET", "/health", headers={"X-Request-Id": "a b\tc" + "x" * 200})
    assert response.headers["x-request-id"] != "a b\tc" + "x" * 200
    assert len(response.headers["x-request-id"]) == 32


def test_api_key_is_compared_in_constant_time_and_kept_out_of_reprs(engine, monkeypatch) -> None:
    compared = []
    compare_digest = hmac.compare_digest

    def spy(given: bytes, expected: bytes) -> bool:
        compared.append(given)
        return compare_digest(given, expected)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    headers = {"Authorization": "Bearer sk-secret"}
    assert call(engine, "GET", "/v1/models", api_key="sk-secret", headers=headers).status_code == 200
    assert call(engine, "GET", "/v1/models", api_key="sk-secret").status_code == 401
    assert compared == [b"Bearer sk-secret", b""]
    settings = ServerSettings([MODEL], api_key="sk-secret")
    app = build_app(engine, settings)
    assert "sk-secret" not in repr(settings) + repr(app.user_middleware)
