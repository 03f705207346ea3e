"""The scheduler's invariants, one named predicate each, so that a failing test says which rule broke.

`check_invariants` runs them all after a step; `assert_all_free` checks that a finished workload
left every block free.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass

from engine.sched.block_pool import BlockPool, KVCacheBlock
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.request import Request, RequestStatus, Sequence
from engine.sched.scheduler import Scheduler


def held_blocks(scheduler: Scheduler) -> dict[str, list[int | None]]:
    """Device block ids each sequence holds (sequences holding none left out), None where a block
    was freed outside the sliding window."""
    kv = scheduler.kv_cache_manager
    return {seq_id: _ids(kv, blocks) for seq_id, blocks in kv.seq_block_tables.items() if blocks}


def swapped_blocks(scheduler: Scheduler) -> dict[str, list[int | None]]:
    """CPU block ids each swapped-out sequence holds (None as in `held_blocks`)."""
    kv = scheduler.kv_cache_manager
    return {seq_id: _ids(kv, blocks) for seq_id, blocks in kv.swapped_blocks.items() if blocks}


def _ids(kv: KVCacheManager, blocks: list[KVCacheBlock]) -> list[int | None]:
    return [None if block is kv.null_block else block.block_id for block in blocks]


def _without_freed(
    kv: KVCacheManager, tables: dict[str, list[KVCacheBlock]]
) -> dict[str, list[KVCacheBlock]]:
    """The tables' pool blocks: the places freed outside the sliding window left out."""
    return {seq_id: [b for b in blocks if b is not kv.null_block] for seq_id, blocks in tables.items()}


# ---- invariants: each rule a named predicate, so that a failure says which rule broke ----------


def assert_ref_counts_match_holders(
    pool: BlockPool, tables: dict[str, list[KVCacheBlock]], name: str
) -> None:
    """Every block's reference count is the number of block tables holding it, each at most once."""
    holders: Counter[int] = Counter()
    for seq_id, blocks in tables.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{seq_id} holds a {name} block twice: {ids}"
        assert all(pool.blocks[b.block_id] is b for b in blocks), f"{seq_id} holds a foreign {name} block"
        holders.update(ids)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (
            f"{name} {block}: reference count is not its {holders[block.block_id]} holders"
        )


def assert_free_queue_is_the_unheld_blocks(pool: BlockPool, name: str) -> None:
    """The free queue links exactly the blocks nobody holds, once each, and no held block."""
    queue = list(pool.free_queue)
    queue_ids = [b.block_id for b in queue]
    assert len(queue_ids) == len(set(queue_ids)), f"{name} free queue holds a block twice: {queue_ids}"
    assert set(queue_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}, (
        f"{name} free queue is not the unreferenced blocks"
    )
    assert pool.num_free_blocks == len(queue_ids) == sum(1 for b in pool.blocks if b.ref_cnt == 0), (
        f"{name} free-block count disagrees with the queue"
    )
    for prev, nxt in itertools.pairwise(queue):
        assert prev.next_free is nxt and nxt.prev_free is prev, f"{name} free queue links are broken"
    for block in pool.blocks:
        if block.ref_cnt > 0:
            assert block.prev_free is None and block.next_free is None, f"{name} {block} held but linked"


def assert_prefix_map_matches_block_hashes(pool: BlockPool, name: str) -> None:
    """The hash -> block map holds exactly the blocks that carry a hash, under that hash."""
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash, f"{name} {block} published under another hash"
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached_blocks), (
        f"{name} blocks with a hash are not the published ones"
    )


def assert_pool_consistent(pool: BlockPool, tables: dict[str, list[KVCacheBlock]], name: str) -> None:
    assert_ref_counts_match_holders(pool, tables, name)
    assert_free_queue_is_the_unheld_blocks(pool, name)
    assert_prefix_map_matches_block_hashes(pool, name)


def assert_cpu_pool_consistent(scheduler: Scheduler) -> None:
    """The CPU pool keeps the swapped tables' counts and never caches a prefix; without one, nothing
    is swapped out."""
    kv = scheduler.kv_cache_manager
    if kv.cpu_pool is None:
        assert not any(kv.swapped_blocks.values()), "blocks swapped out without a CPU pool"
        return
    assert_pool_consistent(kv.cpu_pool, _without_freed(kv, kv.swapped_blocks), "cpu")
    assert all(b.block_hash is None for b in kv.cpu_pool.blocks) and not kv.cpu_pool.cached_blocks, (
        "the CPU pool caches a prefix"
    )


