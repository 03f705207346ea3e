"""BlockPool, its intrusive LRU free queue and the chain hash: pure data structures, no model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sched.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


# ---- hash_block_tokens ----------------------------------------------------------------------------


def test_hash_is_deterministic_and_16_bytes():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == 16


def test_hash_depends_on_tokens_order_parent_and_extra_key():
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != root
    assert hash_block_tokens(None, [4, 3, 2, 1]) != root
    assert hash_block_tokens(None, [1, 2, 3, 4], b"salt") != root
    other_root = hash_block_tokens(None, [9, 9, 9, 9])
    # The same block tokens under different parents are different prefixes.
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(other_root, [5, 6, 7, 8])
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])


def test_hash_handles_large_token_ids():
    # Vocabularies beyond 2**31 must not overflow or collide with small ids.
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


# ---- KVCacheBlock and FreeBlockQueue --------------------------------------------------------------


def test_new_block_is_unreferenced_and_uncached():
    block = KVCacheBlock(7)
    assert (block.block_id, block.ref_cnt, block.block_hash) == (7, 0, None)
    assert block.prev_free is None and block.next_free is None
    assert "id=7" in repr(block)


def test_free_queue_keeps_insertion_order_and_pops_from_the_head():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert queue.num_free_blocks == 4
    assert ids(queue) == [0, 1, 2, 3]
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    assert ids(queue) == [2, 3] and queue.num_free_blocks == 2


def test_free_queue_removes_from_the_middle_and_appends_to_the_tail():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and queue.num_free_blocks == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[4])  # the tail
    assert ids(queue) == [1, 3]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert ids(queue) == [1, 3, 2, 0] and queue.num_free_blocks == 4


def test_free_queue_empty_pop_and_bad_remove_raise():
    block = KVCacheBlock(0)
    queue = FreeBlockQueue([block])
    assert queue.popleft() is block
    assert list(queue) == [] and queue.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(block)  # no longer in the queue
    assert queue.num_free_blocks == 0
    queue.append(block)
    assert ids(queue) == [0]


# ---- BlockPool ------------------------------------------------------------------------------------


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockPool(0, enable_caching=True)


def test_new_blocks_come_in_id_order_with_one_reference():
    pool = BlockPool(4, enable_caching=True)
    assert pool.num_free_blocks == 4 and pool.usage() == 0.0
    taken = pool.get_new_blocks(3)
    assert ids(taken) == [0, 1, 2]
    assert [b.ref_cnt for b in taken] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.usage() == 0.75
    assert ids(pool.get_new_blocks(0)) == []


def test_asking_for_too_many_blocks_raises_and_takes_nothing():
    pool = BlockPool(3, enable_caching=True)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert ids(pool.free_queue) == [2]


def test_freed_blocks_are_reused_oldest_first():
    pool = BlockPool(4, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c])
    pool.free_blocks([a, d])
    assert ids(pool.free_queue) == [2, 0, 3]
    assert ids(pool.get_new_blocks(2)) == [2, 0]
    pool.free_blocks([b])
    assert ids(pool.get_new_blocks(2)) == [3, 1]


def test_reference_counts_and_double_free():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second holder
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1  # still held: not free
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])
    # The failed free leaves the pool as it was: the block is still free, once, with no reference.
    assert block.ref_cnt == 0 and ids(pool.free_queue) == [1, 0] and pool.num_free_blocks == 2
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 0]
    assert block.ref_cnt == 1


def test_cached_block_keeps_its_hash_when_freed_and_can_be_taken_back():
    pool = BlockPool(3, enable_caching=True)
    a, b, _ = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    assert pool.get_cached_block(h) is a and a.block_hash == h
    pool.free_blocks([b, a])
    # Free, but still findable: the hash is dropped only when the block is reused.
    assert pool.get_cached_block(h) is a
    assert ids(pool.free_queue) == [1, 0]
    pool.touch([a])  # a prefix hit takes it out of the middle of the queue
    assert a.ref_cnt == 1 and ids(pool.free_queue) == [1]
    assert pool.get_cached_block(h) is a


def test_reusing_a_cached_block_evicts_its_hash():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    ha, hb = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free_blocks([a, b])
    (reused,) = pool.get_new_blocks(1)
    assert reused is a and a.block_hash is None
    assert pool.get_cached_block(ha) is None
    assert pool.get_cached_block(hb) is b  # untouched
    assert set(pool.cached_blocks) == {hb}


def test_first_block_published_under_a_hash_keeps_it():
    pool = BlockPool(3, enable_caching=True)
    a, b, _ = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    pool.cache_block(b, h)  # same content computed twice: the copy stays private
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.cache_block(a, hash_block_tokens(None, [3, 4]))  # a block keeps its first hash
    assert a.block_hash == h and len(pool.cached_blocks) == 1


def test_evicting_a_private_copy_keeps_the_published_block():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [5])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    pool.free_blocks([b, a])
    assert pool.get_new_blocks(1)[0] is b
    assert pool.get_cached_block(h) is a


def test_caching_disabled_publishes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, hash_block_tokens(None, [1]))
    assert a.block_hash is None and pool.cached_blocks == {}


def test_uncached_pool_shares_blocks_by_reference_as_the_swap_pool_does():
    # The CPU pool for swapped-out blocks: no hashes, sharing by reference counts, tail-first frees.
    pool = BlockPool(4, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a block two swapped sequences share
    assert [blk.ref_cnt for blk in pool.blocks] == [2, 1, 0, 0] and pool.num_free_blocks == 2
    pool.free_blocks(reversed([a, b]))  # one sequence's table, tail first
    assert ids(pool.free_queue) == [2, 3, 1] and a.ref_cnt == 1
    pool.free_blocks(reversed([a]))
    assert ids(pool.free_queue) == [2, 3, 1, 0] and pool.usage() == 0.0
    assert pool.cached_blocks == {} and all(blk.block_hash is None for blk in pool.blocks)


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, hash_block_tokens(None, [1]))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_blocks) == 1
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and a.block_hash is None
    assert pool.num_free_blocks == 2


# ---- randomized: the pool against a plain-list model of the LRU queue -----------------------------


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(1, 8), ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 99)), max_size=60)
)
def test_pool_matches_a_list_model(num_blocks, ops):
    pool = BlockPool(num_blocks, enable_caching=True)
    model_free = list(range(num_blocks))  # LRU order, head first
    model_ref = [0] * num_blocks
    model_hash: dict[int, bytes] = {}  # block id -> hash it is published under
    held: list[int] = []  # one entry per reference taken
    serial = 0
    for op, arg in ops:
        if op == 0:  # allocate
            count = arg % (num_blocks + 1)
            if count > len(model_free):
                with pytest.raises(RuntimeError):
                    pool.get_new_blocks(count)
                continue
            got = ids(pool.get_new_blocks(count))
            assert got == model_free[:count]
            del model_free[:count]
            for block_id in got:
                model_ref[block_id] = 1
                model_hash.pop(block_id, None)
            held.extend(got)
        elif op == 1 and held:  # free one reference
            block_id = held.pop(arg % len(held))
            pool.free_blocks([pool.blocks[block_id]])
            model_ref[block_id] -= 1
            if model_ref[block_id] == 0:
                model_free.append(block_id)
        elif op == 2 and held:  # publish a held block under a fresh hash
            block_id = held[arg % len(held)]
            serial += 1
            pool.cache_block(pool.blocks[block_id], serial.to_bytes(16, "big"))
            model_hash.setdefault(block_id, serial.to_bytes(16, "big"))
        elif op == 3 and model_hash:  # prefix hit on a published block
            block_id = sorted(model_hash)[arg % len(model_hash)]
            block = pool.get_cached_block(model_hash[block_id])
            assert block is pool.blocks[block_id]
            pool.touch([block])
            if model_ref[block_id] == 0:
                model_free.remove(block_id)
            model_ref[block_id] += 1
            held.append(block_id)
        assert ids(pool.free_queue) == model_free
        assert pool.num_free_blocks == len(model_free)
        assert [b.ref_cnt for b in pool.blocks] == model_ref
        assert {h: b.block_id for h, b in pool.cached_blocks.items()} == {
            h: block_id for block_id, h in model_hash.items()
        }
