"""Time to apply a grammar's token bitmask to a batch of logits in place: the C++ op against plain torch.

    python -m benchmarks.bench_token_bitmask [--threads 2] [--rounds 7] [--rows 64] [--vocab 49152]

`--rows` rows of logits at SmolLM2's vocabulary of 49,152 tokens, in float32 and bf16, each with a
mask row of its own: random masks that allow about 1% of the tokens (a grammar between the pieces
of its structure, where a few tokens may come next) and masks that allow every token (free text
inside a JSON string). Every call masks the same logits again, which costs what the first call
does: each implementation reads the whole mask and writes every disallowed logit whatever it holds.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from torch.utils import benchmark

from kernels.build import cpu_kernels_available
from kernels.token_bitmask import apply_token_bitmask_torch


def random_masks(rows: int, vocab: int, allowed: float, seed: int = 0) -> torch.Tensor:
    """int32 [rows, ceil(vocab / 32)] masks, each token allowed with probability `allowed`."""
    gen = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    bits = (torch.rand(rows, words, 32, generator=gen) < allowed).long()
    packed = (bits << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def time_calls(calls: dict[str, Callable[[], None]], threads: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds per call of each, one median per round, the rounds interleaved: this machine's
    shared cores make single runs noisy."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            timer = benchmark.Timer("call()", globals={"call": call}, num_threads=threads)
            times[name].append(timer.blocked_autorange(min_run_time=0.2).median * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the C++ kernels could not be built here (see the log line above)")
    masks = {
        "1% allowed": random_masks(args.rows, args.vocab, 0.01),
        "all allowed": torch.full((args.rows, -(-args.vocab // 32)), -1, dtype=torch.int32),
    }
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(args.rows, args.vocab).to(dtype)
        for label, mask in masks.items():
            calls = {
                "C++": lambda logits=logits, mask=mask: torch.ops.raypage.apply_token_bitmask(
                    logits, mask, None
                ),
                "torch": lambda logits=logits, mask=mask: apply_token_bitmask_torch(logits, mask),
            }
            times = time_calls(calls, args.threads, args.rounds)
            medians = {name: statistics.median(values) for name, values in times.items()}
            cells = ", ".join(
                f"{name} {medians[name]:.0f} us ({min(values):.0f}-{max(values):.0f})"
                for name, values in times.items()
            )
            print(
                f"{args.rows} x {args.vocab} {str(dtype).removeprefix('torch.')}, {label}: {cells}; "
                f"{medians['torch'] / medians['C++']:.1f}x, {args.threads} threads, "
                f"median (range) of {args.rounds} rounds"
            )


if __name__ == "__main__":
    main()
