"""Speculative decoding against none, side by side: offline tokens per second and served TPOT.

    python -m benchmarks.spec_decode offline [--rounds 3] [--spec JSON] [--dtype bfloat16] [--quantization none]
    python -m benchmarks.spec_decode serve [--rounds 2] [--rate 1] [--spec JSON] [--quantization none]

`offline` runs three workloads through `LLM` on the packaged SmolLM2, each round building a fresh
engine per mode (the order alternating between rounds, so drift in the machine's speed does not
favor one mode): batch 1, the input-grounded chat requests of `benchmarks.grounded_prompts` one at
a time; batch 32 of random 128-token prompts; and batch 32 of the grounded requests (each 4
times). Every request decodes `--output-len` tokens greedily with ignore_eos, so both modes produce the same tokens (speculation is exact for greedy)
and their tokens per second compare directly. `serve` starts a fresh `raypage serve` per mode and
round and streams the grounded requests to it at `--rate` requests per second (Poisson arrivals),
reporting the median time per output token. Each prints one line per round and mode, and a RATIO
line per workload: the median of the rounds' ratios, with their range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from benchmarks.grounded_prompts import REQUESTS
from cluster.bench.serve import run_rate
from cluster.bench.throughput import make_workload
from engine import LLM, SamplingParams
from engine.frontend.tokenizer import render_chat_prompt
from engine.models.model_files import packaged_model_path
from engine.models.tokenizer_files import load_gguf_tokenizer
from kernels.huge_pages import wait_for_prefaults

DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
)
SERVED_MODEL = "smollm2"
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def grounded_prompt_ids() -> list[list[int]]:
    """The grounded requests in the packaged model's chat template, as token ids."""
    tokenizer = load_gguf_tokenizer(packaged_model_path())
    return [
        render_chat_prompt(tokenizer, [{"role": "user", "content": text}])["prompt_token_ids"]
        for text in REQUESTS
    ]


def tokens_per_second(llm: LLM, batches: list[list[list[int]]], output_len: int) -> float:
    """Generate each batch in turn (all of a batch's prompts together); output tokens per second."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    wait_for_prefaults()  # the KV cache's pages, faulted in on a thread after start-up
    warm_up = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(200, 264))}], warm_up, use_tqdm=False)
    produced = 0
    start = time.perf_counter()
    for batch in batches:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        produced += sum(len(output.outputs[0].token_ids) for output in outputs)
    return produced / (time.perf_counter() - start)


def offline_workloads(args: argparse.Namespace) -> dict[str, list[list[list[int]]]]:
    """Per workload, its batches of prompts."""
    random_prompts = [prompt for prompt, _ in make_workload(32, 128, args.output_len, 0.0, seed=0)]
    grounded = grounded_prompt_ids()
    return {
        "batch 1, grounded": [[ids] for ids in grounded],
        "batch 32, random": [random_prompts],
        # Every sequence finds its drafts: where verifying them costs most.
        "batch 32, grounded": [_repeated(grounded, 32)],
    }


def run_offline(args: argparse.Namespace) -> None:
    modes = {"none": None, "spec": json.loads(args.spec)}
    ratios: dict[str, list[float]] = {}
    workloads = offline_workloads(args)
    for round_index in range(args.rounds):
        for workload, batches in workloads.items():
            rates = {}
            for mode in _order(modes, round_index):
                llm = LLM(dtype=args.dtype, quantization=args.quantization, speculative_config=modes[mode])
                rates[mode] = tokens_per_second(llm, batches, args.output_len)
                llm.llm_engine.shutdown()
                del llm
                print(
                    f"round {round_index + 1} {workload} {mode}: {rates[mode]:.1f} output tok/s", flush=True
                )
            ratios.setdefault(workload, []).append(rates["spec"] / rates["none"])
    for workload, values in ratios.items():
        _print_ratio(f"{workload} tok/s spec/none", values)


def run_serve(args: argparse.Namespace) -> None:
    modes = {"none": None, "spec": args.spec}
    ratios = []
    for round_index in range(args.rounds):
        tpots = {}
        for mode in _order(modes, round_index):
            tpots[mode] = _served_median_tpot(args, modes[mode])
            print(
                f"round {round_index + 1} serve {mode}: median TPOT {tpots[mode] * 1000:.1f} ms", flush=True
            )
        ratios.append(tpots["spec"] / tpots["none"])
    _print_ratio(f"serve at {args.rate} req/s median TPOT spec/none", ratios)


def _served_median_tpot(args: argparse.Namespace, spec: str | None) -> float:
    """Start a fresh `raypage serve`, stream the grounded requests at the rate, stop it."""
    command = [
        str(Path(sys.executable).parent / "raypage"),
        "serve",
        "--port",
        str(args.port),
        "--served-model-name",
        SERVED_MODEL,
        "--dtype",
        args.dtype,
    ]
    if args.quantization is not None:
        command += ["--quantization", args.quantization]
    if spec is not None:
        command += ["--speculative-config", spec]
    server = subprocess.Popen(command, cwd=PROJECT_ROOT, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        base_url = f"http://127.0.0.1:{args.port}"
        _wait_until_serving(base_url, server)
        prompts = _repeated(grounded_prompt_ids(), args.num_prompts)
        settings = SimpleNamespace(max_concurrency=None, output_len=args.output_len, seed=0)
        summary = asyncio.run(_drive(base_url, prompts, settings, args.rate))
    finally:
        # SIGINT lets `raypage serve` shut its Ray cluster down; then the whole group, in case.
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    if summary["completed"] != len(prompts):
        raise RuntimeError(f"only {summary['completed']} of {len(prompts)} requests completed: {summary}")
    return summary["tpot"]["median_ms"] / 1000


def _repeated(prompts: list[list[int]], count: int) -> list[list[int]]:
    return [prompts[index % len(prompts)] for index in range(count)]


async def _drive(base_url: str, prompts: list[list[int]], settings: SimpleNamespace, rate: float) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        return await run_rate(client, SERVED_MODEL, prompts, settings, rate)


def _wait_until_serving(base_url: str, server: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"raypage serve exited with status {server.returncode} before serving")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"raypage serve did not answer at {base_url} within {timeout_s:.0f} s")


def _order(modes: dict, round_index: int) -> list[str]:
    names = list(modes)
    return names if round_index % 2 == 0 else names[::-1]


def _print_ratio(label: str, values: list[float]) -> None:
    print(
        f"RATIO {label}: median {statistics.median(values):.2f} "
        f"(rounds {', '.join(f'{value:.2f}' for value in values)})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("where", choices=["offline", "serve"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="speculative_config JSON (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--quantization", default=None, help="none: the GGUF dequantized at load (default: kept quantized)"
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rate", type=float, default=1.0, help="serve: requests per second")
    parser.add_argument("--num-prompts", type=int, default=24, help="serve: requests per run")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    run_offline(args) if args.where == "offline" else run_serve(args)


if __name__ == "__main__":
    main()
