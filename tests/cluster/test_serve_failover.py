"""Failover behind the separate ingress: an LLMServer replica killed while 16 greedy streams run on
two replicas, on this module's local Ray cluster; every stream completes without an error, and each
text equals the same request's text on the offline engine. With failover off the client
gets a clear error; with no replica to take over within failover_timeout_s, too. Plus, without a
cluster: the text across the seam (a character split by it, a stop string straddling it) and a
seeded request's continuation."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import ray
from ray import serve
from transformers import AutoTokenizer

from cluster.serve.failover import NotResumableError, StreamProgress
from cluster.serve_app import build_app
from engine import LLM
from engine.frontend.detokenizer import IncrementalDetokenizer, backend_tokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from engine.worker.input_batch import position_seed
from tests.cluster.local_ray_cluster import serve_url_fixture
from tests.model.tiny_models import write_tiny_model

APP = "raypage"
MODEL = "m"
# Room for all 16 streams on one replica (16 x 16 blocks) once the other is gone: no preemption.
ENGINE = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 320}
PROMPTS = [f"Request {i} asks about the history of the number {i * 7}:" for i in range(16)]
MAX_TOKENS = 200
# Caps that only keep a broken cluster from hanging the test; nothing here is timed.
STARTED_TIMEOUT_S = 120.0
CLIENT_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "model")


base_url = serve_url_fixture(num_cpus=3)


def deploy(model: Path, **options: object) -> None:
    args = {
        "model": str(model),
        **ENGINE,
        "served_model_name": MODEL,
        "ingress": "separate",
        "ingress_cpus": 0.5,
        "log_stats_interval": 0,
        **options,
    }
    serve.run(build_app(args), name=APP, route_prefix="/")


def kill_a_replica() -> None:
    """Kill one LLMServer replica's actor (Serve then starts a replacement)."""
    names = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer#")
    ]
    assert names, "no LLMServer replica actor"
    ray.kill(ray.get_actor(sorted(names)[0], namespace="serve"), no_restart=True)


async def stream_text(
    client: openai.AsyncOpenAI, prompt: str, started: asyncio.Event
) -> tuple[str, str | None, openai.types.CompletionUsage | None]:
    """(text, finish_reason, usage) of one greedy stream; `started` is set at its first text."""
    chunks = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces, finish_reason, usage = [], None, None
    async for chunk in chunks:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish_reason = chunk.choices[0].finish_reason or finish_reason
            started.set()
        usage = chunk.usage or usage
    return "".join(pieces), finish_reason, usage


async def streams_with_a_replica_killed(base_url: str, prompts: list[str]) -> list[tuple]:
    """Every prompt's stream, one replica killed once each stream has received text."""
    client = openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    started = [asyncio.Event() for _ in prompts]
    tasks = [
        asyncio.create_task(stream_text(client, prompt, event))
        for prompt, event in zip(prompts, started, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), STARTED_TIMEOUT_S)
    await asyncio.to_thread(kill_a_replica)
    return await asyncio.gather(*tasks, return_exceptions=True)


def failover_counts(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {
        name: float(value)
        for name, value in re.findall(r'^raypage:failover_(\w+)_total\{model_name="m"\} (\S+)$', text, re.M)
    }


@pytest.fixture(scope="module")
def expected(model: Path) -> list[str]:
    """Each prompt's greedy text on an offline engine. All 16 in one batch: one at a time took 16 x
    MAX_TOKENS engine steps (about 25 s on two cores); that the first prompt's text alone is the same
    shows the batch changes no text."""
    llm = LLM(str(model), distributed_executor_backend="uni", **ENGINE)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        texts = [output.outputs[0].text for output in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        assert llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].text == texts[0]
        return texts
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_streams_of_a_killed_replica_continue_on_the_other(
    base_url: str, model: Path, expected: list[str]
) -> None:
    deploy(model, num_replicas=2, llm_server_cpus=1)
    try:
        results = asyncio.run(streams_with_a_replica_killed(base_url, PROMPTS))
        errors = [result for result in results if isinstance(result, BaseException)]
        assert not errors, errors
        prompt_lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(model)(PROMPTS).input_ids]
        for (text, finish_reason, usage), reference, prompt_length in zip(
            results, expected, prompt_lengths, strict=True
        ):
            assert text == reference
            assert finish_reason == "length"
            # One continuous stream: the original prompt, every token once.
            assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_length, MAX_TOKENS)
        counts = failover_counts(base_url)
        print("failover counters:", counts)
        assert counts["resumed_requests"] >= 1
        assert counts["failed_requests"] == 0
    finally:
        serve.delete(APP)


