"""Per-sequence block tables over the block pool: prefix lookup, on-demand allocation, copy-on-write,
forks, swapping to a CPU pool, immediate free, and sliding windows.

Checks never mutate: `get_computed_blocks` and `num_blocks_needed` only look, and `allocate_slots`
(and `allocate_group`, for the sequences of one request at once) decides whether the sequences fit
before it takes anything, returning None (and changing nothing) when they do not.

Sliding windows (vLLM's SlidingWindowManager): when every layer of the model slides, a query at
position p sees no key before p - window + 1, so a block wholly before the first key that a
sequence's next token sees is dead for good. `free_blocks_outside_window` returns such blocks to the
pool as the sequence grows (their hashes stay: a later prompt with that prefix may still hit them)
and leaves `null_block` at their places in the table, so that positions keep their indices; a
prefix hit needs and takes only the cached blocks inside the window of its first computed token,
with `null_block` before them (`_window_hits`). A sequence so holds at most a window and a step's tokens at once
(`window_blocks`), however long it grows. The
workers are not told: their copies of those entries keep the old ids, which no kernel reads (every
backend starts at the block holding a query's first visible key), as in vLLM.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

from engine.sched.block_pool import BlockHash, BlockPool, KVCacheBlock, chain_block_hashes
from engine.sched.request import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def freeing_window(layer_windows: Iterable[int | None]) -> int | None:
    """The window past which a sequence's blocks may be freed: the widest layer's when every layer
    slides; None (free nothing early) when any layer sees the whole sequence."""
    windows = list(layer_windows)
    if not windows or None in windows:
        return None
    return max(window for window in windows if window is not None)


def window_blocks(sliding_window: int, num_step_tokens: int, block_size: int) -> int:
    """The most blocks a sequence holds under a freeing window when a step computes up to
    `num_step_tokens` of its tokens: those from the block of the first visible key to the last new one."""
    return cdiv(sliding_window - 1 + num_step_tokens, block_size) + 1


def max_sequence_len(
    max_model_len: int, num_blocks: int, block_size: int, sliding_window: int | None, num_step_tokens: int
) -> int:
    """The most tokens a sequence may hold: no more than the whole cache (it stops there, cut by
    length), unless every layer slides and the cache holds a window and a step's tokens."""
    if (
        sliding_window is not None
        and window_blocks(sliding_window, num_step_tokens, block_size) <= num_blocks
    ):
        return max_model_len
    return min(max_model_len, num_blocks * block_size)


@dataclasses.dataclass(slots=True)
class SequenceWant:
    """One sequence's share of a step: `num_new_tokens` to compute after taking `prefix_hits`
    (cached blocks holding its next `num_hit_tokens` tokens; empty unless it holds no blocks yet)."""

    seq: Sequence
    num_new_tokens: int
    prefix_hits: list[KVCacheBlock]
    num_hit_tokens: int
    # Speculative drafts computed after the sequence's last token (counted in num_new_tokens).
    drafts: list[int] = dataclasses.field(default_factory=list)
    # Slots past the new tokens for a draft model's proposals, written after the step and freed
    # again when it ends.
    num_lookahead_tokens: int = 0

    @property
    def num_slots(self) -> int:
        """Slots the step needs for the sequence: its new tokens and the lookahead."""
        return self.num_new_tokens + self.num_lookahead_tokens


@dataclasses.dataclass
class SlotAllocation:
    """What changed in a sequence's block table: from `table_start` on it now reads `block_ids`;
    `copies` are (source, destination) blocks to copy first (copy-on-write)."""

    table_start: int
    block_ids: list[int]
    copies: list[tuple[int, int]]