def assert_shared_blocks_hold_one_prefix(
    tables: dict[str, list[int | None]], seqs: dict[str, Sequence], block_size: int
) -> None:
    """A block in several tables sits at one position, holding the same tokens for every holder:
    a full block of equal prefixes (prefix cache, forks), or a fork's partial block that no holder
    has written past the fork (the first writer copies it)."""
    where: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for seq_id, table in tables.items():
        for index, block_id in enumerate(table):
            if block_id is not None:
                where[block_id].append((seq_id, index))
    for block_id, places in where.items():
        if len(places) < 2:
            continue
        indices = {index for _, index in places}
        assert len(indices) == 1, f"block {block_id} at different positions: {places}"
        (index,) = indices
        start = index * block_size
        fills = {min(seqs[seq_id].num_computed_tokens, start + block_size) - start for seq_id, _ in places}
        assert len(fills) == 1, f"block {block_id} filled differently by its holders: {places}"
        (fill,) = fills
        prefixes = {tuple(seqs[seq_id].all_token_ids[: start + fill]) for seq_id, _ in places}
        assert len(prefixes) == 1, f"block {block_id} shared by different prefixes: {places}"
        if fill < block_size:
            requests = {seqs[seq_id].request_id for seq_id, _ in places}
            assert len(requests) == 1, f"partial block {block_id} shared across requests: {places}"


def _queues(scheduler: Scheduler) -> dict[str, list[Request]]:
    return {"running": scheduler.running, "waiting": scheduler.waiting, "swapped": scheduler.swapped}


def assert_each_request_in_one_queue(scheduler: Scheduler) -> None:
    """The queues are disjoint and hold exactly the scheduler's live requests."""
    queues = _queues(scheduler)
    ids = [r.request_id for queue in queues.values() for r in queue]
    assert len(ids) == len(set(ids)), f"a request in two queues (or twice): {queues}"
    assert sorted(ids) == sorted(scheduler.requests), "the queues are not the live requests"
    assert all(scheduler.requests[r.request_id] is r for r in itertools.chain(*queues.values())), (
        "a queue holds a stale request object"
    )


def assert_queues_in_priority_order(scheduler: Scheduler) -> None:
    for name in ("waiting", "swapped"):
        keys = [r.sort_key for r in _queues(scheduler)[name]]
        assert keys == sorted(keys), f"{name} queue out of priority / FCFS order"


def assert_rows_within_max_num_seqs(scheduler: Scheduler) -> None:
    rows = sum(r.max_concurrent_seqs for r in scheduler.running)
    assert rows <= scheduler.max_num_seqs, f"running requests take {rows} rows, over max_num_seqs"


def assert_seq_registry_is_the_live_seqs(scheduler: Scheduler) -> dict[str, Sequence]:
    """The scheduler's seq_id -> Sequence map holds exactly the live sequences; returns them."""
    live = {seq.seq_id: seq for r in scheduler.requests.values() for seq in r.live_seqs}
    seqs = scheduler.groups.seqs
    assert seqs.keys() == live.keys() and all(seqs[k] is v for k, v in live.items()), (
        "the sequence registry is not the live sequences"
    )
    return live


_QUEUE_REQUEST_STATUSES = {
    "running": {RequestStatus.RUNNING},
    "waiting": {RequestStatus.WAITING, RequestStatus.PREEMPTED},
    "swapped": {RequestStatus.SWAPPED},
}


def assert_group_well_formed(queue: str, request: Request, tables: _BlockTables) -> None:
    """A queued request's status fits its queue, it has 1 to max_concurrent_seqs live sequences
    with distinct indices, forks only after its prompt is cached, and finished sequences hold no block."""
    assert request.status in _QUEUE_REQUEST_STATUSES[queue], f"{request} in the {queue} queue"
    assert 1 <= len(request.live_seqs) <= request.max_concurrent_seqs, f"{request}: live sequence count"
    assert len({seq.index for seq in request.seqs}) == len(request.seqs), f"{request}: repeated index"
    if request.num_pending_forks:
        assert len(request.seqs) == 1, f"{request} forked before its prompt was cached"
    for seq in request.seqs:
        if seq.is_finished:
            assert seq.seq_id not in tables.device and seq.seq_id not in tables.cpu, (
                f"finished {seq} holds blocks"
            )


def assert_seq_within_limits(queue: str, seq: Sequence, scheduler: Scheduler) -> None:
    """A live sequence's status follows its request's queue; it computes no further than its target
    and holds no more tokens than max_seq_len."""
    request = seq.request
    expected = {status.sequence_status for status in _QUEUE_REQUEST_STATUSES[queue]}
    assert seq.status in expected, f"{seq} in the {queue} queue"
    assert seq.num_computed_tokens <= request.target_num_tokens(seq), f"{seq} computed past its target"
    if queue != "waiting" or seq.num_output_tokens:  # (a new prompt may be too long: ignored)
        assert seq.num_tokens <= scheduler.max_seq_len, f"{seq} longer than max_seq_len"


