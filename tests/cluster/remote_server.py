"""A real `raypage api-server` (or `raypage serve`) subprocess for tests: a free port, its log in a
file, stopped by pid."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil

REPO_ROOT = Path(__file__).parents[2]
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """`raypage COMMAND ARGS` (api-server or serve) on 127.0.0.1, ready (GET /health is 200) once
    constructed. With `new_session` it leads a session and process group of its own.

    Its output goes to `log_path`, not a pipe, which a chatty server would fill and block on.
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        command: str = "api-server",
        stop_timeout_s: float = 30.0,
        new_session: bool = False,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s
        command_line = [sys.executable, "-m", "cluster.cli", command, "--port", str(self.port), *args]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                command_line,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
                # A process group of its own (as a shell job), whose members a test can list and signal.
                start_new_session=new_session,
            )
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            # A refused connection costs next to nothing; polling every 0.5 s added a quarter of a
            # second on average to each of the suite's server start-ups.
            time.sleep(0.1)
        raise TimeoutError(f"the server was not ready in {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def client(self) -> openai.OpenAI:
        """The official client on this server, without retries: a test sees every failure."""
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def greedy_texts(self, model: str, prompts: list[str], max_tokens: int) -> list[str]:
        """Each prompt's greedy completion, one request at a time: what it gets on an idle server."""
        client = self.client()
        return [
            client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
            .choices[0]
            .text
            for prompt in prompts
        ]

    def core_pid(self) -> int:
        """The engine core process: the server's child started by multiprocessing's spawn."""
        cores = [
            child.pid
            for child in psutil.Process(self.process.pid).children()
            if "spawn_main" in " ".join(child.cmdline())
        ]
        assert len(cores) == 1, f"expected one engine core child, found {cores}"
        return cores[0]

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("raypage:request_success_total", 'finished_reason="stop"');
        0 when the labeled series does not exist yet."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        pattern = rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$"
        for found_labels, value in re.findall(pattern, text, re.MULTILINE):
            if labels in found_labels:
                return float(value)
        return 0.0

    def wait_until_idle(self, timeout_s: float = 10.0) -> None:
        """Until nothing runs or waits and no KV block is in use; fails after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        names = (
            "raypage:num_requests_running",
            "raypage:num_requests_waiting",
            "raypage:kv_cache_usage_perc",
        )
        while True:
            values = {name: self.metric(name) for name in names}
            if not any(values.values()):
                return
            assert time.monotonic() < deadline, f"still busy after {timeout_s} s: {values}"
            time.sleep(0.2)

    def stop(self) -> int:
        """SIGTERM (the server shuts its engine down), SIGKILL if it lingers; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
