"""Scale-out on Ray Serve, on this module's local Ray cluster: two models in one application (one
OpenAIIngress routing by `model` to an LLMServer deployment per model) answering by name through the
official openai client, and the second model's deployment autoscaling from one replica to two under
a burst of requests and back to one once the burst ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from ray import serve

from cluster.serve_app import build_app
from engine import LLM, SamplingParams
from tests.cluster.local_ray_cluster import serve_on_local_cluster
from tests.model.tiny_models import write_tiny_model

# The short look-back below is this test's choice (Serve warns that it is shorter than a deprecated default).
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")]

APP = "raypage"
PROMPT = "The capital of France is"
MAX_TOKENS = 12
ENGINE = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 64, "max_num_seqs": 16}
# Scale up as soon as a replica averages more than two requests, down two seconds after the load ends.
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 0,
    "downscale_delay_s": 2,
    "look_back_period_s": 2,
}
# Serve's handles and replicas report their load every 10 s by default: too slow for a short test.
METRIC_PUSH_ENV = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}
# Caps that only keep a broken cluster from hanging the test; nothing here is timed.
SCALE_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny Llamas with different weights, so that a request answered by the wrong one shows."""
    folder = tmp_path_factory.mktemp("models")
    return {name: write_tiny_model(folder / name, seed=seed) for seed, name in enumerate(("alpha", "beta"))}


@pytest.fixture(scope="module")
def expected(models: dict[str, Path]) -> dict[str, str]:
    """Each model's greedy text on an offline engine in this process."""
    texts = {}
    for name, path in models.items():
        llm = LLM(str(path), distributed_executor_backend="uni", **ENGINE)
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
            texts[name] = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
        finally:
            llm.llm_engine.shutdown()
    assert texts["alpha"] != texts["beta"]
    return texts


@pytest.fixture(scope="module")
def base_url(models: dict[str, Path]) -> Iterator[str]:
    """The two-model app, run by Serve on a local cluster (its processes inherit METRIC_PUSH_ENV)."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in METRIC_PUSH_ENV.items():
            env.setenv(key, value)
        with serve_on_local_cluster(num_cpus=4) as url:
            args = {
                "ingress": "separate",
                "ingress_cpus": 0.5,
                "log_stats_interval": 0,
                "models": [
                    {"model": str(models["alpha"]), "served_model_name": "alpha", **ENGINE},
                    {
                        "model": str(models["beta"]),
                        "served_model_name": ["beta", "beta-alias"],
                        **ENGINE,
                        "max_model_len": 256,  # other engine settings than alpha's
                        "autoscaling_config": AUTOSCALING,
                    },
                ],
            }
            serve.run(build_app(args), name=APP, route_prefix="/")
            try:
                yield url
            finally:
                serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_text(client: openai.OpenAI, model: str, stream: bool = False) -> str:
    settings = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if stream:
        chunks = client.completions.create(stream=True, **settings)
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    return client.completions.create(**settings).choices[0].text


def test_two_models_in_one_app_answer_by_name(
    base_url: str, client: openai.OpenAI, expected: dict[str, str]
) -> None:
    cards = {card.id: card for card in client.models.list()}
    assert list(cards) == ["alpha", "beta", "beta-alias"]
    assert [cards[name].max_model_len for name in cards] == [512, 256, 256]  # type: ignore[attr-defined]

    assert greedy_text(client, "alpha") == expected["alpha"]
    assert greedy_text(client, "beta", stream=True) == expected["beta"]
    assert greedy_text(client, "beta-alias") == expected["beta"]
    with pytest.raises(openai.NotFoundError, match="The model `gamma` does not exist"):
        greedy_text(client, "gamma")
    # The context check is each model's own.
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens"):
        client.completions.create(model="beta", prompt=PROMPT, max_tokens=300)

    # /metrics shows both models' replicas (polled every second), each family once.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(base_url + "/metrics", timeout=10).text
        if 'model_name="alpha"' in text and 'model_name="beta"' in text:
            break
        time.sleep(0.5)
    assert 'model_name="alpha"' in text and 'model_name="beta"' in text
    assert text.count("# TYPE raypage:num_requests_running ") == 1


def running_replicas(deployment: str) -> int:
    states = serve.status().applications[APP].deployments[deployment].replica_states
    return states.get("RUNNING", 0)


def wait_for_replicas(deployment: str, count: int) -> None:
    deadline = time.monotonic() + SCALE_TIMEOUT_S
    while running_replicas(deployment) != count:
        assert time.monotonic() < deadline, f"{deployment} did not reach {count} replica(s)"
        time.sleep(0.5)


def test_a_burst_scales_the_model_from_one_replica_to_two_and_back(
    client: openai.OpenAI, expected: dict[str, str]
) -> None:
    deployment = "LLMServer:beta"
    assert running_replicas(deployment) == 1
    assert running_replicas("LLMServer:alpha") == 1
    scaled_up = threading.Event()
    texts: list[str] = []
    errors: list[BaseException] = []

    def keep_asking() -> None:
        # Long enough requests that a replica holds several at once until the second one is up.
        try:
            while not scaled_up.is_set():
                reply = client.completions.create(
                    model="beta",
                    prompt=PROMPT,
                    max_tokens=200,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                texts.append(reply.choices[0].text)
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=keep_asking) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        wait_for_replicas(deployment, 2)
    finally:
        scaled_up.set()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert texts and all(text.startswith(expected["beta"]) for text in texts)
    # Every replica answers alike while the load is gone, then the deployment shrinks back.
    assert greedy_text(client, "beta") == expected["beta"]
    wait_for_replicas(deployment, 1)
    assert greedy_text(client, "beta") == expected["beta"]
