"""Per-layer decode attention time: the C++ kernel over blocks in place against the sdpa backend's gather.

    python -m kernels.bench_attention [--threads 2] [--rounds 7]

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64), blocks of 16, a bf16 cache, blocks
scattered at random; one batch of 64 sequences of 128-256 tokens and one of 128 sequences of 16-1024.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.utils import benchmark

from kernels.attention.cpu_paged import decode_in_place
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.sdpa import decode_padded_runs
from kernels.build import cpu_kernels_available

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def decode_batch(seq_lens: list[int], num_blocks: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Query rows, a random bf16 cache and metadata for decodes of the given lengths (sorted longest first)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = sorted(seq_lens, reverse=True)
    width = -(-seq_lens[0] // BLOCK)
    free = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), width, dtype=torch.long)
    used = 0
    for row, seq_len in enumerate(seq_lens):
        blocks = -(-seq_len // BLOCK)
        table[row, :blocks] = free[used : used + blocks]
        used += blocks
    cache = torch.randn(2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen).to(torch.bfloat16)
    query = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_table=table,
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens_list=seq_lens,
        num_decodes=len(seq_lens),
        block_size=BLOCK,
    )
    return query, cache, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the C++ kernels could not be built here (see the log line above)")
    gen = torch.Generator().manual_seed(1)
    batches = {
        "64 x 128-256": torch.randint(128, 257, (64,), generator=gen).tolist(),
        "128 x 16-1024": torch.randint(16, 1025, (128,), generator=gen).tolist(),
    }
    for label, seq_lens in batches.items():
        query, cache, meta = decode_batch(seq_lens, num_blocks=8192)
        out = torch.empty_like(query)
        # Interleaved rounds, median of each: this machine's shared cores make single runs noisy.
        rounds: dict[str, list[float]] = {"sdpa": [], "cpu_paged": []}
        for _ in range(args.rounds):
            for name, decode in (("sdpa", decode_padded_runs), ("cpu_paged", decode_in_place)):
                timer = benchmark.Timer(
                    "decode(out, query, cache, meta, 0.125)",
                    globals={"decode": decode, "out": out, "query": query, "cache": cache, "meta": meta},
                    num_threads=args.threads,
                )
                rounds[name].append(timer.blocked_autorange(min_run_time=0.3).median * 1e6)
        times = {name: statistics.median(values) for name, values in rounds.items()}
        print(
            f"{label}: sdpa {times['sdpa']:.0f} us, cpu_paged {times['cpu_paged']:.0f} us per layer "
            f"({times['sdpa'] / times['cpu_paged']:.2f}x), {args.threads} threads, median of {args.rounds} rounds"
        )


if __name__ == "__main__":
    main()
