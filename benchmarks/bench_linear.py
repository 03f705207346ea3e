"""GFLOP/s of SmolLM2's projections in each linear weight form this CPU has (kernels/linear.py).

    python -m benchmarks.bench_linear [--rows 64 2048] [--rounds 15] [--threads 2]

Each form is timed over 30 copies of the weight in turn, so that every call reads its weight from
memory as a decode step does (30 layers' weights do not fit in L3); "warm" repeats one copy. Forms
run interleaved, round after round, and each figure is the median of the rounds: this machine's
shared cores make single runs noisy. The gate/up row is the fused SiLU-and-multiply where the
form has one (panels), the projection followed by `silu_and_mul` elsewhere.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kernels.build import cpu_kernels_available
from kernels.linear import (
    WeightForm,
    linear,
    onednn_computes_in,
    panel_kernel_serves,
    prepare_weight,
    silu_and_mul_linear,
)

HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152
# (name, input size, output size, shards): SmolLM2-135M's projections and its LM head.
PROJECTIONS = [
    ("qkv", HIDDEN, 960, 1),
    ("o", HIDDEN, HIDDEN, 1),
    ("gate/up", HIDDEN, 2 * INTERMEDIATE, 2),
    ("down", INTERMEDIATE, HIDDEN, 1),
    ("lm_head", HIDDEN, VOCAB, 1),
]
COPIES = 30


def forms() -> list[WeightForm]:
    """The bf16 forms this machine can run, fastest-chosen first."""
    available = [WeightForm.PANELS] if panel_kernel_serves() else []
    if onednn_computes_in(torch.bfloat16):
        available.append(WeightForm.ONEDNN_PREPACKED)
    return [*available, WeightForm.WIDENED]


def projection_call(
    form: WeightForm, weight: torch.Tensor, shards: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    prepared = prepare_weight(weight, form, shards if form is WeightForm.PANELS else 1)
    if shards == 2:
        return lambda x: silu_and_mul_linear(x, prepared)
    return lambda x: linear(x, prepared)


def time_projection(rows: int, k: int, n: int, shards: int, rounds: int) -> dict[str, float]:
    """Median GFLOP/s per form, cold (30 weights in turn) and warm (one weight again and again)."""
    copies = 1 if n == VOCAB else COPIES  # the LM head alone is larger than L3
    weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k).to(torch.bfloat16)
    calls: dict[str, Callable[[], object]] = {}
    for form in forms():
        prepared = [projection_call(form, weight, shards) for weight in weights]
        calls[f"{form.value} cold"] = lambda prepared=prepared: [call(x) for call in prepared]
        calls[f"{form.value} warm"] = lambda call=prepared[0]: [call(x) for _ in range(copies)]
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for call in calls.values():
            call()
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
    flops = 2 * rows * k * n * copies
    return {name: flops / statistics.median(values) / 1e9 for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 2048])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the C++ kernels could not be built here (see the log line above)")
    torch.set_num_threads(args.threads)
    for rows in args.rows:
        for name, k, n, shards in PROJECTIONS:
            rates = time_projection(rows, k, n, shards, args.rounds)
            figures = ", ".join(f"{form} {rate:.0f}" for form, rate in rates.items())
            print(f"{rows} rows, {name} ({k} -> {n}): {figures} GFLOP/s, {args.threads} threads")


if __name__ == "__main__":
    main()
