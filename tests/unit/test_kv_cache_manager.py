"""KVCacheManager: block tables, prefix lookup, all-or-nothing allocation, tail-first free,
copy-on-write, forks and swapping.

The manager never moves `num_computed_tokens`; the scheduler does. These tests play the scheduler's
part by hand: allocate, then advance the sequence's computed count.
"""

from __future__ import annotations

import hashlib
from array import array

from engine.block_pool import SUMMARY_HASH_BYTES, chain_block_hashes
from engine.kv_cache_manager import KVCacheManager, SequenceWant, SlotAllocation, cdiv
from engine.request import Sequence
from tests.unit.scheduler_helpers import make_request

BS = 4  # block size used throughout


def make_seq(request_id: str, prompt) -> Sequence:
    """The first (only) sequence of a plain request."""
    return make_request(request_id, prompt).seqs[0]


def admit(kv: KVCacheManager, seq: Sequence, num_new: int | None = None):
    """What the scheduler does at admission: look up the prefix, allocate, mark tokens computed.

    Returns (hits, hit tokens, ids of the newly allocated blocks or None)."""
    hits, num_hit_tokens = kv.get_computed_blocks(seq)
    if num_new is None:
        num_new = seq.num_tokens - num_hit_tokens
    allocation = kv.allocate_slots(seq, num_new, hits)
    if allocation is None:
        return hits, num_hit_tokens, None
    # A sequence without blocks gets its whole table, hits first.
    assert allocation.table_start == 0 and allocation.copies == []
    assert allocation.block_ids[: len(hits)] == ids(hits)
    seq.num_computed_tokens = num_hit_tokens + num_new
    return hits, num_hit_tokens, allocation.block_ids[len(hits) :]


def grow(kv: KVCacheManager, seq: Sequence, num_new: int) -> list[int] | None:
    """Allocate for `num_new` more tokens; the ids of the new blocks (no copy-on-write expected)."""
    allocation = kv.allocate_slots(seq, num_new)
    if allocation is None:
        return None
    assert allocation.copies == [] and allocation.table_start == len(kv.block_ids(seq.seq_id)) - len(
        allocation.block_ids
    )
    seq.num_computed_tokens += num_new
    return allocation.block_ids


def write(kv: KVCacheManager, seq: Sequence, num_new: int) -> SlotAllocation | None:
    """Allocate and advance, returning the whole allocation (copies included)."""
    allocation = kv.allocate_slots(seq, num_new)
    if allocation is not None:
        seq.num_computed_tokens += num_new
    return allocation


def fork(kv: KVCacheManager, parent: Sequence, index: int) -> Sequence:
    child = parent.fork(index)
    parent.request.seqs.append(child)
    kv.fork(parent, child)
    return child


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def free_ids(kv: KVCacheManager) -> list[int]:
    return ids(kv.block_pool.free_queue)


def refs(kv: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in kv.block_pool.blocks]


def cpu_refs(kv: KVCacheManager) -> list[int]:
    assert kv.cpu_pool is not None
    return [block.ref_cnt for block in kv.cpu_pool.blocks]


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


# ---- forks and copy-on-write ----------------------------------------------------------------------


def test_fork_shares_every_block_and_the_first_writers_copy_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq("p", range(6))
    admit(kv, parent, num_new=5)  # the prompt but its last token: blocks 0 (full) and 1 (one token)
    first = fork(kv, parent, 1)
    second = fork(kv, parent, 2)
    assert (first.seq_id, second.seq_id) == ("p#1", "p#2")
    assert kv.block_ids("p#1") == kv.block_ids("p#2") == [0, 1]
    assert refs(kv)[:3] == [3, 3, 0] and kv.num_free_blocks == 6
    # Each writes position 5, into block 1: the block write needs a private copy while shared.
    assert kv.num_blocks_needed(first, 1) == 1
    allocation = write(kv, first, 1)
    assert allocation == SlotAllocation(table_start=1, block_ids=[2], copies=[(1, 2)])
    assert kv.block_ids("p#1") == [0, 2] and refs(kv)[:3] == [3, 2, 1]
    allocation = write(kv, second, 1)
    assert allocation == SlotAllocation(table_start=1, block_ids=[3], copies=[(1, 3)])
    # The last writer is the block's only holder: it writes in place, no copy, no new block.
    assert kv.num_blocks_needed(parent, 1) == 0
    allocation = write(kv, parent, 1)
    assert allocation == SlotAllocation(table_start=2, block_ids=[], copies=[])
    assert kv.block_ids("p") == [0, 1] and refs(kv)[:4] == [3, 1, 1, 1]
    assert kv.num_free_blocks == 4  # the prompt's full block once, then one block per sequence
    # Past the block boundary each sequence grows on its own.
    for seq, token in ((parent, 10), (first, 11), (second, 12)):
        seq.append_output_token(token)
        write(kv, seq, 1)
        seq.append_output_token(token)
        write(kv, seq, 1)  # position 7 fills block 1 (or its copy)
        seq.append_output_token(token)
        assert write(kv, seq, 1).copies == []  # position 8: a fresh block
    assert [len(kv.block_ids(s)) for s in ("p", "p#1", "p#2")] == [3, 3, 3]
    for seq in (parent, first, second):
        kv.free(seq)
        kv.forget(seq)
    assert refs(kv) == [0] * 8 and kv.num_free_blocks == 8


