"""Per-layer attention time of the CPU backends: the C++ kernels over blocks in place against the sdpa
backend's gathers.

    python -m benchmarks.bench_attention [--threads 2] [--rounds 7] [--prefill] [--cold [--layers 30] [--small-pages]]
                                         [--int8]

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64), blocks of 16, a bf16 cache, blocks
scattered at random. Decodes (the default): one batch of 64 sequences of 128-256 tokens and one of
128 sequences of 16-1024, through `decode_in_place` (`cpu_paged`) and `decode_padded_runs` (`sdpa`).
`--prefill`: whole steps through each backend, keys and values stored first: 16 fresh prompts of
128 tokens, 64 chunks of 32 after 384 cached tokens (a shared prefix), 4 prompts of 512, one chunk
of 1024 after 1024, and 64 decodes with 8 prompts of 128.

`paged_decode` times the path the tiled and AMX kernels replaced: `paged_decode_attention` with every
prefill row a one-token sequence (`rows_as_sequences`), and, where AMX serves, for decodes.

By default one layer's cache is attended over and over, so its few megabytes of used blocks stay in
L3. `--cold` times what the engine sees instead: one cache per layer (`--layers`, SmolLM2 has 30) of
`--num-blocks` blocks on huge pages as the engine allocates them (`--small-pages`: 4 KB pages), all
attended in sequence, so that each layer's blocks have left L3 by the time it comes round again.

`--int8` adds `cpu_paged int8`: the same steps over each cache quantized into an int8 cache
(kv_cache_dtype="int8", the `int8` path), and to the decodes a batch of 16 long contexts of 2048-4096
tokens, where reading half the bytes should pay most. The int8 copies take about as much memory again.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from torch.utils import benchmark

from kernels.attention.cpu_paged import amx_serves, cpu_paged_attention, decode_in_place
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams
from kernels.attention.sdpa import decode_padded_runs, sdpa_attention
from kernels.build import cpu_kernels_available
from kernels.cache_ops import cache_row_width, reshape_and_cache
from kernels.huge_pages import zeros_on_huge_pages

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
PARAMS = AttentionParams(HEAD_DIM**-0.5)

PREFILLS = {
    "16 x 128 fresh": [(0, 128)] * 16,
    "64 x (384 + 32)": [(384, 32)] * 64,
    "4 x 512 fresh": [(0, 512)] * 4,
    "1 x (1024 + 1024)": [(1024, 1024)],
    "64 decodes of 192 + 8 x 128": [(191, 1)] * 64 + [(0, 128)] * 8,
}


def paged_batch(
    specs: list[tuple[int, int]], num_blocks: int, seed: int = 0, layers: int = 1, huge_pages: bool = True
) -> tuple[torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """Query rows, one random bf16 cache per layer and metadata for (context, query_len) per sequence,
    decodes first. Every layer's cache holds the batch's blocks at the same ids, as the engine's do."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [context + query_len for context, query_len in specs]
    width = -(-max(seq_lens) // BLOCK)
    free = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(specs), width, dtype=torch.long)
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
    starts = [0]
    for _, query_len in specs:
        starts.append(starts[-1] + query_len)
    slots = [
        int(table[i, pos // BLOCK]) * BLOCK + pos % BLOCK
        for i, (context, query_len) in enumerate(specs)
        for pos in range(context, context + query_len)
    ]
    query = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_table=table,
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=starts,
        seq_lens_list=seq_lens,
        num_decodes=next((i for i, (_, q) in enumerate(specs) if q != 1), len(specs)),
        block_size=BLOCK,
    )
    return query, caches, meta


def int8_copy(cache: torch.Tensor, huge_pages: bool) -> torch.Tensor:
    """`cache` quantized row by row into an int8 cache of the same blocks, allocated as the engine does."""
    _, kv_heads, num_blocks, block_size, head_dim = cache.shape
    shape = (2, kv_heads, num_blocks, block_size, cache_row_width(head_dim, torch.int8))
    copy = (
        zeros_on_huge_pages(*shape, dtype=torch.int8) if huge_pages else torch.zeros(shape, dtype=torch.int8)
    )
    # Every slot's rows as one step's keys and values: [slots, kv_heads, head_dim] each.
    rows = cache.permute(0, 2, 3, 1, 4).reshape(2, num_blocks * block_size, kv_heads, head_dim)
    reshape_and_cache(rows[0], rows[1], copy, torch.arange(num_blocks * block_size))
    return copy


def every_layer(attend: Callable[[torch.Tensor], object], caches: list[torch.Tensor]) -> None:
    """One step's attention: the same batch against every layer's cache in turn."""
    for cache in caches:
        attend(cache)


def paged_decode_in_place(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> None:
    """Decodes through the kernel the AMX one replaced."""
    torch.ops.raypage.paged_decode_attention(
        out, query, kv_cache, meta.block_table, meta.seq_lens, params.scale
    )


def rows_as_sequences(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row as a one-token sequence of its own: ([num_tokens, max_blocks] block table,
    [num_tokens] lengths). Row r of sequence i attends to the tokens up to and including its own
    (context + r + 1), so the decode kernel run over these rows computes causal prefill attention."""
    query_lens = torch.tensor([meta.query_len(i) for i in range(meta.num_seqs)], dtype=torch.int64)
    seq_of_row = torch.repeat_interleave(torch.arange(meta.num_seqs), query_lens)
    starts = torch.tensor(meta.query_start_loc[:-1], dtype=torch.int64)
    row = torch.arange(meta.query_start_loc[-1], dtype=torch.int64)
    # A row's length: its sequence's context, then itself and the chunk's rows before it.
    lengths = (meta.seq_lens - query_lens)[seq_of_row] + row - starts[seq_of_row] + 1
    return meta.block_table.index_select(0, seq_of_row), lengths


def paged_decode_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> torch.Tensor:
    """A step through the decode kernel alone, every row a one-token sequence (what the tiled and AMX
    kernels replaced)."""
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    block_table, lengths = rows_as_sequences(meta)
    torch.ops.raypage.paged_decode_attention(out, query, kv_cache, block_table, lengths, params.scale)
    return out


def time_calls(
    calls: dict[str, Callable[[], None]], threads: int, rounds: int, layers: int
) -> dict[str, float]:
    """Median microseconds per layer of each call, over interleaved rounds: this machine's shared
    cores make single runs noisy."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            timer = benchmark.Timer("call()", globals={"call": call}, num_threads=threads)
            times[name].append(timer.blocked_autorange(min_run_time=0.3).median * 1e6 / layers)
    return {name: statistics.median(values) for name, values in times.items()}


def time_batch(specs: list[tuple[int, int]], prefill: bool, args: argparse.Namespace) -> dict[str, float]:
    """Median microseconds per layer of each backend on this batch (its caches freed on return)."""
    layers = args.layers if args.cold else 1
    # 11650: the blocks per layer the engine gives SmolLM2 in bf16 here, so that they lie as sparsely.
    num_blocks = args.num_blocks or (11650 if args.cold else 8192)
    query, caches, meta = paged_batch(specs, num_blocks, layers=layers, huge_pages=not args.small_pages)
    replaced = amx_serves(caches[0])
    if prefill:  # whole steps: the new keys and values stored first, then attended with the rest
        key, value = torch.randn(2, query.shape[0], KV_HEADS, HEAD_DIM).to(torch.bfloat16)
        backends = {
            "sdpa": sdpa_attention,
            "cpu_paged": cpu_paged_attention,
            "paged_decode": paged_decode_rows,
        }
        steps = {
            name: lambda cache, f=f: f(query, key, value, cache, meta, PARAMS) for name, f in backends.items()
        }
    else:
        out = torch.empty_like(query)
        backends = {"sdpa": decode_padded_runs, "cpu_paged": decode_in_place}
        if replaced:
            backends["paged_decode"] = paged_decode_in_place
        steps = {name: lambda cache, f=f: f(out, query, cache, meta, PARAMS) for name, f in backends.items()}
    calls = {name: lambda step=step: every_layer(step, caches) for name, step in steps.items()}
    if args.int8:
        int8_caches = [int8_copy(cache, huge_pages=not args.small_pages) for cache in caches]
        calls["cpu_paged int8"] = lambda: every_layer(steps["cpu_paged"], int8_caches)
    return time_calls(calls, args.threads, args.rounds, layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prefill", action="store_true", help="whole steps with prefill chunks, not decodes")
    parser.add_argument("--cold", action="store_true", help="one cache per layer, as in the engine")
    parser.add_argument("--layers", type=int, default=30, help="caches attended in turn with --cold")
    parser.add_argument("--num-blocks", type=int, default=None, help="blocks per cache (8192; 11650 cold)")
    parser.add_argument("--small-pages", action="store_true", help="4 KB pages, not huge pages")
    parser.add_argument("--int8", action="store_true", help="also over int8 copies of the caches")
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the C++ kernels could not be built here (see the log line above)")
    if args.prefill:
        batches = PREFILLS
    else:
        gen = torch.Generator().manual_seed(1)
        batches = {
            f"{n} x {low}-{high}": [(length - 1, 1) for length in sorted(lengths, reverse=True)]
            for n, low, high in ((64, 128, 256), (128, 16, 1024), *([(16, 2048, 4096)] if args.int8 else []))
            for lengths in [torch.randint(low, high + 1, (n,), generator=gen).tolist()]
        }
    for label, specs in batches.items():
        times = time_batch(specs, args.prefill, args)
        others = ", ".join(f"{name} {us:.0f} us" for name, us in times.items() if name != "sdpa")
        print(
            f"{label}: sdpa {times['sdpa']:.0f} us, {others} per layer "
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
