"""LoRA adapters on the Ray Serve app, two LLMServer replicas behind the separate ingress on this
module's local Ray cluster: a static adapter and a dynamic loading folder (`<model>:<adapter>`), the
adapter's greedy text equal to transformers with it merged by hand, requests for an adapter landing on
the one replica that holds it (adapter affinity), at most max_num_adapters_per_replica adapters per
replica (the least recently used evicted, and reloaded when asked for again), runtime load and unload
through the ingress, and the ingress's count of requests per adapter; and the same adapters on one
replica serving the OpenAI app itself. Without a cluster: the router's adapter rule and keys, and the
Serve keys."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from cluster.serve.args import parse_app_args
from cluster.serve.routing import KVAwareRouter, affine_replicas, with_adapter_salt
from cluster.serve_app import build_app
from engine.frontend.tokenizer import load_tokenizer
from engine.models.model_files import ModelSource
from tests.cluster.local_ray_cluster import serve_url_fixture
from tests.model.hf_reference import hf_greedy
from tests.model.lora_adapters import merged_reference, write_peft_adapter

APP = "raypage-lora"
MODEL = "m"
MAX_TOKENS = 6
MAX_ADAPTERS = 2
DYNAMIC = ("fr", "de", "es", "it")
ENGINE = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64, "block_size": 16}
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}

# Two replicas of 1 CPU and the ingress's 0.5, and the one-replica app's replica.
base_url = serve_url_fixture(num_cpus=4)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path) -> dict[str, Path]:
    """The static adapter "sql", the dynamic folder's adapters, and "late" for a runtime load."""
    root = tiny_model.parent
    folders = {"sql": root / "sql", "late": root / "late"} | {
        name: root / "dynamic" / name for name in DYNAMIC
    }
    return {
        name: write_peft_adapter(folder, tiny_model, seed=seed)
        for seed, (name, folder) in enumerate(folders.items())
    }


def app_args(model: Path, adapters: dict[str, Path]) -> dict:
    return {
        "model": str(model),
        **ENGINE,
        **LORA,
        "served_model_name": MODEL,
        "num_replicas": 2,
        "ingress_cpus": 0.5,
        "log_stats_interval": 0,
        "lora_modules": [f"sql={adapters['sql']}"],
        "dynamic_lora_loading_path": str(adapters["fr"].parent),
        "max_num_adapters_per_replica": MAX_ADAPTERS,
        "allow_runtime_lora_updating": True,
    }


@pytest.fixture(scope="module")
def app(base_url: str, tiny_model: Path, adapters: dict[str, Path]) -> Iterator[str]:
    """The two-replica app at /, and beside it at /one a one-replica app serving the OpenAI app itself
    (ingress: engine), started together so that their start-ups overlap."""
    one_replica = {**app_args(tiny_model, adapters), "num_replicas": 1}
    serve.run_many(
        [
            serve.RunTarget(build_app(app_args(tiny_model, adapters)), name=APP, route_prefix="/"),
            serve.RunTarget(build_app(one_replica), name=f"{APP}-one", route_prefix="/one"),
        ]
    )
    yield base_url
    serve.delete(APP)
    serve.delete(f"{APP}-one")


@pytest.fixture(scope="module")
def client(app: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=app + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return reply.choices[0].text


def replica_adapters() -> list[list[str]]:
    """The adapters each LLMServer replica's engine holds, as its routing stats report them."""
    names = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer#")
    ]
    assert len(names) == 2, names
    actors = [ray.get_actor(name, namespace="serve") for name in names]
    return [stats["adapters"] for stats in ray.get([actor.record_routing_stats.remote() for actor in actors])]


def adapter_requests(url: str, adapter: str) -> float:
    """The requests /metrics counts for `adapter` (0 before the first)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "raypage:lora_adapter_requests_total" and sample.labels["lora_name"] == adapter:
                return sample.value
    return 0.0


def holders(adapter: str) -> int:
    return sum(adapter in held for held in replica_adapters())


def prompt(index: int) -> list[int]:
    """A prompt of more than one KV block, each index's its own: without adapter affinity the kv_aware
    router spreads such prompts over the replicas' caches."""
    # Word tokens (the low ids are special and byte tokens, whose text depends on their neighbours).
    return [2000 + index, *range(1000, 1000 + 2 * ENGINE["block_size"])]


@pytest.mark.slow
def test_models_lists_static_and_dynamic_adapters(client: openai.OpenAI, adapters: dict[str, Path]) -> None:
    cards = {card.id: card.model_extra for card in client.models.list().data}
    assert list(cards) == [MODEL, "sql", *(f"{MODEL}:{name}" for name in sorted(DYNAMIC))]
    assert cards["sql"]["parent"] == cards[f"{MODEL}:fr"]["parent"] == MODEL
    assert cards[f"{MODEL}:fr"]["root"] == str(adapters["fr"])
    with pytest.raises(openai.NotFoundError):
        complete(client, f"{MODEL}:nl", prompt(0))


