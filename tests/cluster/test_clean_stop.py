"""Stopping `raypage api-server` and `raypage serve` leaves nothing of their process group behind.

Each server runs in a process group of its own, as a shell job does, with streams in flight. SIGTERM
(a supervisor's stop) drains them to their ends, each with the text it has alone; Ctrl-C twice
(SIGINT to the whole group, as a terminal sends it) stops the server within FORCED_STOP_S of the
second. Either way, by the time the
server process has exited every other process of its group (engine core, workers, Ray's processes,
HAProxy) has too, or does within GROUP_GONE_S: none is left as an orphan.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from openai.types import Completion

from tests.cluster.remote_server import REPO_ROOT, RemoteServer, free_port
from tests.model.tiny_models import write_tiny_model

MODEL = "tiny"
ENGINE_FLAGS = [
    *("--served-model-name", MODEL, "--dtype", "float32", "--num-kv-blocks", "64"),
    *("--log-stats-interval", "0", "--disable-access-log"),
]
# The smallest local cluster that holds one replica.
SERVE_FLAGS = [*("--num-cpus", "2", "--llm-server-cpus", "1", "--object-store-memory", str(100 << 20))]
# The tiny model has no end-of-sequence token: a stream runs exactly this many steps, enough that
# the streams are still running when the signal comes, few enough to drain in well under the drain
# timeout.
STREAM_MAX_TOKENS = 200
PROMPTS = [f"Once upon a time {index}" for index in range(4)]
# What the issue asks: the second Ctrl-C stops the server within 5 s, and the group is empty 1 s
# after the server exited.
FORCED_STOP_S = 5.0
GROUP_GONE_S = 1.0
# Caps that only keep a broken server from hanging the test; nothing here is timed by them.
EXIT_TIMEOUT_S = 120.0
LOG_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("clean-stop") / "model")


def group_members(pgid: int) -> list[str]:
    """`pid command` of every process left in group `pgid`."""
    found = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(pgid)], capture_output=True, text=True)
    return [line.strip() for line in found.stdout.splitlines() if line.strip()]


def command_line(process: psutil.Process) -> str:
    """Its command line; empty for a process gone or exited (a zombie has none)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def assert_group_gone(pgid: int) -> None:
    deadline = time.monotonic() + GROUP_GONE_S
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"left behind in process group {pgid}: {left}"


def wait_for_log(server: RemoteServer, text: str) -> None:
    deadline = time.monotonic() + LOG_TIMEOUT_S
    while text not in server.log_path.read_text(errors="replace"):
        assert server.process.poll() is None, (
            f"the server exited before logging {text!r}:\n{server.log_tail()}"
        )
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.log_tail()}"
        time.sleep(0.05)


def start_stream(server: RemoteServer, prompt: str = PROMPTS[0]) -> tuple[str, Iterator[Completion]]:
    """A stream in flight: its first chunk has arrived. That chunk's text, and the rest to come."""
    stream = iter(
        server.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=STREAM_MAX_TOKENS, temperature=0, stream=True
        )
    )
    return next(stream).choices[0].text, stream


def stop_with_sigterm(server: RemoteServer) -> None:
    """SIGTERM to the server alone, with streams in flight: each runs to its end with the text it has
    alone, then the server exits 0."""
    pgid = os.getpgid(server.process.pid)
    alone = server.greedy_texts(MODEL, PROMPTS, STREAM_MAX_TOKENS)
    streams = [start_stream(server, prompt) for prompt in PROMPTS]
    server.process.send_signal(signal.SIGTERM)
    drained = []
    for first_text, stream in streams:
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
        drained.append((first_text + "".join(chunk.text for chunk in chunks), chunks[-1].finish_reason))
    assert drained == [(text, "length") for text in alone]
    assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 0, server.log_tail()
    assert_group_gone(pgid)


