"""`raypage bench throughput`: offline throughput on seeded random prompts.

Prompts are random token ids (drawn from [100, 40000), as in the shared offline benchmark), decoded
greedily with ignore_eos so every run produces exactly the requested number of tokens. The engine is
stepped directly, so that its KV-cache statistics can be read after every step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from cluster.bench.compute_floor import measured_matmul_rate, run_flops
from cluster.bench.op_profile import print_op_profile, profile_ops
from cluster.engine_args import add_engine_args
from engine import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams

# Token ids are drawn from this range: clear of the special tokens at the start of the vocabulary.
TOKEN_ID_RANGE = (100, 40000)
# The untimed warm-up: short, and its prompts differ from the workload's so the prefix cache stays cold.
WARMUP_PROMPTS = [list(range(100, 132)), list(range(200, 232))]
WARMUP_TOKENS = 4

# A workload: one (prompt token ids, output length) pair per request.
Workload = list[tuple[list[int], int]]


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Register `throughput` under `raypage bench`."""
    parser = benchmarks.add_parser(
        "throughput",
        help="offline throughput on random prompts",
        description="Offline throughput on seeded random prompts (greedy, ignore_eos; with --n, seeded "
        "sampling; with --beam-width, beam search). The engine's --seed also seeds the workload.",
    )
    parser.add_argument("--num-prompts", type=positive_int, default=64, help="requests (default: 64)")
    parser.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens (default: 128)")
    parser.add_argument("--output-len", type=positive_int, default=128, help="output tokens (default: 128)")
    parser.add_argument(
        "--range-ratio",
        type=_ratio,
        default=0.0,
        help="lengths are drawn uniformly from [len*(1-r), len*(1+r)] (default: 0.0, fixed lengths)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--n",
        type=positive_int,
        default=1,
        help="parallel samples per prompt, sharing its blocks (default: 1)",
    )
    group.add_argument(
        "--beam-width", type=positive_int, help="beam search with this many beams instead of sampling"
    )
    parser.add_argument(
        "--profile-ops",
        action="store_true",
        help="run under torch.profiler and print where the time went, by kind of operator "
        "(slower: the throughput figures of such a run are not comparable)",
    )
    parser.add_argument(
        "--output-json",
        type=Path,
        metavar="PATH",
        help="results file (default: bench-results/throughput-<timestamp>.json)",
    )
    add_engine_args(parser)
    parser.set_defaults(handler=run, command_parser=parser)


def make_workload(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> Workload:
    """Seeded random prompts and output lengths."""
    rng = random.Random(seed)

    def draw_length(mean: int) -> int:
        low = max(1, int(mean * (1 - range_ratio)))
        return rng.randint(low, max(low, int(mean * (1 + range_ratio))))

    workload = []
    for _ in range(num_prompts):
        prompt = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(draw_length(input_len))]
        workload.append((prompt, draw_length(output_len)))
    return workload


def request_params(args: argparse.Namespace, seed: int) -> Callable[[int], SamplingParams | BeamSearchParams]:
    """The per-request settings of the run, for a given output length."""
    if args.beam_width:
        return lambda length: BeamSearchParams(beam_width=args.beam_width, max_tokens=length, ignore_eos=True)
    if args.n > 1:
        return lambda length: SamplingParams(
            n=args.n, temperature=1.0, seed=seed, max_tokens=length, ignore_eos=True
        )
    return lambda length: SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)


def measure(
    engine: LLMEngine, workload: Workload, params: Callable[[int], SamplingParams | BeamSearchParams]
) -> dict[str, Any]:
    """After an untimed warm-up, run the workload: throughput, KV-cache utilization and sharing, time."""
    _run_to_completion(engine, [(prompt, WARMUP_TOKENS) for prompt in WARMUP_PROMPTS], "warmup", params)
    engine.collective_rpc("communication_stats")  # count from here on
    start = time.perf_counter()
    output_tokens, kv, step_times = _run_to_completion(engine, workload, "bench", params)
    elapsed = time.perf_counter() - start
    communication = communication_shares(engine.collective_rpc("communication_stats"), elapsed)
    expected = sequences_per_prompt(params) * sum(length for _, length in workload)
    if output_tokens != expected:
        raise RuntimeError(f"the engine produced {output_tokens} tokens, expected {expected}")
    input_tokens = sum(len(prompt) for prompt, _ in workload)
    return {
        "requests_per_s": len(workload) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
        "kv_cache_utilization_peak": kv.peak_utilization,
        "kv_cache_utilization_mean": kv.mean_utilization,
        "kv_memory_saved_by_sharing": kv.saved_by_sharing,
        "elapsed_s": elapsed,
        # Decode steps outnumber the few prefill steps, so the median is a decode step's time.
        "step_time_median_ms": statistics.median(step_times) * 1000,
        "num_preemptions": engine.get_stats()["num_preemptions"],
        "communication": communication,
    }


