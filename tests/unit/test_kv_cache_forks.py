"""KVCacheManager's forks, copy-on-write and swapping, against block tables worked out by hand."""

from __future__ import annotations

from engine.sched.kv_cache_manager import KVCacheManager, SlotAllocation
from tests.unit.kv_cache_helpers import (
    BS,
    admit,
    cpu_refs,
    fork,
    free_ids,
    ids,
    make_seq,
    refs,
    write,
)

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
