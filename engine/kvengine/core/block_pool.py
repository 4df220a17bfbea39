"""The block pool and its prefix cache (vLLM V1's BlockPool and BlockHashToBlockMap).

A request's blocks are freed tail first, so a chain's tail is evicted first; the
ones no prefix can hit (no hash) go to the queue's head instead, reused before
any cached block is evicted (vLLM's LIFO reuse of uncached blocks).
"""
from __future__ import annotations

from kvengine.core.kv_cache_utils import FreeBlockQueue, KVCacheBlock

class BlockHashToBlockMap:
    """The prefix cache: block hash -> cached block (vLLM V1's BlockHashToBlockMap).

    Two requests that computed the same block at once both keep it reachable, as
    in vLLM, so a hash may hold several blocks; it then maps to {block_id: block},
    made only for that case so a lookup stays one dict read."""

    __slots__ = ("_cache",)

    def __init__(self):
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        return next(iter(entry.values()))

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif type(entry) is KVCacheBlock:
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Drop block `block_id` from under `key`; the block, or None if it was not there."""
        entry = self._cache.get(key)
        if entry is None:
            return None
        if type(entry) is KVCacheBlock:
            if entry.block_id != block_id:
                return None
            del self._cache[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._cache[key] = next(iter(entry.values()))
        return block

    def items(self):
        """Every (hash, block) pair, a hash once per block it holds."""
        for key, entry in self._cache.items():
            if type(entry) is KVCacheBlock:
                yield key, entry
            else:
                for block in entry.values():
                    yield key, block

    def clear(self) -> None:
        self._cache.clear()

    def __len__(self) -> int:
        """The number of hashes cached (a hash held by two blocks counts once)."""
        return len(self._cache)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free_queue = FreeBlockQueue(num_blocks)
        self.blocks = self.free_queue.blocks  # the blocks made so far (the rest were never used)
        self.cached = BlockHashToBlockMap()
        self.null_block = self.free_queue.popleft()
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: referenced blocks only (cached free ones are free)."""
        return 1.0 - self.free_queue.num_free / (self.num_blocks - 1)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], hashes: list[bytes],
                          start: int, end: int) -> None:
        insert = self.cached.insert
        for i in range(start, end):
            blk = blocks[i]
            blk.block_hash = hashes[i]
            insert(blk.block_hash, blk)

    def _evict(self, blk: KVCacheBlock) -> None:
        self.cached.pop(blk.block_hash, blk.block_id)
        blk.block_hash = None
        self.num_evictions += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot get {n} free blocks from the pool ({self.free_queue.num_free} free)")
        queue = self.free_queue
        out = []
        for _ in range(n):
            blk = queue.popleft()
            if blk.block_hash is not None:
                self._evict(blk)
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """A prefix hit: take evictable blocks out of the free queue, then count the ref."""
        queue = self.free_queue
        for blk in blocks:
            if blk.ref_cnt == 0:
                queue.remove(blk)
            blk.ref_cnt += 1

    def free_blocks(self, ordered_blocks) -> None:
        """Drop one reference each; blocks that reach 0 join the queue's tail, hash kept. A block
        no prefix can hit (no hash, or caching off) goes to the head instead, as vLLM 0.32's
        BlockPool.free_blocks has it: reused before any cached block is evicted."""
        queue = self.free_queue
        first = []
        keep_hashes = self.enable_caching
        for blk in ordered_blocks:
            if blk.ref_cnt <= 0:
                raise RuntimeError(f"double free of {blk!r}")
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk.block_hash is None or not keep_hashes:
                    first.append(blk)
                else:
                    queue.append(blk)
        if first:
            queue.prepend_n(first)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only possible when no request holds a block."""
        if self.free_queue.num_free != self.num_blocks - 1:
            return False
        for blk in self.blocks:
            blk.block_hash = None
        self.cached.clear()
        return True
