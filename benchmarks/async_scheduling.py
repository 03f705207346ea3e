"""Async against sync scheduling, side by side: offline throughput and serving latency.

    python -m benchmarks.async_scheduling --rounds 3                 # offline, the three workloads
    python -m benchmarks.async_scheduling --rounds 3 --serve 2       # + `raypage api-server` at 2 req/s
    git worktree add /tmp/before REV
    python -m benchmarks.async_scheduling --rounds 3 --baseline /tmp/before   # + REV's code, sync

Offline: `../shared/bench/offline_throughput.py` (the side-by-side workloads: uniform, mixed,
prefix) in a fresh process per run, sync and async interleaved in every round; each run also
reports the share of its wall time its forward passes took (the rest is input preparation,
sampling, scheduling and output handling). Serving: a fresh `raypage api-server` per run, sync and
async interleaved, driven by vLLM's own load generator (`vllm bench serve`, 100 random prompts of
128 in / 128 out) from the venv that `../shared/bench/compare.sh` installs. Prints each run, then
the median and range of every figure and the async / sync ratio of the medians. `--baseline DIR`
adds a third mode, the code of another checkout (its folder first on PYTHONPATH) with sync
scheduling, interleaved with the other two, and the ratios of both to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench"
MODES = {"sync": {"async_scheduling": False}, "async": {"async_scheduling": True}}
SERVE_FIGURES = {
    "median_ttft_ms": r"Median TTFT \(ms\):\s+([\d.]+)",
    "median_tpot_ms": r"Median TPOT \(ms\):\s+([\d.]+)",
    "output_tok_s": r"Output token throughput \(tok/s\):\s+([\d.]+)",
}


def offline_run(model: str, workload: str, settings: dict, code_dir: str | None = None) -> dict:
    """One offline_throughput.py run in a fresh process, with its forward passes' share of wall time
    (the code of `code_dir`, another checkout, when given)."""
    # The shared script's own LLM is wrapped so that its forward timings come back with the result.
    code = (
        "import json, runpy, sys, time\n"
        "import engine.frontend.llm as llm_module\n"
        "made = []\n"
        "class Timed(llm_module.LLM):\n"
        "    def __init__(self, *a, **k):\n"
        "        super().__init__(*a, **k); made.append(self)\n"
        "    def generate(self, *a, **k):\n"
        "        start = time.perf_counter(); out = super().generate(*a, **k)\n"
        "        self.wall = time.perf_counter() - start; return out\n"
        "import engine; engine.LLM = Timed\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "llm = made[-1]\n"
        "times = llm.llm_engine.collective_rpc('forward_times')[0]\n"
        "end = max(t[1] for t in times); inside = sum(b - a for a, b in times if b > end - llm.wall)\n"
        "print('FORWARD', json.dumps({'forward_share': inside / llm.wall}))\n"
    )
    argv = [str(BENCH / "offline_throughput.py"), "--engine", "raypage", "--model", model]
    argv += ["--workload", workload, "--engine-args", json.dumps(settings)]
    # `python -c` puts its working directory first on sys.path: the other checkout's, for its code.
    env = os.environ if code_dir is None else {**os.environ, "PYTHONPATH": code_dir}
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True, env=env, cwd=code_dir
    )
    result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    result.update(json.loads(done.stdout.split("FORWARD ", 1)[1].splitlines()[0]))
    return result


def serve_run(model: str, settings: dict, rate: str, port: int) -> dict:
    """One fresh `raypage api-server` under `vllm bench serve` at `rate` requests/s."""
    flags = ["--async-scheduling"] if settings["async_scheduling"] else []
    command = [str(Path(sys.executable).parent / "raypage"), "api-server", "--model", model]
    command += ["--served-model-name", "smollm2", "--port", str(port), "--dtype", "bfloat16"]
    command += ["--max-model-len", "2048", *flags]
    server = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_up(port)
        vllm_python = os.environ.get("VLLM_VENV", "/tmp/vllm-cpu-venv") + "/bin/python"
        load_command = [vllm_python, str(BENCH / "vllm_cli.py"), "bench", "serve", "--backend", "openai"]
        load_command += ["--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2", "--tokenizer", model]
        load_command += [
            "--dataset-name",
            "random",
            "--random-input-len",
            "128",
            "--random-output-len",
            "128",
        ]
        load_command += ["--num-prompts", "100", "--request-rate", rate, "--ignore-eos", "--seed", "0"]
        load = subprocess.run(
            load_command,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        )
        return {name: float(re.search(pattern, load.stdout)[1]) for name, pattern in SERVE_FIGURES.items()}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def _wait_up(port: int, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server on port {port} did not come up in {timeout_s:.0f} s")


def summarize(label: str, runs: dict[str, list[dict]], higher_is_better: set[str]) -> None:
    """Median and range of each figure by mode, the async / sync ratio of the medians, and with a
    baseline the ratio of each of the two to it."""
    for figure in runs["sync"][0]:
        if not isinstance(runs["sync"][0][figure], float):
            continue
        medians = {}
        for mode, results in runs.items():
            values = [result[figure] for result in results]
            medians[mode] = statistics.median(values)
            print(
                f"{label} {figure} {mode}: median {medians[mode]:.4g} (range {min(values):.4g}-{max(values):.4g})"
            )
        better = "higher" if figure in higher_is_better else "lower"
        pairs = [("async", "sync")] + [(mode, "baseline") for mode in MODES if "baseline" in medians]
        for mode, reference in pairs:
            ratio = medians[mode] / medians[reference]
            print(f"RATIO {label} {figure} {mode}/{reference}: {ratio:.3f} ({better} is better)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/tmp/smollm2-hf", help="a bf16 HF folder (make_hf_model.py)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="*", default=["uniform", "mixed", "prefix"])
    parser.add_argument("--serve", nargs="*", default=[], metavar="RATE", help="request rates to serve at")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--baseline", metavar="DIR", help="another checkout to run offline, sync, beside")
    args = parser.parse_args()
    offline_modes = {mode: (settings, None) for mode, settings in MODES.items()}
    if args.baseline:
        offline_modes["baseline"] = (MODES["sync"], args.baseline)
    for workload in args.workloads:
        runs: dict[str, list[dict]] = {mode: [] for mode in offline_modes}
        for _ in range(args.rounds):
            for mode, (settings, code_dir) in offline_modes.items():
                result = offline_run(args.model, workload, settings, code_dir)
                runs[mode].append(result)
                print(f"{workload} {mode}: {json.dumps(result)}", flush=True)
        summarize(workload, runs, {"output_tok_s", "total_tok_s", "forward_share"})
    for rate in args.serve:
        runs = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode, settings in MODES.items():
                result = serve_run(args.model, settings, rate, args.port)
                runs[mode].append(result)
                print(f"serve rate={rate} {mode}: {json.dumps(result)}", flush=True)
        summarize(f"serve rate={rate}", runs, {"output_tok_s"})


if __name__ == "__main__":
    main()
