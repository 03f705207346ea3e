"""The official openai client (and raw httpx for malformed requests) against a real
`raypage api-server` subprocess, once on the packaged SmolLM2 and once on a tiny random Llama (with
a Qwen3-style thinking chat template and --reasoning-parser qwen3)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from engine.frontend.tokenizer import load_tokenizer
from engine.models.model_files import ModelSource
from tests.cluster.remote_server import RemoteServer
from tests.model.tiny_models import write_tiny_model

MODEL = "served-model"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
SERVER_FLAGS = [
    *("--served-model-name", MODEL, "--api-key", API_KEY, "--disable-access-log"),
    "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: the cache_salt test's
]
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "128", "--max-num-seqs", "64"]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
# Qwen3's chat format with its thinking switch turned around: the template closes the reasoning in
# the prompt (`<think>\n\n</think>\n\n`, as Qwen3's does for enable_thinking false) unless the
# request's chat_template_kwargs turn thinking on, so the module's other chat tests get all of the
# output as content with the reasoning parser on.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
REASONING_FLAGS = ["--reasoning-parser", "qwen3"]


def write_thinking_model(folder: Path) -> Path:
    """The tiny random Llama with THINKING_TEMPLATE as its chat template."""
    model = write_tiny_model(folder)
    tokenizer = load_tokenizer(ModelSource(model, "hf"))
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(model)
    return model


@pytest.fixture(scope="module", params=["smollm2", "tiny-llama"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    folder: Path = tmp_path_factory.mktemp(request.param)
    model = (
        []
        if request.param == "smollm2"
        else ["--model", str(write_thinking_model(folder / "model")), *REASONING_FLAGS]
    )
    server = RemoteServer(
        [*model, *SERVER_FLAGS, *ENGINE_FLAGS, "--max-model-len", str(MAX_MODEL_LEN)], folder / "server.log"
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def post(server: RemoteServer, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", **kwargs.pop("headers", {})}
    return httpx.post(server.base_url + path, headers=headers, timeout=120, **kwargs)


def count_tokens(server: RemoteServer, **body) -> int:
    return post(server, "/tokenize", json={"model": MODEL, **body}).json()["count"]


def test_completion_stream_matches_the_whole(server: RemoteServer, client: openai.OpenAI) -> None:
    settings = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    whole = client.completions.create(**settings, logprobs=0)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion" and whole.model == MODEL
    (choice,) = whole.choices
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens == count_tokens(server, prompt=PROMPT)
    assert whole.usage.completion_tokens == len(choice.logprobs.tokens)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(delta.text for delta in deltas) == choice.text
    assert [delta.finish_reason for delta in deltas] == [None] * (len(deltas) - 1) + [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_stream_matches_the_whole(server: RemoteServer, client: openai.OpenAI) -> None:
    settings = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 8, "temperature": 0.0}
    whole = client.chat.completions.create(**settings)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert whole.usage.prompt_tokens == count_tokens(server, messages=MESSAGES)

    chunks = list(
        client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True})
    )
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert deltas[0].delta.role == "assistant"
    assert "".join(delta.delta.content or "" for delta in deltas) == choice.message.content
    assert [delta.finish_reason for delta in deltas] == [None] * (len(deltas) - 1) + [choice.finish_reason]
    # All but the cached-token count: the stream finds the blocks of the whole's prompt.
    assert chunks[-1].usage.model_copy(update={"prompt_tokens_details": None}) == whole.usage.model_copy(
        update={"prompt_tokens_details": None}
    )


def test_reasoning_is_split_from_the_content(server: RemoteServer, client: openai.OpenAI) -> None:
    """The grammar makes the random model write `<think>…</think>answer`; the reply carries the two
    parts apart, whole and streamed, and the tags in neither. With thinking left off, the template
    closed the reasoning in the prompt, and the same text is all content."""
    if REASONING_FLAGS[0] not in server.process.args:
        pytest.skip("only the tiny model's server runs with a reasoning parser")
    think = r"<think>[a-z]{2,5} [a-z]{2,5}</think>[a-z]{2,5} [a-z]{2,5}"
    settings = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 64, "temperature": 0.0}
    on = {"structured_outputs": {"regex": think}, "chat_template_kwargs": {"enable_thinking": True}}
    whole = client.chat.completions.create(**settings, extra_body=on)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning"]
    assert re.fullmatch(think, f"<think>{reasoning}</think>{message.content}"), (reasoning, message.content)
    assert message.model_extra["reasoning_content"] == reasoning

    chunks = list(client.chat.completions.create(**settings, extra_body=on, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.model_extra.get("reasoning") or "" for delta in deltas) == reasoning
    assert "".join(delta.content or "" for delta in deltas) == message.content

    off = client.chat.completions.create(**settings, extra_body={"structured_outputs": {"regex": think}})
    assert re.fullmatch(think, off.choices[0].message.content)
    assert off.choices[0].message.model_extra["reasoning"] is None
    # chat_template_kwargs reached the template: thinking off adds `<think>\n\n</think>\n\n` to the prompt.
    assert off.usage.prompt_tokens > whole.usage.prompt_tokens


def test_n2_streams_tag_choices_and_match_seeded_whole(client: openai.OpenAI) -> None:
    settings = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 7}
    whole = client.completions.create(**settings)
    assert [choice.index for choice in whole.choices] == [0, 1]
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list] = {0: [], 1: []}
    for chunk in client.completions.create(**settings, stream=True):
        (delta,) = chunk.choices
        texts[delta.index] += delta.text
        finishes[delta.index].append(delta.finish_reason)
    # Each seeded sequence draws from its own generator, so the stream repeats the whole response.
    assert texts == {choice.index: choice.text for choice in whole.choices}
    for index in (0, 1):
        assert finishes[index][-1] is not None and finishes[index].count(None) == len(finishes[index]) - 1

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2, seed=3)
    assert [choice.index for choice in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens <= 6


def test_seed_repeats_a_sample(client: openai.OpenAI) -> None:
    settings = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    assert (
        client.completions.create(**settings).choices[0].text
        == client.completions.create(**settings).choices[0].text
    )


def test_stop_string_and_stop_token(server: RemoteServer, client: openai.OpenAI) -> None:
    settings = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    whole = client.completions.create(**settings, logprobs=0)
    text, tokens = whole.choices[0].text, whole.choices[0].logprobs.tokens
    stop = text.strip()[:2]
    stopped = client.completions.create(**settings, stop=[stop]).choices[0]
    assert stopped.text == text[: text.find(stop)]
    assert (stopped.finish_reason, stopped.model_extra["stop_reason"]) == ("stop", stop)

    # A generated token after the first that is one token again when tokenized on its own.
    token_id = next(
        ids
        for token in tokens[1:]
        if len(
            ids := post(server, "/tokenize", json={"prompt": token, "add_special_tokens": False}).json()[
                "tokens"
            ]
        )
        == 1
    )
    by_id = client.completions.create(**settings, extra_body={"stop_token_ids": token_id}).choices[0]
    assert by_id.finish_reason == "stop" and by_id.model_extra["stop_reason"] == token_id[0]
    assert text.startswith(by_id.text) and len(by_id.text) < len(text)


def test_logprobs(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 2 <= len(top) <= 3 and top[token] == logprob == max(top.values())  # greedy: the likeliest
    assert logprobs.text_offset[0] == 0

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())


def test_prompt_forms_and_echo(server: RemoteServer, client: openai.OpenAI) -> None:
    prompts = [PROMPT, "Once upon a time"]
    settings = {"model": MODEL, "max_tokens": 4, "temperature": 0.0}
    batch = client.completions.create(prompt=prompts, echo=True, **settings)
    assert [choice.index for choice in batch.choices] == [0, 1]
    for prompt, choice in zip(prompts, batch.choices, strict=True):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    # Echo with logprobs scores the prompt too; its first token has no logprob.
    scored = client.completions.create(prompt=PROMPT, echo=True, logprobs=1, **settings).choices[0]
    num_prompt_tokens = count_tokens(server, prompt=PROMPT)
    assert len(scored.logprobs.tokens) == num_prompt_tokens + 4
    assert scored.logprobs.token_logprobs[0] is None and None not in scored.logprobs.token_logprobs[1:]
    assert "".join(scored.logprobs.tokens) == scored.text
    ids = post(server, "/tokenize", json={"prompt": prompts[1]}).json()["tokens"]
    by_ids = client.completions.create(prompt=[ids, ids], **settings)
    assert by_ids.choices[1].text == batch.choices[1].text[len(prompts[1]) :]
    assert by_ids.usage.prompt_tokens == 2 * len(ids)


def test_sampling_extras_are_accepted(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="tester",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 5,
            "ignore_eos": True,
        },
    )
    assert completion.usage.completion_tokens == 5 and completion.choices[0].finish_reason == "length"


def test_models_version_tokenize(server: RemoteServer, client: openai.OpenAI) -> None:
    (card,) = client.models.list().data
    assert (
        card.id == MODEL and card.owned_by == "raypage" and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    )
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(server.base_url + "/version", headers=headers).json()["version"]
    tokens = post(server, "/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}


def long_prompt_message(num_prompt_tokens: int, max_tokens: int) -> str:
    return (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the "
        "completion). Please reduce the length of the messages or completion."
    )


@pytest.mark.parametrize(
    ("case", "status", "param"),
    [
        ("malformed_json", 400, None),
        ("oversized_body", 413, None),
        ("missing_key", 401, None),
        ("wrong_key", 401, None),
        ("unknown_model", 404, "model"),
        ("negative_temperature", 400, "temperature"),
        ("string_temperature", 400, "temperature"),
        ("too_many_logprobs", 400, "logprobs"),
        ("empty_cache_salt", 400, "cache_salt"),
    ],
)
def test_error_shapes(server: RemoteServer, case: str, status: int, param: str | None) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    requests = {
        "malformed_json": {"content": b'{"model": "x", "prompt": '},
        "oversized_body": {"json": {**body, "prompt": "x" * (2 << 20)}},
        "missing_key": {"json": body, "headers": {"Authorization": ""}},
        "wrong_key": {"json": body, "headers": {"Authorization": f"Bearer {API_KEY}x"}},
        "unknown_model": {"json": {**body, "model": "nope"}},
        "negative_temperature": {"json": {**body, "temperature": -1}},
        "string_temperature": {"json": {**body, "temperature": "hot"}},
        "too_many_logprobs": {"json": {**body, "logprobs": 21}},
        "empty_cache_salt": {"json": {**body, "cache_salt": ""}},
    }
    response = post(server, "/v1/completions", **requests[case])
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["code"], error["param"]) == (status, param)


def test_prompts_over_the_context(server: RemoteServer, client: openai.OpenAI) -> None:
    prompt = "hello " * MAX_MODEL_LEN
    num_tokens = count_tokens(server, prompt=prompt)
    with pytest.raises(openai.BadRequestError) as completion_error:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=10)
    assert completion_error.value.body["message"] == long_prompt_message(num_tokens, 10)

    messages = [{"role": "user", "content": "Tell me a story."}]
    num_tokens = count_tokens(server, messages=messages)
    with pytest.raises(openai.BadRequestError) as chat_error:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_MODEL_LEN)
    assert chat_error.value.body["message"] == long_prompt_message(num_tokens, MAX_MODEL_LEN)


def test_client_errors_and_open_routes(server: RemoteServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    assert httpx.get(server.base_url + "/version").status_code == 401


def prefix_cache_hits(server: RemoteServer) -> float:
    """The engine's prefix-cache hits (in tokens) so far, from /metrics."""
    lines = httpx.get(server.base_url + "/metrics").text.splitlines()
    return sum(
        float(line.split()[-1]) for line in lines if line.startswith("raypage:prefix_cache_hits_total")
    )