@pytest.mark.slow
def test_an_adapter_matches_its_merged_reference(
    client: openai.OpenAI, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    tokenizer = load_tokenizer(ModelSource(tiny_model, "hf"))
    for name, served in ((None, MODEL), ("fr", f"{MODEL}:fr")):
        reference = hf_greedy(merged_reference(tiny_model, adapters.get(name)), prompt(0), MAX_TOKENS)
        assert complete(client, served, prompt(0)) == tokenizer.decode(reference, skip_special_tokens=True)


@pytest.mark.slow
def test_one_replica_serving_the_app_itself_runs_the_same_adapters(app: str, client: openai.OpenAI) -> None:
    one = openai.OpenAI(base_url=app + "/one/v1", api_key="unused", max_retries=0, timeout=120)
    assert {card.id for card in one.models.list().data} == {card.id for card in client.models.list().data}
    for model in ("sql", f"{MODEL}:es"):
        assert complete(one, model, prompt(3)) == complete(client, model, prompt(3))
    assert adapter_requests(app + "/one", "sql") == 1


@pytest.mark.slow
def test_requests_for_an_adapter_land_where_it_is_loaded(app: str, client: openai.OpenAI) -> None:
    """Sent one after the other, every request for an adapter goes to the one replica holding it (the
    other would load it too: with Serve's pow2 routing all six land on one replica 1 time in 32)."""
    before = adapter_requests(app, f"{MODEL}:de")
    for index in range(6):
        complete(client, f"{MODEL}:de", prompt(index))
    assert holders(f"{MODEL}:de") == 1, replica_adapters()
    # The ingress counts the requests of every replica.
    assert adapter_requests(app, f"{MODEL}:de") == before + 6


@pytest.mark.slow
def test_a_replica_holds_at_most_max_num_adapters(client: openai.OpenAI) -> None:
    texts = {name: complete(client, f"{MODEL}:{name}", prompt(1)) for name in DYNAMIC}
    texts["sql"] = complete(client, "sql", prompt(1))
    held = replica_adapters()
    assert all(len(names) <= MAX_ADAPTERS for names in held), held
    # Five adapters over two replicas of two: the evicted ones come back, with the same answers.
    again = {
        name: complete(client, name if name == "sql" else f"{MODEL}:{name}", prompt(1)) for name in texts
    }
    assert again == texts
    assert all(len(names) <= MAX_ADAPTERS for names in replica_adapters())


@pytest.mark.slow
def test_runtime_load_and_unload_through_the_ingress(
    app: str, client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(app + path, json=body, timeout=60)

    assert (
        post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])}).status_code
        == 200
    )
    first = complete(client, "late", prompt(2))
    assert complete(client, "late", prompt(2)) == first
    bad = post(
        "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(adapters["late"].parent / "none")}
    )
    assert bad.status_code == 400 and "bad" in bad.json()["error"]["message"], bad.text
    assert post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "late", prompt(2))
    assert post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404


# ---- without a cluster ----------------------------------------------------------------------------


def fake_replica(name: str, adapters: set[str] = frozenset(), waiting: int = 0) -> SimpleNamespace:
    """What the router reads of a RunningReplica."""
    return SimpleNamespace(
        replica_id=name, multiplexed_model_ids=adapters, routing_stats={"waiting": waiting, "adapters": []}
    )


def route(router: KVAwareRouter, replicas: list[SimpleNamespace], adapter: str) -> str:
    pending = SimpleNamespace(
        args=[{"prompt_token_ids": prompt(0)}], metadata=SimpleNamespace(multiplexed_model_id=adapter)
    )
    router._replicas = {
        replica.replica_id: replica for replica in replicas
    }  # as Serve's update_replicas sets it
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return ranks[0][0].replica_id


def test_the_router_prefers_the_replica_holding_the_adapter() -> None:
    router = KVAwareRouter(DeploymentID(name="LLMServer", app_name=APP), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(load_margin=2, block_size=4)
    assert route(router, [fake_replica("x"), fake_replica("y", {"fr"}, waiting=2)], "fr") == "y"
    # Too busy: the adapter is loaded on the idle replica instead, which then counts as holding it.
    assert route(router, [fake_replica("x"), fake_replica("y", {"fr"}, waiting=3)], "fr") == "x"
    assert route(router, [fake_replica("x"), fake_replica("y", {"fr"}, waiting=1)], "fr") == "x"
    # A new adapter: the replica holding fewest.
    assert route(router, [fake_replica("x", {"a", "b"}), fake_replica("y", {"c"})], "de") == "y"
    assert affine_replicas(["y"], {"x": 0.0, "y": 5.0}, margin=4) == []


def test_an_adapter_salts_the_routing_keys() -> None:
    router = KVAwareRouter(DeploymentID(name="LLMServer", app_name=APP), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=4)
    base = {"prompt_token_ids": list(range(8)), "cache_salt": "t"}
    keys = {adapter: router.prompt_keys(with_adapter_salt(base, adapter)) for adapter in (None, "a", "b")}
    assert len({key[0] for key in keys.values()}) == 3
    assert with_adapter_salt(base, None) is base


def test_serve_lora_keys(tiny_model: Path, adapters: dict[str, Path]) -> None:
    settings = parse_app_args(app_args(tiny_model, adapters))
    assert settings.max_adapters_per_replica == MAX_ADAPTERS
    assert settings.engine_settings["max_cpu_loras"] == MAX_ADAPTERS  # room for every adapter a replica keeps
    assert [module.name for module in settings.server.lora.modules] == ["sql"]
    with pytest.raises(ValueError, match="enable_lora"):
        parse_app_args({**app_args(tiny_model, adapters), "enable_lora": False})
    with pytest.raises(ValueError, match="max_cpu_loras"):
        parse_app_args({**app_args(tiny_model, adapters), "max_cpu_loras": 1, "max_loras": 1})
    with pytest.raises(ValueError, match="lora_modules"):
        parse_app_args({**app_args(tiny_model, adapters), "lora_modules": ["no-path"]})