def sequences_per_prompt(params: Callable[[int], SamplingParams | BeamSearchParams]) -> int:
    """How many sequences each prompt of the run grows into: its beams, or its parallel samples."""
    sequences = params(1)
    return sequences.beam_width if isinstance(sequences, BeamSearchParams) else sequences.n


def compute_floor_share(
    engine: LLMEngine,
    workload: Workload,
    params: Callable[[int], SamplingParams | BeamSearchParams],
    elapsed: float,
) -> dict[str, Any]:
    """The run's FLOP rate against this machine's measured matmul rate (CPU runs only)."""
    model = engine.config.model
    if model.device != "cpu":
        return {}
    per_prompt = sequences_per_prompt(params)
    flops = run_flops(model.hf_config, [(len(prompt), length, per_prompt) for prompt, length in workload])
    rate = measured_matmul_rate(model.hf_config, getattr(torch, model.dtype))
    return {
        "model_tflops": flops / 1e12,
        "matmul_gflops_per_s": rate / 1e9,
        "compute_floor_share": flops / elapsed / rate,
    }


def communication_shares(per_rank: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """Per rank, the share of the run spent in each collective (all-reduce, all-gather, pipeline
    send and receive; a receive includes waiting for the previous stage) and in all of them."""
    ranks = []
    for times in per_rank:
        shares = {operation: seconds / elapsed for operation, (seconds, _) in times.items()}
        ranks.append({"total": sum(shares.values()), **shares})
    return {"per_rank": ranks, "max_total": max((r["total"] for r in ranks), default=0.0)}


class KVUsage:
    """KV-cache figures accumulated over the steps of a run, read from the engine's stats."""

    def __init__(self) -> None:
        self.peak_utilization = 0.0
        self._held = self._allocated = self._physical_blocks = self._logical_blocks = 0

    def add(self, stats: dict[str, Any], block_size: int) -> None:
        if stats["kv_slots_allocated"] == 0:
            return
        # Utilization is tokens held / slots allocated: paging wastes only the unfilled tail of
        # each sequence's last block. (Sequences sharing blocks count those tokens once each but
        # the slots once, so with sharing the ratio can pass 1.)
        self.peak_utilization = max(
            self.peak_utilization, stats["kv_tokens_held"] / stats["kv_slots_allocated"]
        )
        self._held += stats["kv_tokens_held"]
        self._allocated += stats["kv_slots_allocated"]
        self._physical_blocks += stats["kv_slots_allocated"] // block_size
        self._logical_blocks += stats["kv_logical_blocks"]

    @property
    def mean_utilization(self) -> float:
        """Weighted by allocated slots: the share of all allocated memory-time that held tokens."""
        return self._held / self._allocated if self._allocated else 0.0

    @property
    def saved_by_sharing(self) -> float:
        """1 - blocks used / blocks the same sequences would need unshared, over all steps."""
        return 1.0 - self._physical_blocks / self._logical_blocks if self._logical_blocks else 0.0


def _run_to_completion(
    engine: LLMEngine,
    workload: Workload,
    id_prefix: str,
    params: Callable[[int], SamplingParams | BeamSearchParams],
) -> tuple[int, KVUsage]:
    """(output tokens produced over every returned sequence, the KV-cache figures of the run, the
    wall time of each step)."""
    for index, (prompt, max_tokens) in enumerate(workload):
        engine.add_request(f"{id_prefix}-{index}", {"prompt_token_ids": prompt}, params(max_tokens))
    output_tokens = 0
    usage = KVUsage()
    step_times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - started)
        for output in outputs:
            if output.finished:
                output_tokens += sum(len(completion.token_ids) for completion in output.outputs)
        usage.add(engine.get_stats(), engine.config.cache.block_size)
    return output_tokens, usage, step_times


