"""Multi-LoRA serving on a real `raypage api-server` over a tiny random Llama, with the official openai
client: static adapters (`--lora-modules`, both forms) whose greedy completions equal transformers
with the adapter merged by hand, /v1/models listing them under their base model, a request's `model`
picking the adapter, 404 for an unknown model, runtime load and unload (400 for a bad or taken adapter
while the server serves on, 404 for an unknown one), the LoRA metrics, and a bad static adapter
stopping the server as it starts. Without a server: the
flag forms, the adapter registry (ids, the dynamic folder) and the runtime routes being off by default."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli import build_parser
from cluster.metrics import PrometheusStatLogger
from cluster.openai.api_server import check_args, server_settings
from cluster.openai.app import ServerSettings, build_app
from cluster.openai.errors import OpenAIError
from cluster.openai.serving_models import (
    LoRAModulePath,
    LoRASources,
    OpenAIServingModels,
    parse_lora_module,
    runtime_lora_updating_allowed,
)
from engine.frontend.tokenizer import load_tokenizer
from engine.models.model_files import ModelSource
from engine.outputs import LoRAStats, SchedulerStats
from tests.cluster.remote_server import RemoteServer
from tests.model.hf_reference import hf_greedy
from tests.model.lora_adapters import merged_reference, write_peft_adapter
from tests.model.tiny_models import write_tiny_model

MODEL = "base"
MAX_TOKENS = 8
# Word tokens (the low ids are special and byte tokens, whose text depends on their neighbours).
PROMPT_IDS = [2000, 1005, 1009, 1200, 1031, 1007, 1042, 1011]
MAX_LORA_RANK = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-server")


@pytest.fixture(scope="module")
def base(folder: Path) -> Path:
    return write_tiny_model(folder / "base")


@pytest.fixture(scope="module")
def adapters(folder: Path, base: Path) -> dict[str, Path]:
    """Two static adapters, one loaded at run time, and one whose rank the server refuses."""
    return {
        "sql": write_peft_adapter(folder / "sql", base, rank=8, seed=1),
        "chat": write_peft_adapter(folder / "chat", base, rank=4, seed=2, targets=("q_proj", "v_proj")),
        "late": write_peft_adapter(folder / "late", base, rank=8, seed=3),
        "too-big": write_peft_adapter(folder / "too-big", base, rank=2 * MAX_LORA_RANK, seed=4),
    }


@pytest.fixture(scope="module")
def server(folder: Path, base: Path, adapters: dict[str, Path]) -> Iterator[RemoteServer]:
    chat = json.dumps({"name": "chat", "path": str(adapters["chat"]), "base_model_name": MODEL})
    server = RemoteServer(
        [
            *("--model", str(base), "--served-model-name", MODEL, "--dtype", "float32"),
            *("--max-model-len", "256", "--num-kv-blocks", "64", "--log-stats-interval", "0"),
            *("--enable-lora", "--max-loras", "2", "--max-lora-rank", str(MAX_LORA_RANK)),
            *("--lora-modules", f"sql={adapters['sql']}", chat),
            "--allow-runtime-lora-updating",
            "--disable-access-log",
        ],
        folder / "server.log",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(base: Path, adapters: dict[str, Path]) -> dict[str | None, str]:
    """transformers' greedy text for PROMPT_IDS: the base model's, and each adapter's merged in."""
    tokenizer = load_tokenizer(ModelSource(base, "hf"))
    return {
        name: tokenizer.decode(
            hf_greedy(merged_reference(base, adapters.get(name)), PROMPT_IDS, MAX_TOKENS),
            skip_special_tokens=True,
        )
        for name in (None, "sql", "chat", "late")
    }