def test_reset_prefix_cache(server: RemoteServer, client: openai.OpenAI) -> None:
    prompt = (
        "A prompt long enough to fill two KV blocks of sixteen tokens, so that its prefix is cached. " * 2
    )

    def hits_of_one_completion() -> float:
        before = prefix_cache_hits(server)
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
        return prefix_cache_hits(server) - before

    hits_of_one_completion()
    assert hits_of_one_completion() > 0  # the second request finds the first one's blocks
    assert httpx.post(server.base_url + "/reset_prefix_cache").status_code == 401
    assert post(server, "/reset_prefix_cache").status_code == 200
    assert hits_of_one_completion() == 0  # forgotten: computed again


def test_cache_salt_isolates_tenants_in_the_prefix_cache(server: RemoteServer, client: openai.OpenAI) -> None:
    """Only requests with the same cache_salt share cached blocks (the unsalted ones among
    themselves), on both routes, as the usage's cached_tokens shows the client."""
    prompt = "Tenant isolation over HTTP: a prompt of three KV blocks that only this test sends. " * 2
    num_cached = (count_tokens(server, prompt=prompt) - 1) // 16 * 16  # whole blocks, not the last token

    def completion(salt: str | None) -> tuple[int, str]:
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0, **extra
        )
        return response.usage.prompt_tokens_details.cached_tokens, response.choices[0].text

    runs = [completion(salt) for salt in (None, "tenant-a", "tenant-b", "tenant-a", None)]
    assert num_cached >= 32 and [cached for cached, _ in runs] == [0, 0, 0, num_cached, num_cached]
    assert len({text for _, text in runs}) == 1  # the salt changes what is cached, never the output

    messages = [{"role": "user", "content": prompt}]

    def chat(salt: str) -> int:
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=2, extra_body={"cache_salt": salt}
        )
        return response.usage.prompt_tokens_details.cached_tokens

    first, other, again = chat("tenant-c"), chat("tenant-d"), chat("tenant-c")
    assert (first, other) == (0, 0) and again >= num_cached and again % 16 == 0


