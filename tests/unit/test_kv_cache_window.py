"""Sliding windows in the KV cache manager and the scheduler (block size 4, a window of 6 tokens: a
query at position p sees p - 5 .. p). Blocks wholly before the window of a sequence's next token go
back to the pool as it grows and their places in its table become the null block; prefix caching,
chunked prefill, forks, swapping and recompute keep working. The fake worker checks that every
position inside each query's window holds the sequence's own KV, the invariants that freed places
lie before the window and that every count is exact."""

from __future__ import annotations

import pytest

from engine.sched.kv_cache_manager import KVCacheManager, freeing_window
from tests.unit.kv_cache_helpers import BS, admit, grow, make_seq
from tests.unit.scheduler_helpers import (
    collect,
    make_beam_request,
    make_request,
    run_until_done,
    scheduler_and_worker,
    step,
)
from tests.unit.scheduler_invariants import assert_all_free, held_blocks

WINDOW = 6


def test_the_freeing_window_is_the_widest_when_every_layer_slides():
    assert freeing_window((8, 8)) == 8
    assert freeing_window((4, 16, 4)) == 16  # (Gemma 3 style: local layers of different windows)
    assert freeing_window((4, None)) is None  # a full-attention layer reads every block
    assert freeing_window(()) is None


def test_blocks_before_the_window_return_to_the_pool_as_a_sequence_grows():
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=WINDOW)
    seq = make_seq("a", range(10))
    admit(kv, seq)
    returned = []
    # One token at a time to 60 tokens, far past the pool's 32 slots: only the window is held.
    while seq.num_computed_tokens < 60:
        free_before = kv.num_free_blocks
        kv.free_blocks_outside_window(seq)
        returned.append(kv.num_free_blocks - free_before)
        first_visible = seq.num_computed_tokens - WINDOW + 1  # of the token about to be computed
        table = kv.seq_block_tables["a"]
        assert all(
            (block is kv.null_block) == (index < first_visible // BS) for index, block in enumerate(table)
        )
        assert grow(kv, seq, 1) is not None
        held = [block for block in kv.seq_block_tables["a"] if block is not kv.null_block]
        assert len(held) <= 3 and kv.num_free_blocks == 8 - len(held)
    # A block goes each time the window's start crosses a block boundary: 2 blocks at 10 tokens,
    # then one every 4 tokens.
    assert returned[0] == 1 and sum(returned) == (60 - WINDOW + 1) // BS
    assert [i for i, n in enumerate(returned) if n] == [0, *range(3, 50, BS)]
    kv.free(seq)
    assert kv.num_free_blocks == 8 and all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


def test_without_a_window_nothing_is_freed_early():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    seq = make_seq("a", range(30))
    admit(kv, seq)
    kv.free_blocks_outside_window(seq)
    assert kv.num_free_blocks == 0


def generate(window: int | None, requests, **settings) -> tuple[dict, list[int], object]:
    """Run `requests` (made anew each call) to the end; the tokens, the blocks held after each
    step, and the scheduler."""
    scheduler, worker = scheduler_and_worker(sliding_window=window, **settings)
    for request in requests():
        scheduler.add_request(request)
    tokens: dict[str, list[int]] = {}
    held = []
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler, worker)
        collect(outputs, tokens, {})
        held.append(scheduler.kv_cache_manager.num_blocks - scheduler.kv_cache_manager.num_free_blocks)
    assert_all_free(scheduler)
    return tokens, held, scheduler


def test_a_long_chunked_prompt_holds_only_its_window():
    def requests():
        return [make_request("a", range(30), max_tokens=12, ignore_eos=True)]

    settings = dict(num_blocks=32, max_num_batched_tokens=8)
    tokens, held, _ = generate(WINDOW, requests, **settings)
    full_tokens, full_held, _ = generate(None, requests, **settings)
    assert tokens == full_tokens
    # The window's blocks and a chunk's, where without a window the sequence keeps all it wrote.
    assert max(held) <= 5 and max(full_held) == 10


