"""Per-layer decode attention time: the C++ kernel over blocks in place against the sdpa backend's gather.

    python -m kernels.bench_attention [--threads 2] [--rounds 7] [--cold [--layers 30] [--small-pages]]

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64), blocks of 16, a bf16 cache, blocks
scattered at random; one batch of 64 sequences of 128-256 tokens and one of 128 sequences of 16-1024.

By default one layer's cache is attended over and over, so its few megabytes of used blocks stay in
L3. `--cold` times what the engine sees instead: one cache per layer (`--layers`, SmolLM2 has 30) of
`--num-blocks` blocks on huge pages as the engine allocates them (`--small-pages`: 4 KB pages), all
attended in sequence, so that each layer's blocks have left L3 by the time it comes round again.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from torch.utils import benchmark

from kernels.attention.cpu_paged import decode_in_place
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.sdpa import decode_padded_runs
from kernels.build import cpu_kernels_available
from kernels.huge_pages import zeros_on_huge_pages

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def decode_batch(
    seq_lens: list[int], num_blocks: int, seed: int = 0, layers: int = 1, huge_pages: bool = True
) -> tuple[torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """Query rows, one random bf16 cache per layer and metadata for decodes of the given lengths (sorted
    longest first). Every layer's cache holds the batch's blocks at the same ids, as the engine's do."""
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
    shape = (2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    caches = []
    for _ in range(layers):
        cache = (
            zeros_on_huge_pages(*shape, dtype=torch.bfloat16) if huge_pages else torch.zeros(shape).bfloat16()
        )
        # Random rows only in the blocks the batch reads: the rest stay zero, as unwritten blocks are.
        cache[:, :, free[:used]] = torch.randn(2, KV_HEADS, used, BLOCK, HEAD_DIM, generator=gen).bfloat16()
        caches.append(cache)
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
    return query, caches, meta


def decode_layers(
    decode: Callable[..., None],
    out: torch.Tensor,
    query: torch.Tensor,
    caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> None:
    """One decode step's attention: the same batch against every layer's cache in turn."""
    for cache in caches:
        decode(out, query, cache, meta, 0.125)


def time_backends(seq_lens: list[int], args: argparse.Namespace) -> dict[str, float]:
    """Median microseconds per layer of each backend on this batch (its caches freed on return)."""
    layers = args.layers if args.cold else 1
    # 11650: the blocks per layer the engine gives SmolLM2 in bf16 here, so that they lie as sparsely.
    num_blocks = args.num_blocks or (11650 if args.cold else 8192)
    query, caches, meta = decode_batch(seq_lens, num_blocks, layers=layers, huge_pages=not args.small_pages)
    out = torch.empty_like(query)
    # Interleaved rounds, median of each: this machine's shared cores make single runs noisy.
    rounds: dict[str, list[float]] = {"sdpa": [], "cpu_paged": []}
    for _ in range(args.rounds):
        for name, decode in (("sdpa", decode_padded_runs), ("cpu_paged", decode_in_place)):
            timer = benchmark.Timer(
                "decode_layers(decode, out, query, caches, meta)",
                globals={
                    "decode_layers": decode_layers,
                    "decode": decode,
                    "out": out,
                    "query": query,
                    "caches": caches,
                    "meta": meta,
                },
                num_threads=args.threads,
            )
            rounds[name].append(timer.blocked_autorange(min_run_time=0.3).median * 1e6 / layers)
    return {name: statistics.median(values) for name, values in rounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cold", action="store_true", help="one cache per layer, as in the engine")
    parser.add_argument("--layers", type=int, default=30, help="caches attended in turn with --cold")
    parser.add_argument("--num-blocks", type=int, default=None, help="blocks per cache (8192; 11650 cold)")
    parser.add_argument("--small-pages", action="store_true", help="4 KB pages, not huge pages")
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the C++ kernels could not be built here (see the log line above)")
    gen = torch.Generator().manual_seed(1)
    batches = {
        "64 x 128-256": torch.randint(128, 257, (64,), generator=gen).tolist(),
        "128 x 16-1024": torch.randint(16, 1025, (128,), generator=gen).tolist(),
    }
    for label, seq_lens in batches.items():
        times = time_backends(seq_lens, args)
        print(
            f"{label}: sdpa {times['sdpa']:.0f} us, cpu_paged {times['cpu_paged']:.0f} us per layer "
            f"({times['sdpa'] / times['cpu_paged']:.2f}x), {args.threads} threads, median of {args.rounds} rounds"
            + (
                f", cold: {args.layers} caches of {args.num_blocks or 11650} blocks in turn"
                if args.cold
                else ", warm"
            )
            + (", 4 KB pages" if args.small_pages else "")
        )


if __name__ == "__main__":
    main()