def complete(client: openai.OpenAI, model: str) -> str:
    reply = client.completions.create(
        model=model,
        prompt=PROMPT_IDS,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert reply.model == model
    return reply.choices[0].text


def post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_models_lists_each_adapter_under_its_base(client: openai.OpenAI, adapters: dict[str, Path]) -> None:
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [MODEL, "sql", "chat"]
    assert cards[MODEL].model_extra["parent"] is None
    for name in ("sql", "chat"):
        assert cards[name].model_extra["parent"] == MODEL
        assert cards[name].model_extra["root"] == str(adapters[name])


def test_the_model_picks_the_adapter(client: openai.OpenAI, expected: dict[str | None, str]) -> None:
    texts = {name: complete(client, name or MODEL) for name in (None, "sql", "chat")}
    assert texts == {name: expected[name] for name in texts}
    assert len(set(texts.values())) == 3, texts  # the adapters change the model
    reply = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0
    )
    assert reply.model == "sql" and reply.usage.completion_tokens > 0


def test_an_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        complete(client, "nope")
    assert error.value.body == {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_runtime_load_and_unload(
    server: RemoteServer, client: openai.OpenAI, adapters: dict[str, Path], expected: dict[str | None, str]
) -> None:
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert loaded.status_code == 200, loaded.text
    assert "late" in {card.id for card in client.models.list().data}
    assert complete(client, "late") == expected["late"]

    again = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["sql"])})
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'late' has already been loaded."

    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "late")
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert (gone.status_code, gone.json()["error"]["type"]) == (404, "NotFoundError")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "late"}).status_code == 400  # no lora_path


def test_a_bad_adapter_is_400_and_the_server_serves_on(
    server: RemoteServer, client: openai.OpenAI, adapters: dict[str, Path], expected: dict[str | None, str]
) -> None:
    for name, path in [("too-big", adapters["too-big"]), ("missing", adapters["sql"].parent / "missing")]:
        response = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert name in error["message"] and error["param"] == "lora_path", error
    too_big = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["too-big"])})
    assert "max_lora_rank" in too_big.json()["error"]["message"]
    assert name not in {card.id for card in client.models.list().data}
    assert complete(client, "sql") == expected["sql"]


def test_lora_metrics(server: RemoteServer, client: openai.OpenAI) -> None:
    before = server.metric("raypage:lora_adapter_requests_total", 'lora_name="chat"')
    complete(client, "chat")
    assert server.metric("raypage:lora_adapter_requests_total", 'lora_name="chat"') == before + 1
    assert server.metric("raypage:lora_loads_total") >= 2
    assert server.metric("raypage:lora_loaded_adapters") >= 1
    # vLLM's info gauge: the adapters in its labels (none running now), its value the time seen.
    assert server.metric("raypage:lora_requests_info", 'max_lora="2"') > 0


def test_a_bad_static_adapter_stops_the_server_at_start(
    folder: Path, base: Path, adapters: dict[str, Path]
) -> None:
    log = folder / "bad-server.log"
    flags = ["--model", str(base), "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK)]
    with pytest.raises(RuntimeError, match="exited with 3"):
        RemoteServer([*flags, "--lora-modules", f"too-big={adapters['too-big']}"], log)
    assert "LoRA adapter 'too-big'" in log.read_text() and "max_lora_rank" in log.read_text()


# ---- without a server ---------------------------------------------------------------------------


def test_lora_module_forms() -> None:
    assert parse_lora_module("sql=/a/sql") == LoRAModulePath("sql", "/a/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a/sql", "base_model_name": "b"}') == LoRAModulePath(
        "sql", "/a/sql", "b"
    )
    assert parse_lora_module({"name": "sql", "path": "/a/sql"}) == LoRAModulePath("sql", "/a/sql")
    for bad in ("sql", "=/a", '{"name": "sql"}', '{"name": "s", "path": "/p", "rank": 8}', "{oops"):
        with pytest.raises(ValueError, match="LoRA module"):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="more than once"):
        LoRASources((LoRAModulePath("a", "/1"), LoRAModulePath("a", "/2")))


