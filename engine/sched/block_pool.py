"""The physical KV blocks: a free queue in LRU order and a hash map for prefix caching.

Every block exists from start-up. A block with `ref_cnt == 0` sits in the free queue and may still
hold a cached prefix (its hash stays in the map until the block is reused), so a later request with
the same prefix can take it back out of the middle of the queue in O(1).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

BlockHash = bytes
# Bytes of each block hash in a prefix-cache summary (`BlockPool.cached_hash_summary`): a collision
# only misleads a routing guess, and 2^-64 odds are plenty for that at half the size.
SUMMARY_HASH_BYTES = 8


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b""
) -> BlockHash:
    """Chain hash of one full block: equal hashes mean equal tokens from the start of the sequence."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"\0" * 16)
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_key)
    return digest.digest()


def chain_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    hashes: list[BlockHash] | None = None,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """The chain hashes of every full block of `token_ids`: `hashes` (those of its first blocks,
    computed earlier) extended in place, or a new list. The KV cache manager publishes blocks under
    these hashes, and a Serve router computes them from a prompt to find the replica holding it.

    A request's `cache_salt` is an extra key of its first block only (as in vLLM): every later hash
    chains its parent's, so the salt reaches them all, and requests with different salts (or one
    with a salt and one without) share no block, whatever their tokens.
    """
    hashes = [] if hashes is None else hashes
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        extra_key = cache_salt.encode() if cache_salt and index == 0 else b""
        block_tokens = token_ids[index * block_size : (index + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block_tokens, extra_key))
    return hashes


class KVCacheBlock:
    """One physical block; also a node of the intrusive free list."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: evict from the head, free to the tail, remove from anywhere."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free KV cache block left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """All KV blocks of one engine, with reference counts and the prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Share of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, count: int) -> list[KVCacheBlock]:
        """Take `count` blocks from the LRU end, evicting whatever prefix they cached."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (out of the free queue if unused)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks that reach zero join the free queue in the given order."""
        for block in ordered_blocks:
            # Check before decrementing: a failed free must not leave a negative count behind.
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its chain hash (the first block with a hash keeps it)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return  # an identical block is already published; this one stays private
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def cached_hash_summary(self) -> bytes:
        """What the prefix cache holds, compact: the first SUMMARY_HASH_BYTES of each cached block's
        chain hash (free blocks whose hash survives included: a request would hit them), concatenated."""
        return b"".join(block_hash[:SUMMARY_HASH_BYTES] for block_hash in self.cached_blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no request holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True
