"""Helpers for the KVCacheManager tests: each plays the scheduler's part (allocate, then advance the
sequence's computed count) or reads the pools' state."""

from __future__ import annotations

from engine.sched.kv_cache_manager import KVCacheManager, SlotAllocation
from engine.sched.request import Sequence
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