def stop_with_two_ctrl_c(server: RemoteServer, draining_marker: str) -> None:
    """SIGINT to the whole group once, and again once the server drains (it logs `draining_marker`):
    the server stops within FORCED_STOP_S of the second, though its stream is still in flight."""
    pgid = os.getpgid(server.process.pid)
    _, stream = start_stream(server)
    os.killpg(pgid, signal.SIGINT)
    wait_for_log(server, draining_marker)
    os.killpg(pgid, signal.SIGINT)
    second_at = time.monotonic()
    try:
        server.process.wait(timeout=EXIT_TIMEOUT_S)
        assert time.monotonic() - second_at < FORCED_STOP_S, server.log_tail()
        assert_group_gone(pgid)
    finally:
        with contextlib.suppress(openai.APIError, httpx.HTTPError):
            stream.close()  # type: ignore[attr-defined]


# ---- raypage api-server ------------------------------------------------------------------------


@pytest.fixture
def api_server(tiny_model: Path, tmp_path: Path) -> Iterator[RemoteServer]:
    server = RemoteServer(
        ["--model", str(tiny_model), *ENGINE_FLAGS], tmp_path / "server.log", new_session=True
    )
    yield server
    server.stop()


def test_sigterm_to_api_server_drains_and_leaves_no_process(api_server: RemoteServer) -> None:
    stop_with_sigterm(api_server)


def test_two_ctrl_c_stop_the_api_server_at_once_leaving_no_process(api_server: RemoteServer) -> None:
    stop_with_two_ctrl_c(api_server, "draining: ")


def test_sigterm_while_the_api_server_starts_stops_its_engine_core_too(
    tiny_model: Path, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "cluster.cli", "api-server", "--port", str(free_port())]
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen(
            [*command, "--model", str(tiny_model), *ENGINE_FLAGS],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + LOG_TIMEOUT_S
        # The engine core is there (it loads the model): the server has not served yet.
        while not [c for c in psutil.Process(server.pid).children() if "spawn_main" in command_line(c)]:
            assert server.poll() is None and time.monotonic() < deadline, (
                tmp_path / "server.log"
            ).read_text()
            time.sleep(0.01)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=EXIT_TIMEOUT_S) == 0, (tmp_path / "server.log").read_text()
        assert_group_gone(server.pid)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


# ---- raypage serve -----------------------------------------------------------------------------


@pytest.fixture
def serve(tiny_model: Path, tmp_path: Path) -> Iterator[RemoteServer]:
    server = RemoteServer(
        ["--model", str(tiny_model), *ENGINE_FLAGS, *SERVE_FLAGS],
        tmp_path / "serve.log",
        command="serve",
        stop_timeout_s=EXIT_TIMEOUT_S,
        new_session=True,
    )
    yield server
    server.stop()


@pytest.mark.slow
def test_sigterm_to_serve_drains_and_leaves_no_process(serve: RemoteServer) -> None:
    stop_with_sigterm(serve)


@pytest.mark.slow
def test_two_ctrl_c_stop_serve_at_once_leaving_no_process(serve: RemoteServer) -> None:
    stop_with_two_ctrl_c(serve, "draining the app's requests in flight")


@pytest.mark.slow
def test_sigterm_to_serve_with_an_unhealthy_replica_leaves_no_process(serve: RemoteServer) -> None:
    pgid = os.getpgid(serve.process.pid)
    (replica,) = [
        process
        for process in psutil.Process(serve.process.pid).children(recursive=True)
        if command_line(process).startswith("ray::ServeReplica:")
    ]
    (core,) = [child for child in replica.children() if "spawn_main" in command_line(child)]
    core.kill()  # the replica's engine is dead: /health answers 503
    deadline = time.monotonic() + LOG_TIMEOUT_S
    while httpx.get(serve.base_url + "/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "the replica never reported its dead engine"
        time.sleep(0.1)
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(timeout=EXIT_TIMEOUT_S) == 0, serve.log_tail()
    assert_group_gone(pgid)
