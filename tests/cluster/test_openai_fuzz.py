"""Generated requests against a real `raypage api-server` over a tiny random Llama: hypothesis bodies
(invalid Unicode, huge and non-finite numbers, deep nesting, wrong types, unknown fields) on one
keep-alive connection, and schemathesis cases for every route of the server's OpenAPI schema. Every
answer is a success or a documented 4xx error object, never a 5xx (but the 504 of a `timeout` the
request set itself), and no connection drops (a dropped one would fail the next request)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cluster.remote_server import RemoteServer
from tests.model.tiny_models import write_tiny_model

MODEL = "fuzzed"
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "echo",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "priority", "stream",
    "stream_options", "min_tokens", "chat_template_kwargs", "tokens", "add_generation_prompt",
]  # fmt: skip
ERROR_STATUSES = {400, 404, 413, 422}  # 422 never comes: validation errors are 400s


def is_its_own_deadline(response: httpx.Response) -> bool:
    """A 504 for the `timeout` the request itself set (schemathesis draws tiny ones): the documented
    answer to a deadline that passed, not a server error."""
    return response.status_code == 504 and response.json()["error"]["param"] == "timeout"


surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.text(st.one_of(st.characters(), surrogates), max_size=20)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-2, max_value=40),
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "wizard"]) | texts, "content": json_values}
    ),
    max_size=3,
)


def encode(body: object) -> bytes:
    # ensure_ascii writes lone surrogates as \udXXX escapes, as a hostile client would.
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


@st.composite
def deeply_nested(draw: st.DrawFn) -> bytes:
    """A scalar inside up to 3000 lists, as text (json.dumps itself stops at Python's recursion limit)."""
    depth = draw(st.integers(min_value=0, max_value=3000))
    field = draw(st.sampled_from(FIELDS))
    nested = b"[" * depth + encode(draw(scalars)) + b"]" * depth
    return draw(st.sampled_from([nested, b'{"' + field.encode() + b'": ' + nested + b"}"]))


bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS) | texts, json_values | messages, max_size=6),
    st.fixed_dictionaries(
        {"prompt": texts, "max_tokens": st.integers(1, 4)},
        optional={"stop": json_values, "temperature": numbers, "logit_bias": json_values, "n": numbers},
    ),
    st.fixed_dictionaries({"messages": messages, "max_tokens": st.integers(1, 4)}),
    deeply_nested(),
    json_values,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    folder: Path = tmp_path_factory.mktemp("fuzz")
    flags = ["--model", str(write_tiny_model(folder / "model")), "--served-model-name", MODEL]
    flags += ["--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "128", "--disable-access-log"]
    server = RemoteServer(flags, folder / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def connection(server: RemoteServer) -> Iterator[httpx.Client]:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=server.base_url, limits=limits, timeout=60) as client:
        yield client


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_no_body_gets_a_5xx_or_drops_the_connection(
    connection: httpx.Client, route: str, body: object
) -> None:
    content = body if isinstance(body, bytes) else encode(body)
    response = connection.post(route, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (route, content[:200], response.text[:300])
    if response.status_code >= 400:
        assert response.status_code in ERROR_STATUSES - {422}, response.text[:300]
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code


def test_every_route_by_its_schema(server: RemoteServer) -> None:
    """schemathesis cases for every operation of /openapi.json (its pytest loader does not run on
    this pytest, so each operation's strategy is driven by hypothesis here)."""
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {operation.path for operation in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def check(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            if response.status_code >= 400:
                assert response.status_code in ERROR_STATUSES - {422} or is_its_own_deadline(response), (
                    response.status_code,
                    response.text[:300],
                )
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        check()


def test_the_server_logged_no_traceback(server: RemoteServer, connection: httpx.Client) -> None:
    assert connection.get("/health").status_code == 200
    assert "Traceback" not in server.log_tail(1_000_000)