def test_lora_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    def args(*flags: str):
        return build_parser().parse_args(["api-server", *flags])

    settings = server_settings(
        args("--enable-lora", "--lora-modules", "a=/p/a", '{"name": "b", "path": "/p/b"}')
    )
    assert settings.lora.modules == (LoRAModulePath("a", "/p/a"), LoRAModulePath("b", "/p/b"))
    assert not settings.allow_runtime_lora_updating
    with pytest.raises(ValueError, match="--enable-lora"):
        check_args(args("--lora-modules", "a=/p/a"))
    with pytest.raises(ValueError, match="served model names"):
        server_settings(args("--served-model-name", "a", "--lora-modules", "a=/p/a"))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert runtime_lora_updating_allowed() and server_settings(args()).allow_runtime_lora_updating


def test_the_runtime_routes_are_off_by_default() -> None:
    engine = mock.MagicMock()
    engine.config.model.max_model_len = 256

    def routes(**settings) -> set[str]:
        return {route.path for route in build_app(engine, ServerSettings(["m"], **settings)).routes}

    assert "/v1/load_lora_adapter" not in routes()
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= routes(allow_runtime_lora_updating=True)


def test_the_registry_numbers_adapters_and_takes_dynamic_ones(tmp_path: Path) -> None:
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "adapter_config.json").write_text("{}")
    engine = mock.AsyncMock()
    engine.config.model.max_model_len, engine.config.model.model = 256, "/models/base"
    counted = []
    models = OpenAIServingModels(
        engine,
        ["base", "alias"],
        LoRASources((LoRAModulePath("sql", "/a/sql"),), str(tmp_path)),
        lambda *args: counted.append(args),
    )
    asyncio.run(models.init_static_loras())
    asyncio.run(models.load_lora_adapter("late", "/a/late"))
    assert [call.args[0].lora_int_id for call in engine.add_lora.await_args_list] == [1, 2]
    assert models.resolve(None) == ("base", None) and models.resolve("alias") == ("alias", None)
    name, lora = models.resolve("sql")
    assert (name, lora.lora_path, lora.base_model_name) == ("sql", "/a/sql", "base")
    # The dynamic folder's adapter, listed before use, under either base name.
    assert [card.id for card in models.model_cards()] == ["base", "alias", "sql", "late", "base:fr"]
    assert models.serves("alias:fr") and not models.serves("base:../fr") and not models.serves("base:es")
    name, lora = models.resolve("alias:fr")
    assert (lora.lora_int_id, lora.lora_path, lora.base_model_name) == (3, str(tmp_path / "fr"), "alias")
    for unknown in ("base:es", "base:../fr", "fr"):
        with pytest.raises(OpenAIError, match="does not exist"):
            models.resolve(unknown)
    asyncio.run(models.unload_lora_adapter("late"))
    engine.remove_lora.assert_awaited_once_with(2)
    models.count_requests(lora, 2)
    assert counted == [("base", "alias:fr", 2)]


def test_the_lora_metrics_follow_the_engine_stats() -> None:
    logger = PrometheusStatLogger(MODEL, max_model_len=256)
    logger.update_scheduler_stats(SchedulerStats(lora=LoRAStats({"sql": 2}, {"chat": 1}, 2, 3, 1)))
    logger.update_scheduler_stats(SchedulerStats(lora=LoRAStats({"chat": 1}, {}, 2, 4, 1)))
    logger.count_lora_requests(MODEL, "sql", 3)
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(logger.render().decode())
        for sample in family.samples
    }
    info = [labels for name, labels in samples if name == "raypage:lora_requests_info"]
    # One series: the current adapters (the earlier label set is gone).
    assert info == [
        (
            ("max_lora", "2"),
            ("model_name", MODEL),
            ("running_lora_adapters", "chat"),
            ("waiting_lora_adapters", ""),
        )
    ]
    assert samples[("raypage:lora_loads_total", (("model_name", MODEL),))] == 4
    assert samples[("raypage:lora_evictions_total", (("model_name", MODEL),))] == 1
    assert (
        samples[("raypage:lora_adapter_requests_total", (("lora_name", "sql"), ("model_name", MODEL)))] == 3
    )
