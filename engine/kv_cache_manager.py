"""Per-request block tables over the block pool: prefix lookup, on-demand allocation, immediate free.

Checks never mutate: `get_computed_blocks` only looks, and `allocate_slots` decides whether the
request fits before it takes anything, returning None (and changing nothing) when it does not.
"""

from __future__ import annotations

from collections import defaultdict

from engine.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to its list of physical blocks (its block table)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.req_to_block_hashes: defaultdict[str, list[BlockHash]] = defaultdict(list)
        # How many leading blocks of each request have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request's tokens: (blocks, number of tokens they hold).

        The last token is always left to compute, so that the step produces logits for it.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give a request room for `num_new_tokens` more tokens after its computed ones.

        `new_computed_blocks` are prefix-cache hits taken at admission. Returns the newly allocated
        blocks, or None when the pool cannot supply them (nothing is changed then).
        """
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks[request.request_id]
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(hits)
        # Hits that nobody holds sit in the free queue: taking them shrinks what is left to allocate.
        num_hits_in_free_queue = sum(1 for block in hits if block.ref_cnt == 0)
        if num_needed > self.block_pool.num_free_blocks - num_hits_in_free_queue:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(hits)
        blocks.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so that a shared prefix's head is evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)

    def forget(self, request: Request) -> None:
        """Drop the hashes kept for a request that will not come back."""
        self.req_to_block_hashes.pop(request.request_id, None)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Chain hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self.req_to_block_hashes[request.request_id]
        size = self.block_size
        tokens = request.all_token_ids
        for index in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[index * size : (index + 1) * size]))
        return hashes

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the blocks that become full once `num_tokens` tokens are written."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        for index in range(start, num_full):
            self.block_pool.cache_block(blocks[index], hashes[index])
        self.num_cached_blocks[request.request_id] = num_full
