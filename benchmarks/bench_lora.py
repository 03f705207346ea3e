"""Time a decode step's LoRA products on the CPU: `add_lora` (the C++ kernel, kernels/csrc/lora.cpp)
against the per-slot torch loop (`add_lora_reference`), for SmolLM2-135M's projections.

    python -m benchmarks.bench_lora [--rows 64] [--adapters 4] [--rank 16] [--rounds 15]

The rows are split evenly over the adapters, in a random order, as the slots of a mixed decode
batch (a 64-row step with 4 adapters of rank 16 by default), in bf16. Each projection has 30 copies
of its adapters' weights, one per layer, called in turn, so that every call reads weights the
previous calls displaced from the nearer caches, as in a real step (where the base model's weights
stream through the caches between them); a projection's input and output are one pair for all its
layers, in cache, as a real layer's are: the base projection has just read and written them.

A round times the 30 calls of each projection and then a whole step (30 layers x 4 projections,
the 120 calls of a forward pass); the two paths run interleaved, round after round, and each figure
is the median of the rounds with the fastest and slowest beside it, since this machine's shared
cores make single runs noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kernels.build import cpu_kernels_available
from kernels.lora import LoRABatch, add_lora, add_lora_reference

HIDDEN, INTERMEDIATE, HEAD_DIM, HEADS, KV_HEADS = 576, 1536, 64, 9, 3
LAYERS = 30
# (name, input size, the output size of each part): SmolLM2-135M's projections.
PROJECTIONS = [
    ("qkv", HIDDEN, (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)),
    ("o", HIDDEN, (HIDDEN,)),
    ("gate_up", HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
    ("down", INTERMEDIATE, (HIDDEN,)),
]
PATHS: dict[str, Callable[..., None]] = {"C++ kernel": add_lora, "torch reference": add_lora_reference}

Call = Callable[[], None]


def layer_calls(
    path: Callable[..., None], batch: LoRABatch, rows: int, adapters: int, rank: int, seed: int
) -> dict[str, list[Call]]:
    """Per projection, one call a layer, each with its own adapter weights (scaled so that the
    products are about as large as the outputs), all on one input and output."""
    generator = torch.Generator().manual_seed(seed)
    calls: dict[str, list[Call]] = {}
    for name, in_features, sizes in PROJECTIONS:
        out_features = sum(sizes)
        calls[name] = []
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        out = torch.randn(rows, out_features, generator=generator).bfloat16()
        for _ in range(LAYERS):
            lora_a = (
                torch.randn(adapters, len(sizes) * rank, in_features, generator=generator) * in_features**-0.5
            ).bfloat16()
            lora_b = (torch.randn(adapters, out_features, rank, generator=generator) * rank**-0.5).bfloat16()
            calls[name].append(
                lambda out=out, x=x, a=lora_a, b=lora_b, sizes=sizes: path(out, x, a, b, sizes, batch)
            )
    return calls


def run_all(calls: list[Call]) -> float:
    """Seconds to make `calls` one after the other."""
    start = time.perf_counter()
    for call in calls:
        call()
    return time.perf_counter() - start


def main() -> None:
    """Time both paths and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the C++ kernels could not be built here (see the log line above)")
    token_slots = np.random.default_rng(0).permutation(np.arange(args.rows) % args.adapters)
    batch = LoRABatch.from_token_slots(token_slots, args.adapters, torch.device("cpu"))
    calls = {
        path: layer_calls(fn, batch, args.rows, args.adapters, args.rank, seed=1)
        for path, fn in PATHS.items()
    }
    seconds: dict[str, dict[str, list[float]]] = {path: {} for path in PATHS}
    with torch.inference_mode():
        for path_calls in calls.values():  # warm up: first-touch of every tensor, the kernels' scratch
            for projection in path_calls.values():
                run_all(projection)
        for _ in range(args.rounds):
            for path, path_calls in calls.items():
                for name, projection in path_calls.items():
                    seconds[path].setdefault(name, []).append(run_all(projection) / LAYERS)
                step = [call for layer in zip(*path_calls.values(), strict=True) for call in layer]
                seconds[path].setdefault("step", []).append(run_all(step))
    print(
        f"{args.rows} rows over {args.adapters} adapters of rank {args.rank}, bf16, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds: median (fastest-slowest)"
    )
    print(f"{'':24}" + "".join(f"{path:>28}" for path in PATHS))
    for name in [name for name, _, _ in PROJECTIONS]:
        cells = [spread(seconds[path][name], 1e6, "us") for path in PATHS]
        print(f"{name + ' (per call)':24}" + "".join(f"{cell:>28}" for cell in cells))
    steps = [spread(seconds[path]["step"], 1e3, "ms") for path in PATHS]
    print(f"{f'step ({4 * LAYERS} calls)':24}" + "".join(f"{cell:>28}" for cell in steps))
    summed = [
        sum(statistics.median(seconds[path][name]) for name, _, _ in PROJECTIONS) * LAYERS * 1e3
        for path in PATHS
    ]
    print(f"{'sum of medians x 30':24}" + "".join(f"{f'{value:.2f} ms':>28}" for value in summed))


def spread(values: list[float], scale: float, unit: str) -> str:
    """The median and the range of `values` (seconds), in `unit`."""
    low, mid, high = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    return f"{mid:.1f} {unit} ({low:.1f}-{high:.1f})"


if __name__ == "__main__":
    main()
