"""Processes killed under a real `raypage api-server`, each while a streaming client is mid-stream: the
engine core, or one worker of the multiprocess executor at TP=2. The stream fails at once with a 503
error naming the cause, /health answers 503, and the server then exits with status 1 on its own,
leaving none of its processes behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.cluster.remote_server import RemoteServer
from tests.model.tiny_models import write_tiny_model

MODEL = "tiny"
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--disable-access-log"]
# A 4-head tiny Llama splits over two TP ranks.
TP2_FLAGS = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
# Caps that only keep a broken server from hanging the test; nothing here is timed.
DEATH_NOTICE_S = 10.0
EXIT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-faults") / "model")


def spawned_children(process: psutil.Process) -> list[psutil.Process]:
    """The children multiprocessing's spawn started (the engine core, or its workers)."""
    return [child for child in process.children() if "spawn_main" in " ".join(child.cmdline())]


@pytest.fixture(params=["engine-core", "worker"])
def fault(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def server(fault: str, tiny_model: Path, tmp_path: Path) -> Iterator[RemoteServer]:
    flags = ["--model", str(tiny_model), "--served-model-name", MODEL, *ENGINE_FLAGS]
    server = RemoteServer(flags + (TP2_FLAGS if fault == "worker" else []), tmp_path / "server.log")
    yield server
    server.stop()


@pytest.mark.slow
def test_killed_process_fails_the_stream_and_the_server_exits(fault: str, server: RemoteServer) -> None:
    (core,) = spawned_children(psutil.Process(server.process.pid))
    workers = spawned_children(core)
    assert len(workers) == (2 if fault == "worker" else 0)
    processes = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(True)]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = iter(
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400, stream=True)
    )
    next(stream)  # generating now

    killed_at = time.monotonic()
    os.kill((workers[1] if fault == "worker" else core).pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="The engine is not running: ") as error:
        for _ in stream:
            pass
    assert time.monotonic() - killed_at < DEATH_NOTICE_S
    print(f"\n{fault} killed: {error.value.message}")
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 503

    assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 1, server.log_tail()
    _, alive = psutil.wait_procs(processes, timeout=EXIT_TIMEOUT_S)
    assert not [process for process in alive if process.is_running()], "processes left behind"
    assert "the server exits in" in server.log_tail()
