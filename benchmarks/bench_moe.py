"""Tokens/s of a mixture-of-experts block's experts on the CPU: the fused C++ kernel
(kernels/csrc/moe.cpp) against the per-expert loop in plain torch (kernels/moe.py).

    python -m benchmarks.bench_moe [--tokens 64 512] [--rounds 9] [--dtype bfloat16]

The default shape is Qwen3-30B-A3B's halved: hidden 1024 (of 2048), expert intermediate 384 (of
768), 64 experts (of 128), top-8 as it has: about 150 MB of bf16 expert weights, more than the
caches hold, so each call streams them from memory as a decode step does. Routing (softmax, top-k)
is the same precomputed tensor for both, from random router logits: every expert gets tokens.
The two run interleaved, round after round; each figure is the median of the rounds, with the
slowest and fastest round beside it, since this machine's shared cores make single runs noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kernels.build import cpu_kernels_available
from kernels.moe import fused_experts, fused_experts_torch, select_experts


def time_experts(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, rounds: int
) -> dict[str, list[float]]:
    """Seconds per round of each implementation on one random block."""
    w13 = (torch.randn(experts, 2 * inter, hidden) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) * inter**-0.5).to(dtype)
    x = torch.randn(tokens, hidden).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts), top_k, renormalize=True)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "fused": lambda: fused_experts(x, weights, ids, w13, w2),
        "per-expert loop": lambda: fused_experts_torch(x, weights, ids, w13, w2),
    }
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for call in calls.values():
            call()
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the C++ kernels could not be built here (see the log line above)")
    dtype = getattr(torch, args.dtype)
    shape = (
        f"hidden {args.hidden}, intermediate {args.intermediate}, {args.experts} experts, top-{args.top_k}"
    )
    print(f"{shape}, {args.dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for tokens in args.tokens:
        seconds = time_experts(
            tokens, args.hidden, args.intermediate, args.experts, args.top_k, dtype, args.rounds
        )
        for name, values in seconds.items():
            rates = sorted(tokens / value for value in values)
            print(
                f"{tokens} tokens, {name}: {tokens / statistics.median(values):.0f} tokens/s "
                f"(rounds {rates[0]:.0f}-{rates[-1]:.0f})"
            )


if __name__ == "__main__":
    main()
