"""How long `raypage serve` and `raypage api-server` take from spawn to their first answer.

python -m benchmarks.start_time [--rounds N] [--which serve|api-server|both] [--config FILE]
                                [--log-dir DIR] [--repo DIR] [--] [extra flags for the command]

Each round starts the command as a fresh subprocess in a process group of its own, polls
GET /v1/models until it answers 200 (the seconds from spawn to then are the start time), sends one
one-token completion (its latency shows whether work was only deferred into the first request),
then stops the server with SIGTERM and waits until no process of its group is left. With --log-dir
each round's output is kept, every line prefixed with the seconds since spawn: a breakdown of where
the start-up goes. With --repo the commands run from another checkout (e.g. `git archive` of an
older commit unpacked somewhere), for before/after comparisons run back to back.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("serve", "api-server")
DEFAULT_CONFIG = "configs/engine/smollm2.yaml"
# Caps that only keep a broken server from hanging the benchmark.
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0
POLL_INTERVAL_S = 0.05


@dataclass
class Round:
    """One start of a command: seconds from spawn to the first 200, to the first completion, and
    from SIGTERM to the last process of its group gone; and the CPU seconds (user + system) of the
    processes it started that were reaped, over the whole round: the work done, which unlike the
    wall-clock figures barely depends on what else runs on the machine (Ray's processes, reaped by
    their own parents outside the tree, are not counted)."""

    ready_s: float
    first_completion_s: float
    stop_s: float
    cpu_s: float


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is left (zombies of already reaped parents excepted)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def copy_timestamped(source: IO[bytes], sink: IO[str] | None, spawned_at: float) -> None:
    """Read the child's output to its end (so that a full pipe never blocks it), prefixing each line
    with the seconds since spawn."""
    for line in source:
        if sink is not None:
            sink.write(f"[{time.monotonic() - spawned_at:7.2f}] {line.decode(errors='replace')}")
            sink.flush()


def wait_ready(process: subprocess.Popen, base_url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before it was ready")
        try:
            if httpx.get(base_url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(POLL_INTERVAL_S)
    raise TimeoutError(f"no 200 from {base_url}/v1/models within {READY_TIMEOUT_S:.0f} s")


def first_completion(base_url: str) -> None:
    model = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=READY_TIMEOUT_S)
    response.raise_for_status()


def stop(process: subprocess.Popen) -> float:
    """SIGTERM, then wait for the whole group; SIGKILL to the group if it lingers. Seconds it took."""
    pgid = process.pid  # start_new_session: the leader's pid is the group's id
    began = time.monotonic()
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
        while group_alive(pgid) and time.monotonic() - began < STOP_TIMEOUT_S:
            time.sleep(POLL_INTERVAL_S)
    except subprocess.TimeoutExpired:
        pass
    took = time.monotonic() - began
    if group_alive(pgid):
        print(f"  process group {pgid} still alive after {took:.1f} s; killing it", file=sys.stderr)
        os.killpg(pgid, signal.SIGKILL)
        process.wait()
    return took


def run_round(command: str, config: str, extra: list[str], log_path: Path | None, repo: Path) -> Round:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "cluster.cli", command, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--config", config, *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115 (closed below)
    cpu_before = children_cpu_s()
    spawned_at = time.monotonic()
    process = subprocess.Popen(
        argv, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    reader = threading.Thread(target=copy_timestamped, args=(process.stdout, log, spawned_at), daemon=True)
    reader.start()
    try:
        wait_ready(process, base_url, spawned_at + READY_TIMEOUT_S)
        ready_s = time.monotonic() - spawned_at
        began = time.monotonic()
        first_completion(base_url)
        first_completion_s = time.monotonic() - began
    finally:
        stop_s = stop(process)
        reader.join(timeout=10)
        if log is not None:
            log.close()
    return Round(ready_s, first_completion_s, stop_s, children_cpu_s() - cpu_before)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):6.2f}  min {min(values):6.2f}  max {max(values):6.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="starts of each command (default: 3)")
    parser.add_argument("--which", choices=(*COMMANDS, "both"), default="both", help="default: both")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"engine config (default: {DEFAULT_CONFIG})")
    parser.add_argument("--log-dir", type=Path, help="keep each round's timestamped output here")
    parser.add_argument(
        "--repo", type=Path, default=REPO_ROOT, help="checkout to run the commands from (default: this one)"
    )
    parser.add_argument("extra", nargs="*", help="more flags for the command (after --)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    commands = COMMANDS if args.which == "both" else (args.which,)
    for command in commands:
        print(f"raypage {command} --config {args.config} {' '.join(args.extra)}  (in {args.repo})")
        rounds = []
        for index in range(args.rounds):
            log_path = args.log_dir / f"{command}-{index}.log" if args.log_dir is not None else None
            result = run_round(command, args.config, args.extra, log_path, args.repo)
            rounds.append(result)
            print(
                f"  round {index + 1}: first 200 after {result.ready_s:6.2f} s, first completion "
                f"{result.first_completion_s:5.2f} s, stopped in {result.stop_s:5.2f} s, CPU {result.cpu_s:6.2f} s",
                flush=True,
            )
        print(f"  start time (s):       {summary([r.ready_s for r in rounds])}")
        print(f"  first completion (s): {summary([r.first_completion_s for r in rounds])}")
        print(f"  stop (s):             {summary([r.stop_s for r in rounds])}")
        print(f"  CPU (s):              {summary([r.cpu_s for r in rounds])}")


if __name__ == "__main__":
    main()