def killed_stream_error(base_url: str) -> openai.APIError:
    """The error a stream gets when its only replica is killed after its first text."""
    client = openai.OpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    stream = iter(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    next(stream)
    kill_a_replica()
    with pytest.raises(openai.APIError) as error:
        for _ in stream:
            pass
    return error.value


@pytest.mark.slow
def test_with_failover_off_the_stream_ends_with_a_clear_error(base_url: str, model: Path) -> None:
    deploy(model, num_replicas=1, failover=False)
    try:
        error = killed_stream_error(base_url)
        assert "the LLMServer replica is gone (ActorDiedError)" in str(error)
        assert failover_counts(base_url) == {"resumed_requests": 0.0, "failed_requests": 0.0}
    finally:
        serve.delete(APP)


@pytest.mark.slow
def test_without_a_replica_within_the_timeout_the_stream_ends_with_a_clear_error(
    base_url: str, model: Path
) -> None:
    # Serve's replacement for the one replica takes longer than this to start its engine.
    deploy(model, num_replicas=1, failover_timeout_s=0.5)
    try:
        error = killed_stream_error(base_url)
        assert "no healthy replica took it over within failover_timeout_s=0.5 s" in str(error)
        assert failover_counts(base_url)["failed_requests"] == 1
    finally:
        serve.delete(APP)


# ---- without a cluster -------------------------------------------------------------------------


def delta(request_id: str, prompt_ids: list[int], text: str, token_ids: list[int], **fields) -> RequestOutput:
    """A replica's DELTA output of one sequence."""
    finished = fields.get("finish_reason") is not None
    completion = CompletionOutput(index=0, text=text, token_ids=token_ids, **fields)
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_ids,
        outputs=[completion],
        finished=finished,
    )


def test_the_text_across_the_seam_is_an_uninterrupted_runs(model: Path) -> None:
    """At every seam: multibyte characters split across tokens, text held back for a stop string,
    and a stop string that starts before the seam and ends after it."""
    tokenizer = backend_tokenizer(AutoTokenizer.from_pretrained(model))
    prompt_ids = tokenizer.encode("Say it:").ids
    text = "Café 😀🎉 und Grüße, 日本語 END of it all"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text  # byte-level BPE: the text round-trips
    stop = "日本語 END"
    reference = text[: text.index(stop)]  # vLLM leaves the stop string out
    params = SamplingParams(
        temperature=0.8, seed=2**63 - 1, max_tokens=100, stop=[stop], output_kind=RequestOutputKind.DELTA
    )
    for seam in range(1, len(ids)):
        progress = StreamProgress("r", "Say it:", params, tokenizer)
        # The first replica, which sends a delta per token, until it dies.
        first = IncrementalDetokenizer(tokenizer, prompt_ids, True, [stop])
        sent = []
        for token in ids[:seam]:
            piece = first.add_tokens([token])
            if first.stop_reason is not None:
                break
            sent.append(progress.deliver(delta("r", prompt_ids, piece, [token])).outputs[0].text)
        if first.stop_reason is not None:
            break  # the stream would have finished before this seam
        prompt, resumed = progress.resubmission()
        assert prompt["prompt_token_ids"] == [*prompt_ids, *ids[:seam]]
        assert (resumed.max_tokens, resumed.seed) == (100 - seam, position_seed(2**63 - 1, seam))
        # The second replica, which sees the delivered tokens as prompt, three tokens a step.
        second = IncrementalDetokenizer(tokenizer, prompt["prompt_token_ids"], True, [stop])
        for start in range(seam, len(ids), 3):
            chunk = ids[start : start + 3]
            piece = second.add_tokens(chunk)
            fields = {"finish_reason": "stop", "stop_reason": stop} if second.stop_reason else {}
            if start + 3 >= len(ids) and not fields:
                fields = {"finish_reason": "length"}
            output = progress.deliver(
                delta("r-failover1", prompt["prompt_token_ids"], piece, chunk, **fields)
            )
            assert (output.request_id, output.prompt_token_ids) == ("r", prompt_ids)
            sent.append(output.outputs[0].text)
            if output.finished:
                break
        assert "".join(sent) == reference, seam
        assert (output.outputs[0].finish_reason, output.outputs[0].stop_reason) == ("stop", stop)