class KVCacheManager:
    """Maps each sequence to its list of physical blocks (its block table).

    `sliding_window` (`freeing_window` of the model's layers): every layer sees at most that many
    tokens back, so the blocks before it are freed as sequences grow; None keeps every block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_cpu_blocks: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # Stands in a table for a block freed outside the window: outside the pool, never taken,
        # freed, published or swapped. Its id is only a placeholder in the tables sent to workers
        # (after a swap-in): no kernel reads a block outside the window.
        self.null_block = KVCacheBlock(0)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False) if num_cpu_blocks else None
        # Keyed by seq_id: each sequence's block table, and the chain hashes of its full blocks.
        self.seq_block_tables: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.seq_block_hashes: defaultdict[str, list[BlockHash]] = defaultdict(list)
        # How many leading blocks of each sequence have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Block tables of swapped-out sequences, in the CPU pool.
        self.swapped_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def block_ids(self, seq_id: str) -> list[int]:
        return [block.block_id for block in self.seq_block_tables.get(seq_id, ())]

    def num_logical_blocks(self, seqs: Iterable[Sequence]) -> int:
        """Blocks the sequences' tables point to, a shared block counted once per table."""
        return sum(len(self._held(self.seq_block_tables.get(seq.seq_id, []))) for seq in seqs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing forgotten) while a sequence holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def prefix_cache_summary(self) -> bytes:
        return self.block_pool.cached_hash_summary()

    # ---- prefix cache --------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a sequence's tokens: (blocks, number of tokens they hold).

        The last token is always left to compute, so that the step produces logits for it.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self._block_hashes(seq)
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._window_hits(hashes[:max_hit_blocks])
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hits(self, hashes: list[BlockHash]) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix whose blocks inside its window are cached, as vLLM's sliding-window
        manager finds it: the first token computed after k hit blocks sees the last
        ceil((window - 1) / block_size) of them, so only those must be cached (or all k, if fewer);
        the places before them hold null_block."""
        assert self.sliding_window is not None
        num_visible = max(cdiv(self.sliding_window - 1, self.block_size), 1)
        run: list[KVCacheBlock] = []  # cached blocks ending where the scan (right to left) began it
        for index in range(len(hashes) - 1, -1, -1):
            block = self.block_pool.get_cached_block(hashes[index])
            if block is None:
                run = []
                continue
            run.insert(0, block)
            if len(run) == num_visible:
                return [self.null_block] * index + run, (index + num_visible) * self.block_size
        return run, len(run) * self.block_size  # a run from the first block, shorter than a window

    # ---- allocation ----------------------------------------------------------------------------

    def num_blocks_needed(
        self, seq: Sequence, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> int:
        """Free blocks `allocate_slots` would take: new blocks, a copy-on-write, and prefix hits
        that nobody holds (they sit in the free queue, so taking them shrinks it)."""
        hits = new_computed_blocks or []
        blocks = self.seq_block_tables.get(seq.seq_id, [])
        num_computed = seq.num_computed_tokens + len(hits) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(hits)
        return (
            max(needed, 0)
            + int(self._needs_copy_on_write(seq))
            + sum(1 for block in self._held(hits) if block.ref_cnt == 0)
        )

    def num_blocks_held_after(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks the sequence holds once `num_new_tokens` more are computed: all it has written,
        or under a sliding window those from the one holding its first visible key on."""
        num_tokens = seq.num_computed_tokens + num_new_tokens
        num_dead = 0
        if self.sliding_window is not None:
            num_dead = max(seq.num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        return cdiv(num_tokens, self.block_size) - num_dead

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> SlotAllocation | None:
        """Give a sequence room for `num_new_tokens` more tokens after its computed ones.

        `new_computed_blocks` are prefix-cache hits taken at admission. Returns what changed in the
        block table, or None when the pool cannot supply it (nothing is changed then).
        """
        if self.num_blocks_needed(seq, num_new_tokens, new_computed_blocks) > self.block_pool.num_free_blocks:
            return None
        return self._take_slots(seq, num_new_tokens, new_computed_blocks or [])

    def _take_slots(self, seq: Sequence, num_new_tokens: int, hits: list[KVCacheBlock]) -> SlotAllocation:
        """`allocate_slots` once the blocks are known to be there."""
        blocks = self.seq_block_tables[seq.seq_id]
        table_start = len(blocks)
        copies = []
        if self._needs_copy_on_write(seq):
            # The block this step writes into is shared with a fork: write into a private copy.
            table_start = seq.num_computed_tokens // self.block_size
            shared = blocks[table_start]
            (private,) = self.block_pool.get_new_blocks(1)
            copies.append((shared.block_id, private.block_id))
            self.block_pool.free_blocks([shared])
            blocks[table_start] = private
        self.block_pool.touch(self._held(hits))
        blocks.extend(hits)
        num_computed = seq.num_computed_tokens + len(hits) * self.block_size
        num_new_blocks = max(cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks), 0)
        blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        if self.enable_caching:
            self._cache_full_blocks(seq, num_computed + num_new_tokens)
        return SlotAllocation(table_start, [block.block_id for block in blocks[table_start:]], copies)

    def num_blocks_needed_by_group(self, wants: list[SequenceWant]) -> int:
        """Free blocks that `allocate_group` takes for the sequences of one request.

        `num_blocks_needed` sees one sequence alone: a prefix hit several sequences take counts once
        per sequence, and a shared block that all its holders write counts a copy for each, though
        the last writer keeps the block itself.
        """
        needed = sum(self.num_blocks_needed(w.seq, w.num_slots, w.prefix_hits) for w in wants)
        unheld_hits = [
            block.block_id for w in wants for block in self._held(w.prefix_hits) if block.ref_cnt == 0
        ]
        needed -= len(unheld_hits) - len(set(unheld_hits))
        writers: dict[int, int] = {}
        for want in wants:
            table = self.seq_block_tables.get(want.seq.seq_id, [])
            index = want.seq.num_computed_tokens // self.block_size
            if index < len(table) and table[index].ref_cnt > 1:
                writers[table[index].block_id] = writers.get(table[index].block_id, 0) + 1
        blocks = self.block_pool.blocks
        return needed - sum(1 for block_id, count in writers.items() if count == blocks[block_id].ref_cnt)

    def allocate_group(self, wants: list[SequenceWant]) -> list[SlotAllocation] | None:
        """`allocate_slots` for the sequences of one request, all or none (None: they do not fit)."""
        if self.num_blocks_needed_by_group(wants) > self.block_pool.num_free_blocks:
            return None
        # Hold every prefix hit first: one sequence's new blocks come from the head of the free
        # queue, where the hits of another sequence of the request may sit.
        pinned = [block for want in wants for block in self._held(want.prefix_hits)]
        self.block_pool.touch(pinned)
        allocations = [self._take_slots(w.seq, w.num_slots, w.prefix_hits) for w in wants]
        self.block_pool.free_blocks(pinned)
        return allocations

    def free_blocks_outside_window(self, seq: Sequence) -> None:
        """Release the leading blocks that no query of the sequence will see again: those wholly
        before the first key its next token (at num_computed_tokens) sees. Only when every layer
        slides; the freed places in the table become `null_block`."""
        blocks = self.seq_block_tables.get(seq.seq_id)
        if self.sliding_window is None or not blocks:
            return
        first_visible = max(seq.num_computed_tokens - self.sliding_window + 1, 0)
        freed = []
        for index in reversed(range(min(first_visible // self.block_size, len(blocks)))):
            if blocks[index] is self.null_block:
                break  # freed at an earlier step, with every block before it
            freed.append(blocks[index])
            blocks[index] = self.null_block
        self.block_pool.free_blocks(freed)  # tail first, as `free` does

    def free_blocks_after(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (speculative drafts that were
        rejected); never published, they hold nothing another sequence could use."""
        blocks = self.seq_block_tables.get(seq.seq_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks and len(blocks) > keep:
            self.block_pool.free_blocks(reversed(self._held(blocks[keep:])))
            del blocks[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent` (by reference count)."""
        blocks = self.seq_block_tables[parent.seq_id]
        self.block_pool.touch(self._held(blocks))
        self.seq_block_tables[child.seq_id] = list(blocks)
        self.seq_block_hashes[child.seq_id] = list(self.seq_block_hashes.get(parent.seq_id, []))
        self.num_cached_blocks[child.seq_id] = self.num_cached_blocks.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first, so that a shared prefix's head is evicted last."""
        blocks = self.seq_block_tables.pop(seq.seq_id, [])
        self.block_pool.free_blocks(reversed(self._held(blocks)))
        self.num_cached_blocks.pop(seq.seq_id, None)
        swapped = self.swapped_blocks.pop(seq.seq_id, None)
        if swapped and self.cpu_pool is not None:
            self.cpu_pool.free_blocks(reversed(self._held(swapped)))

    def forget(self, seq: Sequence) -> None:
        """Drop the hashes kept for a sequence that will not come back."""
        self.seq_block_hashes.pop(seq.seq_id, None)

    # ---- swapping ------------------------------------------------------------------------------

    def can_swap_out(self, seqs: Iterable[Sequence]) -> bool:
        tables = (self.seq_block_tables.get(seq.seq_id, []) for seq in seqs)
        blocks = {block.block_id for table in tables for block in self._held(table)}
        return self.cpu_pool is not None and len(blocks) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move sequences' blocks to the CPU pool, keeping their sharing; (device, cpu) pairs to copy."""
        return self._move(seqs, self.seq_block_tables, self.swapped_blocks, self.block_pool, self.cpu_pool)

    def can_swap_in(self, seqs: Iterable[Sequence]) -> bool:
        tables = (self.swapped_blocks.get(seq.seq_id, []) for seq in seqs)
        blocks = {block.block_id for table in tables for block in self._held(table)}
        return len(blocks) <= self.block_pool.num_free_blocks

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring swapped sequences back into fresh device blocks; (cpu, device) pairs to copy."""
        for seq in seqs:
            self.num_cached_blocks[seq.seq_id] = 0  # fresh blocks: offer them to the prefix cache again
        return self._move(seqs, self.swapped_blocks, self.seq_block_tables, self.cpu_pool, self.block_pool)

    def _move(
        self,
        seqs: list[Sequence],
        source_tables: dict[str, list[KVCacheBlock]],
        target_tables: dict[str, list[KVCacheBlock]],
        source_pool: BlockPool | None,
        target_pool: BlockPool | None,
    ) -> list[tuple[int, int]]:
        if source_pool is None or target_pool is None:
            raise RuntimeError("swapping needs a CPU block pool (swap_space > 0)")
        moved: dict[int, KVCacheBlock] = {}
        for seq in seqs:
            table = []
            for block in source_tables[seq.seq_id]:
                if block is self.null_block:
                    table.append(block)  # freed outside the window: nothing to move
                    continue
                if block.block_id in moved:
                    target_pool.touch([moved[block.block_id]])  # shared before, shared after
                else:
                    (moved[block.block_id],) = target_pool.get_new_blocks(1)
                table.append(moved[block.block_id])
            source_pool.free_blocks(reversed(self._held(source_tables.pop(seq.seq_id))))
            target_tables[seq.seq_id] = table
        return [(source, target.block_id) for source, target in moved.items()]

    # ---- helpers -------------------------------------------------------------------------------

    def _held(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """A table's blocks without the places freed outside the window."""
        return [block for block in blocks if block is not self.null_block]

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        blocks = self.seq_block_tables.get(seq.seq_id)
        write_index = seq.num_computed_tokens // self.block_size
        return bool(blocks) and write_index < len(blocks) and blocks[write_index].ref_cnt > 1

    def _block_hashes(self, seq: Sequence) -> list[BlockHash]:
        """Chain hashes of the sequence's full blocks, extended as its tokens grow (salted with its
        request's cache salt, which forks, beams and a preempted request's recompute keep)."""
        return chain_block_hashes(
            seq.all_token_ids, self.block_size, self.seq_block_hashes[seq.seq_id], seq.request.cache_salt
        )

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the blocks that become full once `num_tokens` tokens are written."""
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq)
        blocks = self.seq_block_tables[seq.seq_id]
        for index in range(start, num_full):
            if blocks[index] is not self.null_block:  # (a swapped-in table offers its blocks again)
                self.block_pool.cache_block(blocks[index], hashes[index])
        self.num_cached_blocks[seq.seq_id] = num_full
