"""KVCacheManager: block tables, prefix lookup, all-or-nothing allocation, tail-first free,
copy-on-write, forks and swapping.

The manager never moves `num_computed_tokens`; the scheduler does. These tests play the scheduler's
part by hand: allocate, then advance the sequence's computed count.
"""

from __future__ import annotations

import hashlib
from array import array

from engine.sched.block_pool import SUMMARY_HASH_BYTES, chain_block_hashes
from engine.sched.kv_cache_manager import KVCacheManager, SequenceWant, SlotAllocation, cdiv
from tests.unit.kv_cache_helpers import (
    BS,
    admit,
    fork,
    free_ids,
    grow,
    ids,
    make_seq,
    refs,
    write,
)
from tests.unit.scheduler_helpers import make_request


def test_cdiv():
    assert [cdiv(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


# ---- allocation and freeing -----------------------------------------------------------------------


def test_allocate_prompt_takes_ceil_blocks_in_lru_order():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_seq("a", range(10))
    _, _, new_blocks = admit(kv, request)
    assert new_blocks == [0, 1, 2]  # ceil(10 / 4) blocks, the oldest free ones
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    assert kv.usage() == 3 / 8


def test_allocation_grows_only_when_a_block_boundary_is_crossed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_seq("a", range(5))
    assert grow(kv, request, 3) == [0]  # tokens 0..2
    assert grow(kv, request, 1) == []  # token 3 still fits block 0
    assert grow(kv, request, 1) == [1]  # token 4 opens block 1
    request.append_output_token(99)
    assert grow(kv, request, 1) == []  # token 5 in block 1
    assert kv.block_ids("a") == [0, 1]
    assert kv.num_free_blocks == 6


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    big = make_seq("big", range(13))  # needs 4 blocks
    assert admit(kv, big)[2] is None
    assert kv.num_free_blocks == 3 and kv.block_ids("big") == []
    assert "big" not in kv.seq_block_tables
    assert refs(kv) == [0, 0, 0] and free_ids(kv) == [0, 1, 2]


def test_growth_that_does_not_fit_keeps_the_existing_table():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_seq("a", range(8))
    b = make_seq("b", range(100, 104))
    admit(kv, a)
    admit(kv, b)
    assert kv.num_free_blocks == 0
    a.append_output_token(7)
    assert grow(kv, a, 1) is None
    assert kv.block_ids("a") == [0, 1] and a.num_computed_tokens == 8
    assert refs(kv) == [1, 1, 1]


def test_allocation_that_exactly_fits_takes_the_last_block():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    request = make_seq("a", range(12))
    assert admit(kv, request)[2] == [0, 1, 2]
    assert kv.num_free_blocks == 0


def test_free_returns_every_block_tail_first():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_seq("a", range(12))
    admit(kv, a)  # blocks 0, 1, 2; free queue [3, 4]
    kv.free(a)
    assert kv.num_free_blocks == 5 and refs(kv) == [0] * 5
    assert free_ids(kv) == [3, 4, 2, 1, 0]
    assert kv.block_ids("a") == []
    kv.free(a)  # freeing twice is harmless
    assert kv.num_free_blocks == 5 and refs(kv) == [0] * 5


def test_freed_prefix_is_evicted_tail_first_so_its_head_survives_longest():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq("a", range(12))  # three full blocks, all cached
    admit(kv, a)
    kv.free(a)  # free queue [3, 2, 1, 0]
    filler = make_seq("filler", range(500, 508))
    assert admit(kv, filler)[2] == [3, 2]  # the never-used block, then a's tail
    again = make_seq("again", range(13))
    hits, num_hit_tokens = kv.get_computed_blocks(again)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8  # the head of a's prefix is still there


# ---- prefix cache ---------------------------------------------------------------------------------


def test_only_full_blocks_are_cached_and_a_block_is_cached_once_it_fills():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq("a", range(10))
    admit(kv, a)
    blocks = kv.seq_block_tables["a"]
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    a.append_output_token(10)
    grow(kv, a, 1)  # token 10: block 2 holds 3 tokens
    assert blocks[2].block_hash is None
    a.append_output_token(11)
    grow(kv, a, 1)  # token 11 fills block 2
    assert blocks[2].block_hash is not None
    probe = make_seq("probe", [*range(12), 55])
    assert ids(kv.get_computed_blocks(probe)[0]) == [0, 1, 2]


def test_a_chunk_does_not_cache_blocks_past_the_known_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq("a", range(6))
    grow(kv, a, 4)  # first chunk: block 0 full
    blocks = kv.seq_block_tables["a"]
    assert blocks[0].block_hash is not None
    grow(kv, a, 2)
    assert len(blocks) == 2 and blocks[1].block_hash is None


def test_second_request_with_the_same_prefix_shares_physical_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq("a", [*range(8), 50, 51])
    admit(kv, a)  # blocks 0, 1 full and cached; block 2 partial
    b = make_seq("b", [*range(8), 60, 61, 62])
    hits, num_hit_tokens, new_blocks = admit(kv, b)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8
    assert new_blocks == [3]  # only the unshared tail is allocated
    assert kv.block_ids("b") == [0, 1, 3]
    assert refs(kv)[:4] == [2, 2, 1, 1]
    assert kv.num_free_blocks == 4
    kv.free(a)
    assert refs(kv)[:4] == [1, 1, 0, 1]
    assert free_ids(kv) == [4, 5, 6, 7, 2]  # shared blocks stay out of the free queue
    kv.free(b)
    assert refs(kv) == [0] * 8
    assert free_ids(kv) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_the_last_token_is_never_a_hit():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq("a", range(8))
    admit(kv, a)
    same = make_seq("same", range(8))
    hits, num_hit_tokens = kv.get_computed_blocks(same)
    # Both blocks are cached, but the last token must be computed to get its logits.
    assert ids(hits) == [0] and num_hit_tokens == 4
    _, _, new_blocks = admit(kv, same)
    # The recomputed last block duplicates a's: it stays private, the published one is a's.
    assert len(new_blocks) == 1 and kv.block_pool.blocks[new_blocks[0]].block_hash is None
    assert ids(kv.get_computed_blocks(make_seq("x", range(9)))[0]) == [0, 1]
    one_block = make_seq("one", range(4))
    assert kv.get_computed_blocks(one_block) == ([], 0)


def test_lookup_stops_at_the_first_miss():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_seq("a", range(12)))
    probe = make_seq("probe", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    hits, num_hit_tokens = kv.get_computed_blocks(probe)
    # Block 2 has a's tokens but a different parent: a chain hash does not match it.
    assert ids(hits) == [0] and num_hit_tokens == 4


def test_get_computed_blocks_does_not_mutate_the_pool():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq("a", range(12))
    admit(kv, a)
    kv.free(a)
    before = (free_ids(kv), refs(kv), dict(kv.block_pool.cached_blocks))
    probe = make_seq("probe", range(13))
    first = kv.get_computed_blocks(probe)
    second = kv.get_computed_blocks(probe)
    assert ids(first[0]) == ids(second[0]) == [0, 1, 2] and first[1] == second[1] == 12
    assert (free_ids(kv), refs(kv), dict(kv.block_pool.cached_blocks)) == before
    assert kv.block_ids("probe") == []


def test_hits_on_free_blocks_leave_the_free_queue_when_taken():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq("a", range(12))
    admit(kv, a)
    kv.free(a)  # free queue [3, 2, 1, 0], blocks 0..2 cached
    b = make_seq("b", [*range(12), 40, 41, 42])  # 15 tokens: 3 hits + 1 new block
    hits, num_hit_tokens, new_blocks = admit(kv, b)
    assert ids(hits) == [0, 1, 2] and num_hit_tokens == 12
    assert new_blocks == [3]
    assert kv.num_free_blocks == 0 and refs(kv) == [1, 1, 1, 1]


def test_hits_sitting_in_the_free_queue_do_not_count_as_room():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_seq("a", range(12))
    admit(kv, a)
    kv.free(a)  # free queue [3, 4, 2, 1, 0]; blocks 0..2 cached
    c = make_seq("c", range(300, 302))
    assert admit(kv, c)[2] == [3]
    # 4 free blocks, 3 of them are b's hits: b needs 2 more blocks but only 1 is really left.
    b = make_seq("b", [*range(12), 40, 41, 42, 43, 44, 45, 46, 47])  # 20 tokens = 5 blocks
    hits, num_hit_tokens, new_blocks = admit(kv, b)
    assert ids(hits) == [0, 1, 2] and num_hit_tokens == 12
    assert new_blocks is None
    assert kv.num_free_blocks == 4 and free_ids(kv) == [4, 2, 1, 0]
    assert refs(kv) == [0, 0, 0, 1, 0]
    assert kv.block_ids("b") == []
    # 16 tokens need 4 blocks, 3 of them hits: the one block really left is enough.
    fits = make_seq("fits", [*range(12), 40, 41, 42, 43])
    hits, num_hit_tokens, new_blocks = admit(kv, fits)
    assert ids(hits) == [0, 1, 2] and num_hit_tokens == 12
    assert new_blocks == [4]
    assert kv.num_free_blocks == 0 and refs(kv) == [1, 1, 1, 1, 1]


def test_preempted_request_finds_its_own_blocks_again():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq("a", range(6))
    admit(kv, a)
    # Three decode steps: each sampled token is computed by the next step.
    a.append_output_token(6)
    grow(kv, a, 1)
    a.append_output_token(7)
    grow(kv, a, 1)
    a.append_output_token(8)
    assert a.num_computed_tokens == 8 and a.num_tokens == 9
    kv.free(a)  # preemption: free the blocks, keep the request (and its hashes)
    a.num_computed_tokens = 0
    hits, num_hit_tokens, new_blocks = admit(kv, a)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8  # prompt and outputs alike
    assert len(new_blocks) == 1
    assert a.num_computed_tokens == 9


def test_prefix_caching_disabled_never_hits_or_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_seq("a", range(12))
    admit(kv, a)
    assert kv.get_computed_blocks(make_seq("b", range(13))) == ([], 0)
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.block_pool.cached_blocks == {}


def test_forget_drops_the_request_hashes():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq("a", range(8))
    admit(kv, a)
    assert "a" in kv.seq_block_hashes
    kv.free(a)
    kv.forget(a)
    assert "a" not in kv.seq_block_hashes and "a" not in kv.seq_block_tables
    assert "a" not in kv.num_cached_blocks


def test_block_size_one_shares_every_token_but_the_last():
    kv = KVCacheManager(num_blocks=10, block_size=1)
    admit(kv, make_seq("a", [5, 6, 7, 8]))
    b = make_seq("b", [5, 6, 7, 8, 9])
    hits, num_hit_tokens, new_blocks = admit(kv, b)
    assert ids(hits) == [0, 1, 2, 3] and num_hit_tokens == 4
    assert new_blocks == [4]


# ---- num_blocks_needed ----------------------------------------------------------------------------


def test_num_blocks_needed_is_pure_and_matches_what_allocation_takes():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq("a", range(12))
    admit(kv, a)
    kv.free(a)  # free queue [3, 4, 5, 2, 1, 0]; blocks 0..2 cached
    b = make_seq("b", [*range(8), 70, 71, 72])  # 11 tokens: hits 0 and 1, then one new block
    hits, _ = kv.get_computed_blocks(b)
    before = (free_ids(kv), refs(kv))
    # One new block, and two hits that nobody holds (taking them shrinks the free queue).
    assert kv.num_blocks_needed(b, 3, hits) == kv.num_blocks_needed(b, 3, hits) == 3
    assert (free_ids(kv), refs(kv)) == before and kv.block_ids("b") == []
    kv.allocate_slots(b, 3, hits)
    assert kv.num_free_blocks == 6 - 3
    c = make_seq("c", [*range(8), 80])  # the same two hits, now held by b: only the new block counts
    hits, _ = kv.get_computed_blocks(c)
    assert ids(hits) == [0, 1] and kv.num_blocks_needed(c, 1, hits) == 1


# ---- the sequences of one request together --------------------------------------------------------


def test_group_allocation_lets_the_last_writer_of_a_shared_block_keep_it():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    parent = make_seq("p", range(6))
    admit(kv, parent, num_new=5)  # blocks 0 (full) and 1 (one token)
    child = fork(kv, parent, 1)
    wants = [SequenceWant(parent, 1, [], 0), SequenceWant(child, 1, [], 0)]
    # Alone, each would copy block 1; together the second writer finds itself its only holder.
    assert kv.num_blocks_needed(parent, 1) + kv.num_blocks_needed(child, 1) == 2
    assert kv.num_blocks_needed_by_group(wants) == 1
    allocations = kv.allocate_group(wants)
    assert allocations == [
        SlotAllocation(table_start=1, block_ids=[2], copies=[(1, 2)]),
        SlotAllocation(table_start=2, block_ids=[], copies=[]),
    ]
    assert kv.num_free_blocks == 4 - 3 and refs(kv) == [2, 1, 1, 0]


def test_group_allocation_counts_a_prefix_hit_of_several_sequences_once():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    cached = make_seq("c", range(9))
    admit(kv, cached)
    kv.free(cached)  # free queue [3, 2, 1, 0]; blocks 0 and 1 hold a cached prefix nobody holds
    request = make_request("r", range(9), n=2)
    first = request.seqs[0]
    second = first.fork(1)
    request.seqs.append(second)
    hits, num_hit_tokens = kv.get_computed_blocks(first)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8
    wants = [SequenceWant(first, 1, hits, 8), SequenceWant(second, 1, hits, 8)]
    # Each takes the two hits and one new block; the hits leave the free queue once.
    assert kv.num_blocks_needed(first, 1, hits) == kv.num_blocks_needed(second, 1, hits) == 3
    assert kv.num_blocks_needed_by_group(wants) == 4
    allocations = kv.allocate_group(wants)
    assert allocations is not None and [a.block_ids for a in allocations] == [[0, 1, 3], [0, 1, 2]]
    assert refs(kv) == [2, 2, 1, 1] and kv.num_free_blocks == 0


def test_group_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    parent = make_seq("p", range(9))
    admit(kv, parent, num_new=8)  # two full blocks
    child = fork(kv, parent, 1)
    before = (free_ids(kv), refs(kv))
    wants = [SequenceWant(parent, 1, [], 0), SequenceWant(child, 1, [], 0)]
    assert kv.num_blocks_needed_by_group(wants) == 2
    assert kv.allocate_group(wants) is None
    assert (free_ids(kv), refs(kv)) == before and kv.block_ids("p#1") == [0, 1]


def test_logical_blocks_count_a_shared_block_once_per_table():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq("p", range(9))
    admit(kv, parent, num_new=8)
    child = fork(kv, parent, 1)
    write(kv, child, 1)
    assert kv.num_logical_blocks([parent]) == 2
    assert kv.num_logical_blocks([parent, child]) == 2 + 3
    assert kv.num_blocks - kv.num_free_blocks == 3


def test_reset_prefix_cache_only_once_no_sequence_holds_a_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    seq = make_seq("a", range(9))
    admit(kv, seq)
    assert kv.reset_prefix_cache() is False
    assert ids(kv.get_computed_blocks(make_seq("b", range(9)))[0]) == [0, 1]  # nothing forgotten
    kv.free(seq)
    kv.forget(seq)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_seq("c", range(9))) == ([], 0)


def test_the_prefix_cache_summary_holds_the_chain_hashes_a_router_computes() -> None:
    """A Serve router hashes a prompt with `chain_block_hashes` and looks for the first 8 bytes of
    each hash in a replica's summary; both must agree with blake2b over (parent hash, the block's
    int64 token ids), computed here on its own."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # two full blocks and a partial one
    seq = make_seq("r", prompt)
    admit(kv, seq)
    kv.free(seq)
    parent = b"\0" * 16
    expected = []
    for start in (0, 4):
        parent = hashlib.blake2b(
            parent + array("q", prompt[start : start + 4]).tobytes(), digest_size=16
        ).digest()
        expected.append(parent)
    assert chain_block_hashes(prompt, BS) == expected
    assert kv.prefix_cache_summary() == b"".join(block_hash[:SUMMARY_HASH_BYTES] for block_hash in expected)