def test_fork_on_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq("p", range(9))
    admit(kv, parent, num_new=8)  # two full blocks
    child = fork(kv, parent, 1)
    assert kv.num_blocks_needed(parent, 1) == kv.num_blocks_needed(child, 1) == 1
    assert write(kv, parent, 1) == SlotAllocation(table_start=2, block_ids=[2], copies=[])
    assert write(kv, child, 1) == SlotAllocation(table_start=2, block_ids=[3], copies=[])
    assert kv.block_ids("p") == [0, 1, 2] and kv.block_ids("p#1") == [0, 1, 3]
    assert refs(kv)[:4] == [2, 2, 1, 1]


def test_copy_on_write_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    parent = make_seq("p", range(6))
    admit(kv, parent, num_new=5)
    child = fork(kv, parent, 1)
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots(child, 1) is None
    assert kv.block_ids("p#1") == [0, 1] and refs(kv) == [2, 2]


def test_copy_on_write_and_a_new_block_in_one_allocation():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq("p", range(7))
    admit(kv, parent, num_new=6)  # blocks 0 (full) and 1 (two tokens)
    child = fork(kv, parent, 1)
    for token in (20, 21, 22):
        child.append_output_token(token)
    # Positions 6..9 (a chunk after a recompute, say): copy block 1, then one new block.
    allocation = write(kv, child, 4)
    assert allocation == SlotAllocation(table_start=1, block_ids=[2, 3], copies=[(1, 2)])
    assert kv.block_ids("p#1") == [0, 2, 3] and kv.block_ids("p") == [0, 1]


def test_a_fork_keeps_the_parent_prefix_hashes_and_publishes_its_own_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq("p", range(6))
    admit(kv, parent, num_new=5)
    child = fork(kv, parent, 1)
    assert kv.seq_block_hashes["p#1"] == kv.seq_block_hashes["p"]
    for token in (50, 51, 52):
        child.append_output_token(token)
    write(kv, child, 3)  # positions 5..7: its copy of block 1 becomes full and is published
    probe = make_seq("probe", [*range(6), 50, 51, 9])
    assert ids(kv.get_computed_blocks(probe)[0]) == [0, *kv.block_ids("p#1")[1:2]]


# ---- swapping -------------------------------------------------------------------------------------


def forked_pair(kv: KVCacheManager):
    """p (6 tokens) and its fork p#1, each having written position 5: p#1 copied block 1 to 2."""
    parent = make_seq("p", range(6))
    admit(kv, parent, num_new=5)
    child = fork(kv, parent, 1)
    write(kv, child, 1)
    write(kv, parent, 1)
    return parent, child


def test_swap_out_and_in_keep_the_sharing_and_move_each_block_once():
    kv = KVCacheManager(num_blocks=6, block_size=BS, num_cpu_blocks=4)
    x = make_seq("x", range(100, 103))
    admit(kv, x)  # block 0
    parent, child = forked_pair(kv)  # p: [1, 2], p#1: [1, 3]
    assert kv.block_ids("p") == [1, 2] and kv.block_ids("p#1") == [1, 3]
    assert kv.can_swap_out([parent, child])  # 3 distinct blocks, 4 CPU blocks free
    assert kv.swap_out([parent, child]) == [(1, 0), (2, 1), (3, 2)]  # block 1 once, for both
    assert kv.block_ids("p") == [] and "p" not in kv.seq_block_tables
    assert ids(kv.swapped_blocks["p"]) == [0, 1] and ids(kv.swapped_blocks["p#1"]) == [0, 2]
    assert cpu_refs(kv) == [2, 1, 1, 0]
    # The device blocks are free at once (tail first); the full block 1 keeps its cached prefix.
    assert refs(kv) == [1, 0, 0, 0, 0, 0] and free_ids(kv) == [4, 5, 2, 3, 1]
    assert kv.block_pool.blocks[1].block_hash is not None
    assert kv.swap_out([x]) == [(0, 3)]
    assert cpu_refs(kv) == [2, 1, 1, 1] and kv.num_free_blocks == 6

    assert kv.can_swap_in([parent, child])
    assert kv.swap_in([parent, child]) == [(0, 4), (1, 5), (2, 2)]
    assert kv.block_ids("p") == [4, 5] and kv.block_ids("p#1") == [4, 2]
    assert refs(kv) == [0, 0, 1, 0, 2, 1] and cpu_refs(kv) == [0, 0, 0, 1]
    assert ids(kv.cpu_pool.free_queue) == [1, 2, 0]
    assert "p" not in kv.swapped_blocks and "p#1" not in kv.swapped_blocks
    # Freeing a swapped-out sequence returns its CPU blocks.
    kv.free(x)
    assert cpu_refs(kv) == [0, 0, 0, 0] and "x" not in kv.swapped_blocks


def test_swap_space_checks_count_shared_blocks_once():
    kv = KVCacheManager(num_blocks=6, block_size=BS, num_cpu_blocks=3)
    parent, child = forked_pair(kv)  # p: [0, 1], p#1: [0, 2]: three distinct blocks
    assert kv.can_swap_out([parent, child])
    kv.cpu_pool.get_new_blocks(1)  # someone else takes a CPU block
    assert not kv.can_swap_out([parent, child]) and kv.can_swap_out([parent])
    no_cpu = KVCacheManager(num_blocks=6, block_size=BS)
    lone = make_seq("lone", range(3))
    admit(no_cpu, lone)
    assert not no_cpu.can_swap_out([lone])  # no swap space at all


def test_swap_in_needs_room_for_every_distinct_block():
    kv = KVCacheManager(num_blocks=3, block_size=BS, num_cpu_blocks=4)
    parent, child = forked_pair(kv)  # three device blocks: all of them
    kv.swap_out([parent, child])
    filler = make_seq("filler", range(50, 55))
    admit(kv, filler)  # two device blocks
    assert not kv.can_swap_in([parent, child])
    kv.free(filler)
    assert kv.can_swap_in([parent, child])


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