def test_invalid_unicode_is_400_and_keeps_the_connection(server: RemoteServer) -> None:
    """The bug of issue 11: a lone surrogate in a prompt was a 500 from the tokenizer, and the
    exception reached uvicorn, which dropped the keep-alive connection under the next request."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    bodies = {
        "/v1/completions": rb'{"model": "%s", "prompt": "Hi \ud800 there", "max_tokens": 2}' % MODEL.encode(),
        "/v1/chat/completions": rb'{"messages": [{"role": "user", "content": "\udc00"}], "max_tokens": 2}',
    }
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=server.base_url, headers=headers, limits=limits, timeout=120) as http:
        for path, body in bodies.items():
            refused = http.post(path, content=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] in ("prompt", "messages")
            assert refused.headers.get("connection", "keep-alive") != "close"
            ok = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
            assert ok.status_code == 200, ok.text
    assert "Traceback" not in server.log_tail(100_000)


def test_api_key_is_never_logged(server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for authorization in (f"Bearer {API_KEY}", f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}", API_KEY, ""):
        post(server, "/v1/completions", json=body, headers={"Authorization": authorization})
    post(server, "/v1/completions", content=b"{", headers={"X-Request-Id": "logged-id"})
    assert API_KEY not in server.log_path.read_text(errors="replace")


def test_internal_sockets_are_private(server: RemoteServer) -> None:
    """The server's only TCP listener is its own HTTP port; the engine core listens on no TCP port,
    and its ZeroMQ sockets are ipc:// files in a directory only its user can enter (0700)."""
    front = psutil.Process(server.process.pid)
    listening = [
        (conn.laddr.ip, conn.laddr.port)
        for process in [front, *front.children(recursive=True)]
        for conn in process.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert listening == [("127.0.0.1", server.port)]
    core_sockets = {
        conn.laddr for conn in psutil.Process(server.core_pid()).net_connections(kind="unix") if conn.laddr
    }
    socket_dirs = {os.path.dirname(path) for path in core_sockets if "raypage-core-" in path}
    assert socket_dirs, core_sockets
    assert all(stat.S_IMODE(os.stat(folder).st_mode) == 0o700 for folder in socket_dirs)