def test_what_cannot_continue_exactly_ends_with_a_clear_error(model: Path) -> None:
    tokenizer = backend_tokenizer(AutoTokenizer.from_pretrained(model))
    two = SamplingParams(n=2, temperature=1.0, output_kind=RequestOutputKind.DELTA)
    progress = StreamProgress("r", "Hi", two, tokenizer)
    assert progress.resubmission() == ("Hi", two)  # nothing sent yet: the request starts again
    progress.deliver(delta("r", [1, 2], "a", [3]))
    with pytest.raises(NotResumableError, match="cannot be resumed on another replica: requests with n > 1"):
        progress.resubmission()
    penalized = msgspec.structs.replace(two, n=1, presence_penalty=0.5)
    progress = StreamProgress("r", "Hi", penalized, tokenizer)
    progress.deliver(delta("r", [1, 2], "a", [3]))
    with pytest.raises(NotResumableError, match="presence and frequency penalties"):
        progress.resubmission()
    constrained = msgspec.structs.replace(
        two, n=1, structured_outputs=StructuredOutputsParams(regex="[a-z]+")
    )
    progress = StreamProgress("r", "Hi", constrained, tokenizer)
    progress.deliver(delta("r", [1, 2], "a", [3]))
    with pytest.raises(NotResumableError, match="place in its grammar"):
        progress.resubmission()


def test_a_resumed_request_keeps_its_cache_salt(model: Path) -> None:
    """The continuation is the same tenant's: it must find (and fill) that tenant's cache only."""
    tokenizer = backend_tokenizer(AutoTokenizer.from_pretrained(model))
    params = SamplingParams(max_tokens=8, output_kind=RequestOutputKind.DELTA)
    salted = {"prompt": "Hi", "prompt_token_ids": [1, 2], "cache_salt": "tenant-a"}
    progress = StreamProgress("r", salted, params, tokenizer)
    progress.deliver(delta("r", [1, 2], "a", [3]))
    prompt, _ = progress.resubmission()
    assert (prompt["prompt_token_ids"], prompt["cache_salt"]) == ([1, 2, 3], "tenant-a")


def test_a_seeded_request_resumed_after_some_tokens_draws_what_it_would_have(model: Path) -> None:
    llm = LLM(str(model), distributed_executor_backend="uni", **ENGINE)
    try:
        tokenizer = backend_tokenizer(llm.get_tokenizer())
        params = SamplingParams(
            temperature=1.0,
            seed=2**63 - 1,
            max_tokens=24,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        whole = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
        tokens = whole.outputs[0].token_ids
        for seam in (1, 9, 23):
            progress = StreamProgress("r", PROMPTS[0], params, tokenizer)
            progress.deliver(delta("r", whole.prompt_token_ids, "", tokens[:seam]))
            prompt, resumed = progress.resubmission()
            continued = llm.generate(prompt, resumed, use_tqdm=False)[0].outputs[0].token_ids
            assert continued == tokens[seam:], seam
    finally:
        llm.llm_engine.shutdown()
