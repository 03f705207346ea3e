"""What the Serve modules check the same way on every shape of the app: the served model's settings,
the offline engine's greedy texts and the served ones equal to them, a closed stream aborting its
request, and the processes of a cluster by title."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import psutil

from engine import LLM, SamplingParams

MODEL = "served-model"
API_KEY = "sk-serve-test"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 12
# A 4-head tiny Llama splits over two TP ranks (SmolLM2's 9 heads do not).
ENGINE = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 64, "max_num_seqs": 16}


def engine_flags(model: Path) -> list[str]:
    flags = ["--model", str(model)]
    for key, value in ENGINE.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def processes_titled(prefix: str, root: psutil.Process | None = None) -> list[psutil.Process]:
    """The descendants of `root` (default: this test; the cluster's processes among them) whose title
    starts with `prefix`."""
    found = []
    for process in (root or psutil.Process()).children(recursive=True):
        try:
            if " ".join(process.cmdline()).startswith(prefix):
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def metric(base_url: str, series: str) -> float:
    """The first sample of /metrics whose line starts with `series` (a name, and the start of its
    labels if need be); 0 when there is none yet."""
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(series if "{" in series else series + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def offline_greedy_texts(model: Path) -> dict[str, str]:
    """Greedy texts of the offline engine, in this process with one worker."""
    llm = LLM(str(model), distributed_executor_backend="uni", **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    try:
        return {
            "completion": llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text,
            "chat": llm.chat(MESSAGES, greedy, use_tqdm=False)[0].outputs[0].text,
        }
    finally:
        llm.llm_engine.shutdown()


def assert_serves_greedy_texts(client: openai.OpenAI, expected: dict[str, str]) -> None:
    settings = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    whole = client.completions.create(prompt=PROMPT, **settings)
    assert whole.choices[0].text == expected["completion"]
    assert whole.usage.completion_tokens == MAX_TOKENS
    chunks = client.completions.create(prompt=PROMPT, stream=True, **settings)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected["completion"]

    reply = client.chat.completions.create(messages=MESSAGES, **settings)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected["chat"]
    chunks = client.chat.completions.create(messages=MESSAGES, stream=True, **settings)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["chat"]


def assert_a_closed_stream_aborts(base_url: str, client: openai.OpenAI) -> None:
    aborted = 'raypage:request_success_total{finished_reason="abort"'
    aborted_before = metric(base_url, aborted)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=480, temperature=0.0, stream=True
    )
    chunks = iter(stream)
    next(chunks), next(chunks)  # generating now
    stream.close()
    # A separate ingress polls the replica's metrics every second, and a poll may fall between the
    # abort's count (sent with the step that was running, which still counted the request) and the
    # core's next report: wait for both.
    names = (aborted, "raypage:num_requests_running", "raypage:kv_cache_usage_perc")
    deadline = time.monotonic() + 10
    while (values := [metric(base_url, name) for name in names]) != [aborted_before + 1, 0, 0]:
        assert time.monotonic() < deadline, f"{dict(zip(names, values, strict=True))} after the stream closed"
        time.sleep(0.2)