def assert_seq_blocks_fit_queue(
    queue: str, seq: Sequence, scheduler: Scheduler, tables: _BlockTables
) -> None:
    """A running sequence holds exactly the device blocks its computed tokens need (full ones only
    published), a swapped one as many CPU blocks, and a waiting one none and no computed tokens; a
    place is freed only wholly before the sliding window of the sequence's next token."""
    kv = scheduler.kv_cache_manager
    block_size = scheduler.block_size
    num_blocks = -(-seq.num_computed_tokens // block_size)
    device, cpu = tables.device.get(seq.seq_id), tables.cpu.get(seq.seq_id)
    window = kv.sliding_window
    freeable = 0 if window is None else max(seq.num_computed_tokens - window + 1, 0) // block_size
    freed = [index for index, block_id in enumerate(device or cpu or []) if block_id is None]
    assert all(index < freeable for index in freed), f"{seq} freed blocks {freed} inside its window"
    if queue == "running":
        assert len(device or []) == num_blocks, f"running {seq} holds blocks {device}"
        assert cpu is None, f"running {seq} holds CPU blocks"
        for index, block in enumerate(kv.seq_block_tables[seq.seq_id]):
            if seq.num_computed_tokens < (index + 1) * block_size:
                assert block.block_hash is None, f"{seq}: partial block {block} published"
    elif queue == "swapped":
        assert len(cpu or []) == num_blocks, f"swapped {seq} holds CPU blocks {cpu}"
        assert device is None, f"swapped {seq} holds device blocks"
    else:
        assert seq.num_computed_tokens == 0, f"waiting {seq} has computed tokens"
        assert device is None and cpu is None, f"waiting {seq} holds blocks"


def assert_only_running_seqs_hold_device_blocks(scheduler: Scheduler, tables: _BlockTables) -> None:
    running = {seq.seq_id for r in scheduler.running for seq in r.live_seqs}
    swapped = {seq.seq_id for r in scheduler.swapped for seq in r.live_seqs}
    assert set(tables.device) <= running, "a sequence that is not running holds device blocks"
    assert set(tables.cpu) <= swapped, "a sequence that is not swapped out holds CPU blocks"


@dataclass
class _BlockTables:
    """Block ids each sequence holds, on the device and in the CPU pool (holders of none left out)."""

    device: dict[str, list[int | None]]
    cpu: dict[str, list[int | None]]

    @classmethod
    def of(cls, scheduler: Scheduler) -> _BlockTables:
        return cls(held_blocks(scheduler), swapped_blocks(scheduler))


def check_invariants(scheduler: Scheduler) -> None:
    """Pool and scheduler invariants that hold between any two calls into the scheduler."""
    kv = scheduler.kv_cache_manager
    assert_pool_consistent(kv.block_pool, _without_freed(kv, kv.seq_block_tables), "device")
    assert_cpu_pool_consistent(scheduler)
    assert_each_request_in_one_queue(scheduler)
    assert_queues_in_priority_order(scheduler)
    assert_rows_within_max_num_seqs(scheduler)
    live = assert_seq_registry_is_the_live_seqs(scheduler)
    tables = _BlockTables.of(scheduler)
    for queue, requests in _queues(scheduler).items():
        for request in requests:
            assert_group_well_formed(queue, request, tables)
            for seq in request.live_seqs:
                assert_seq_within_limits(queue, seq, scheduler)
                assert_seq_blocks_fit_queue(queue, seq, scheduler, tables)
    assert_only_running_seqs_hold_device_blocks(scheduler, tables)
    assert_shared_blocks_hold_one_prefix(tables.device, live, scheduler.block_size)
    assert_shared_blocks_hold_one_prefix(tables.cpu, live, scheduler.block_size)


def assert_all_free(scheduler: Scheduler) -> None:
    """Nothing left: every device and CPU block back in its free queue, no state kept anywhere."""
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert not held_blocks(scheduler) and not swapped_blocks(scheduler)
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    if kv.cpu_pool is not None:
        assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks
        assert all(block.ref_cnt == 0 for block in kv.cpu_pool.blocks)
    assert not scheduler.running and not scheduler.waiting and not scheduler.swapped
    assert not scheduler.requests and not scheduler.groups.seqs and not scheduler.groups.beam_states
    # No per-sequence bookkeeping outlives its sequence.
    assert not kv.num_cached_blocks and not any(kv.seq_block_hashes.values())
    assert not scheduler.worker_sequences.num_tokens_sent and not scheduler.groups.beam_candidates
    check_invariants(scheduler)