def run(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """Handler of `raypage bench throughput`: measure, print a summary, write the JSON results."""
    # The core in this process, so that a step's time is the core's own: scheduling, the executor's
    # round trip to its workers, the forward pass and the output update.
    engine = LLMEngine(EngineConfig.from_flat(**settings), multiprocess_mode=False)
    try:
        engine_settings = engine.config.to_flat()  # resolved: model path, device, dtype, max_model_len
        workload_settings = {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "seed": engine_settings["seed"],
        }
        workload = make_workload(**workload_settings)
        workload_settings.update(n=args.n, beam_width=args.beam_width)
        _check_fits(workload, engine)
        params = request_params(args, workload_settings["seed"])
        if args.profile_ops:
            results, op_seconds, wall = profile_ops(lambda: measure(engine, workload, params))
            results["op_profile_s"] = {**op_seconds, "wall": wall}
        else:
            results = measure(engine, workload, params)
        results.update(compute_floor_share(engine, workload, params, results["elapsed_s"]))
    finally:
        engine.shutdown()
    workload_settings["total_input_tokens"] = sum(len(prompt) for prompt, _ in workload)
    workload_settings["total_output_tokens"] = sum(length for _, length in workload)
    print_summary(results)
    if args.profile_ops:
        print_op_profile(
            {k: v for k, v in results["op_profile_s"].items() if k != "wall"}, results["op_profile_s"]["wall"]
        )
    now = datetime.now().astimezone()
    path = args.output_json or Path("bench-results") / f"throughput-{now:%Y%m%d-%H%M%S}.json"
    record = {
        "benchmark": "throughput",
        "timestamp": now.isoformat(timespec="seconds"),
        **results,
        "workload": workload_settings,
        "engine": engine_settings,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"Results written to {path}")


def _check_fits(workload: Workload, engine: LLMEngine) -> None:
    """Exit with a clear message when a request would be cut short (its tokens would not count)."""
    longest = max(len(prompt) + output_len for prompt, output_len in workload)
    max_model_len = engine.config.model.max_model_len
    kv_capacity = engine.get_stats()["num_kv_blocks"] * engine.config.cache.block_size
    if longest > min(max_model_len, kv_capacity):
        raise SystemExit(
            f"raypage bench throughput: error: the longest request needs {longest} tokens, but "
            f"max_model_len is {max_model_len} and the whole KV cache holds {kv_capacity}"
        )


def print_summary(results: dict[str, Any]) -> None:
    """The headline numbers, one per line."""
    peak, mean = results["kv_cache_utilization_peak"], results["kv_cache_utilization_mean"]
    print(
        f"Throughput: {results['requests_per_s']:.2f} requests/s, "
        f"{results['output_tokens_per_s']:.1f} output tokens/s, "
        f"{results['total_tokens_per_s']:.1f} total tokens/s"
    )
    print(f"KV-cache utilization (tokens held / slots allocated): peak {peak:.1%}, mean {mean:.1%}")
    print(f"KV memory saved by block sharing: {results['kv_memory_saved_by_sharing']:.1%}")
    for rank, shares in enumerate(results["communication"]["per_rank"]):
        if shares["total"]:
            detail = ", ".join(f"{op} {share:.1%}" for op, share in shares.items() if op != "total")
            print(f"Rank {rank} communicating: {shares['total']:.1%} of the run ({detail})")
    print(f"Median step time: {results['step_time_median_ms']:.2f} ms")
    if "compute_floor_share" in results:
        print(
            f"Compute floor: {results['model_tflops']:.2f} TFLOP of model arithmetic at this machine's "
            f"measured {results['matmul_gflops_per_s']:.0f} GFLOP/s matmul rate; the run reached "
            f"{results['compute_floor_share']:.1%} of it"
        )
    print(f"Elapsed: {results['elapsed_s']:.2f} s ({results['num_preemptions']} preemptions)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value
