"""`raypage serve` on a local cluster of its own, the separate-ingress shape behind HAProxy where
Serve finds it (the python proxy is test_serve_app.py's joined cluster's): the offline engine's
greedy texts, a cache_salt through the ingress, a closed stream aborting, and each process's
niceness. A module of its own, so that no other module's cluster runs beside this one's."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import openai
import psutil
import pytest

from cluster.serve import proxy_mode
from tests.cluster.remote_server import RemoteServer
from tests.cluster.serve_checks import (
    API_KEY,
    MODEL,
    assert_a_closed_stream_aborts,
    assert_serves_greedy_texts,
    engine_flags,
    processes_titled,
)
from tests.structured.checks import assert_json_schema_reply
from tests.structured.schemas import SCHEMAS


def assert_salts_isolate_the_cache(client: openai.OpenAI) -> None:
    """A request's cache_salt crosses the ingress, its router and the replica's handle: only
    requests with the same salt share cached blocks (usage.prompt_tokens_details shows it)."""
    prompt = "Tenant isolation behind Serve: a prompt of two KV blocks or more, from this check alone. " * 2

    def cached_tokens(salt: str) -> int:
        usage = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0, extra_body={"cache_salt": salt}
        ).usage
        return usage.prompt_tokens_details.cached_tokens

    first, other, again = cached_tokens("tenant-a"), cached_tokens("tenant-b"), cached_tokens("tenant-a")
    assert (first, other) == (0, 0) and again >= 32 and again % 16 == 0


def serve_on_its_own_cluster(flags: list[str], tiny_model: Path, log_path: Path) -> RemoteServer:
    return RemoteServer(
        [
            *flags,
            "--served-model-name",
            MODEL,
            "--api-key",
            API_KEY,
            "--llm-server-cpus",
            "1",
            *engine_flags(tiny_model),
        ],
        log_path,
        command="serve",
        stop_timeout_s=60,
    )


def one_haproxy(server: RemoteServer, timeout_s: float = 10.0) -> psutil.Process:
    """The server's one HAProxy process; a reload may leave the previous one a moment longer."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for process in psutil.Process(server.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.name() == "haproxy" and process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process)
        if len(running) == 1 or time.monotonic() > deadline:
            assert len(running) == 1, running
            return running[0]
        time.sleep(0.5)


def wait_for_log(server: RemoteServer, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, (
            f"{text!r} not in the log after {timeout_s} s:\n{server.log_tail()}"
        )
        time.sleep(0.5)


def thread_niceness(process: psutil.Process) -> set[int]:
    """The niceness of each thread of `process` (niceness is per thread on Linux)."""
    found = set()
    for thread in process.threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            found.add(os.getpriority(os.PRIO_PROCESS, thread.id))
    return found


def serve_processes(server: RemoteServer, title: str) -> list[psutil.Process]:
    """The processes of the server's own cluster whose title starts with `title`."""
    return processes_titled(title, psutil.Process(server.process.pid))


def assert_the_niceness_asked_for(server: RemoteServer) -> None:
    """The replica, its engine core and HAProxy run at the niceness asked for (0, the default), not
    Ray's 15; the cluster's own processes, every thread of them, at --cluster-niceness's 19: set once
    the app is up, which /health can show before `raypage serve` logs that it serves."""
    wait_for_log(server, "serving on http://", timeout_s=30)
    haproxy = one_haproxy(server)
    (replica,) = serve_processes(server, "ray::ServeReplica:raypage:LLMServer")
    (core,) = [p for p in replica.children() if "spawn_main" in " ".join(p.cmdline())]
    found = {"replica": replica, "engine core": core, "haproxy": haproxy}
    assert {name: thread_niceness(process) for name, process in found.items()} == {
        name: {0} for name in found
    }
    own = [psutil.Process(server.process.pid)] + [
        p
        for p in psutil.Process(server.process.pid).children(recursive=True)
        if p.name() in ("gcs_server", "raylet") or " ".join(p.cmdline()).startswith("ray::ServeController")
    ]
    assert len(own) == 4
    assert all(thread_niceness(p) == {19} for p in own)


# One cluster of its own for both shapes that need one (each start costs about 25 s on two cores): the
# separate ingress, behind HAProxy where Serve finds it; the python proxy is the joined cluster's above.
OWN_CLUSTER_PROXY = "haproxy" if proxy_mode.haproxy_available() else "python"


@pytest.mark.slow
def test_a_separate_ingress_on_its_own_cluster_serves_the_same_texts(
    tiny_model: Path, expected: dict[str, str], tmp_path: Path
) -> None:
    server = serve_on_its_own_cluster(
        ["--proxy-mode", OWN_CLUSTER_PROXY, "--ingress", "separate", "--enable-prompt-tokens-details"],
        tiny_model,
        tmp_path / "serve.log",
    )
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        assert_serves_greedy_texts(client, expected)
        assert_json_schema_reply(
            client, MODEL, SCHEMAS[0].schema, stream=True
        )  # through the ingress's handle
        assert_salts_isolate_the_cache(client)
        assert len(serve_processes(server, "ray::ServeReplica:raypage:OpenAIIngress")) == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert_a_closed_stream_aborts(server.base_url, client)
        if OWN_CLUSTER_PROXY == "haproxy":
            assert_the_niceness_asked_for(server)
    finally:
        assert server.stop() == 0, server.log_tail()