def test_prefix_hits_reach_blocks_freed_outside_a_window_while_they_stay_cached():
    # b arrives after a has freed its head blocks (still cached in the free queue): b's lookup hits
    # them; c arrives after the small pool reused some, and hits only the chain still cached.
    scheduler, worker = scheduler_and_worker(num_blocks=12, max_num_batched_tokens=8, sliding_window=WINDOW)
    prefix = list(range(100, 124))
    scheduler.add_request(make_request("a", [*prefix, 1, 2, 3], max_tokens=6, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    for _ in range(5):
        _, outputs = step(scheduler, worker)
        collect(outputs, tokens, {})
    assert held_blocks(scheduler)["a"][:2] == [None, None]  # a's first blocks are freed ...
    hits_before = scheduler.prefix_cache_hits
    scheduler.add_request(make_request("b", [*prefix, 7], max_tokens=6, ignore_eos=True))
    _, outputs = step(scheduler, worker)
    collect(outputs, tokens, {})
    assert scheduler.prefix_cache_hits - hits_before == len(prefix)  # ... and b takes them back
    scheduler.add_request(make_request("c", [*prefix, 9, 9], max_tokens=4, ignore_eos=True))
    rest, _ = run_until_done(scheduler, worker)
    assert len(rest["c"]) == 4 and len(tokens["b"] + rest["b"]) == 6
    assert_all_free(scheduler)


@pytest.mark.parametrize("preemption_mode", [None, "swap"], ids=["recompute-singles", "swap-all"])
def test_forks_swapping_and_recompute_keep_their_outputs(preemption_mode):
    # Beams and n = 2 (forks sharing blocks, swapped out under pressure) after single sequences
    # (recomputed, or swapped too), all sliding past freed blocks when preempted: the tokens of a
    # roomy cache without a window, every block back at the end.
    def requests():
        return [
            make_request("one", range(200, 226), max_tokens=16, ignore_eos=True, arrival_time=0),
            make_request("two", range(300, 318), max_tokens=12, ignore_eos=True, arrival_time=1),
            make_beam_request(
                "beam", range(50, 66), beam_width=2, max_tokens=8, ignore_eos=True, arrival_time=2
            ),
            make_request("n2", range(30), max_tokens=16, n=2, ignore_eos=True, seed=1, arrival_time=3),
        ]

    expected, _, _ = generate(None, requests, num_blocks=200, max_num_batched_tokens=12)
    tokens, _, scheduler = generate(
        WINDOW,
        requests,
        num_blocks=12,
        num_cpu_blocks=16,
        max_num_batched_tokens=12,
        preemption_mode=preemption_mode,
    )
    assert tokens == expected
    assert scheduler.num_preemptions > 0


def test_sequences_longer_than_the_whole_cache_slide_through_it():
    # Six blocks of 4 hold a window and a chunk of 8 (window_blocks: 5), so 30 prompt tokens and 20
    # new ones (50 > 24 slots) run to the end. The conversation's next turn (its 50 tokens and 6
    # more) hits the last cached blocks inside its window, with null blocks before them, though the
    # head of the conversation was evicted long ago; both give a roomy cache's tokens.
    def first_turn():
        return [make_request("a", range(30), max_tokens=20, ignore_eos=True)]

    expected, _, _ = generate(None, first_turn, num_blocks=64, max_num_batched_tokens=8)
    scheduler, worker = scheduler_and_worker(num_blocks=6, max_num_batched_tokens=8, sliding_window=WINDOW)
    assert scheduler.max_seq_len == scheduler.max_model_len
    scheduler.add_request(first_turn()[0])
    tokens, _ = run_until_done(scheduler, worker)
    assert tokens == expected

    def next_turn():
        return [
            make_request("b", [*range(30), *tokens["a"], 5, 6, 7, 8, 9, 10], max_tokens=8, ignore_eos=True)
        ]

    expected, _, _ = generate(None, next_turn, num_blocks=64, max_num_batched_tokens=8)
    scheduler.add_request(next_turn()[0])
    tokens = {}
    _, outputs = step(scheduler, worker)
    collect(outputs, tokens, {})
    # The first turn wrote 49 tokens: 12 whole blocks, of which the last two are cached and visible.
    assert scheduler.prefix_cache_hits == 48
    table = held_blocks(scheduler)["b"]
    assert table[:10] == [None] * 10 and None not in table[10:]
    rest, _ = run_until_done(scheduler, worker)
    assert tokens["b"] + rest["b"] == expected["b"]
    assert_all_free(scheduler)
