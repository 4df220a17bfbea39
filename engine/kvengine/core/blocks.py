"""Paged KV blocks with vLLM V1 semantics: BlockPool, its BlockHashToBlockMap, KVCacheManager.

- Block 0 is the null block: never allocated, freed or cached.
- Free blocks sit in a doubly-linked queue in LRU-eviction order; a prefix hit
  takes a block out of the middle in O(1).
- Full blocks are hashed as a chain (parent hash, token ids, extra keys). A
  freed block keeps its hash, so it can still be hit until it is reused.
- A request's blocks are freed tail first, so a chain's tail is evicted first;
  the ones no prefix can hit (no hash) go to the queue's head instead, reused
  before any cached block is evicted (vLLM's LIFO reuse of uncached blocks).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from kvengine.core.request import Request

NONE_HASH = hashlib.sha256(b"kvengine:none-hash").digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids, extra_keys: tuple | None = None) -> bytes:
    """Deterministic across processes and runs (unlike Python's str hash)."""
    h = hashlib.sha256(parent_hash or NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Hash the request's full blocks that are not hashed yet (cache salt on block 0)."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        extra = (request.cache_salt,) if i == 0 and request.cache_salt else None
        parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """vLLM's free queue: popleft, append, prepend, remove in O(1). The blocks never used yet
    sit in id order, as vLLM's initial queue has them; each is made when first popped, so a
    pool of millions of blocks (a small model on a large device) costs nothing until it fills.
    Freed blocks go in intrusive doubly-linked lists with sentinels: the ones put back at the
    head (to be reused first) before the never-used blocks, the ones put at the tail after."""

    def __init__(self, num_blocks: int):
        self.blocks: list[KVCacheBlock] = []  # every block made so far: block_id == index
        self.num_blocks = num_blocks
        self.next_fresh = 0  # the first block id never popped
        self.front_head, self.front_tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.front_head.next_free, self.front_tail.prev_free = self.front_tail, self.front_head
        self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = num_blocks

    def block(self, block_id: int) -> KVCacheBlock:
        while len(self.blocks) <= block_id:
            self.blocks.append(KVCacheBlock(len(self.blocks)))
        return self.blocks[block_id]

    def popleft(self) -> KVCacheBlock:
        b = self.front_head.next_free
        if b is not self.front_tail:
            self.remove(b)
            return b
        if self.next_fresh < self.num_blocks:
            b = self.block(self.next_fresh)
            self.next_fresh += 1
            self.num_free -= 1
            return b
        b = self.head.next_free
        if b is self.tail:
            raise ValueError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: KVCacheBlock) -> None:
        """Take a freed block out (a prefix hit on it); a never-used one is never asked for."""
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def append(self, b: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, b.prev_free = b, last
        b.next_free, self.tail.prev_free = self.tail, b
        self.num_free += 1

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the head of the queue, the first of them first out."""
        after = self.front_head.next_free
        prev = self.front_head
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
        prev.next_free, after.prev_free = after, prev
        self.num_free += len(blocks)

    def __iter__(self):
        b = self.front_head.next_free
        while b is not self.front_tail:
            yield b
            b = b.next_free
        for block_id in range(self.next_fresh, self.num_blocks):
            yield self.block(block_id)
        b = self.head.next_free
        while b is not self.tail:
            yield b
            b = b.next_free


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


@dataclass
class PrefixCacheStats:
    """In tokens, as vLLM counts them; resumed (preempted) requests apart."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables over a BlockPool (vLLM's KVCacheManager, one group)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    # -- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # -- prefix cache --------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, capped at num_tokens - 1 (the last
        token is always computed, to get logits)."""
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        hashes = update_block_hashes(request, bs)
        max_blocks = (request.num_tokens - 1) // bs
        get_one_block = self.pool.cached.get_one_block
        hits = []
        for h in hashes[:max_blocks]:
            blk = get_one_block(h)
            if blk is None:
                break
            hits.append(blk)
        return hits, len(hits) * bs

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.enable_caching:
            self.prefix_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    # -- allocation ----------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] = (),
                       full_sequence_must_fit: bool = False) -> list[KVCacheBlock] | None:
        """Give the request slots for `num_new_tokens` more tokens; None if the pool
        cannot (the caller preempts or stops admitting)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None:
            return self._allocate_first(request, num_new_tokens, num_new_computed_tokens,
                                        new_computed_blocks, full_sequence_must_fit)
        # The hot path, inline: a running request asks for more slots.
        bs = self.block_size
        computed = request.num_computed_tokens
        need = computed + num_new_tokens
        if need > self.max_model_len:
            need = self.max_model_len
        num_new_blocks = -(-need // bs) - len(req_blocks)
        if num_new_blocks > 0:
            if num_new_blocks > self.pool.free_queue.num_free:
                return None
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []
        if self.enable_caching:
            num_tokens = len(request.all_token_ids)
            full = (need if need < num_tokens else num_tokens) // bs
            if full > self.num_cached_block[request.request_id]:
                self._cache_blocks(request, req_blocks, full)
        return new_blocks

    def _allocate_first(self, request, num_new_tokens, num_new_computed_tokens,
                        new_computed_blocks, full_sequence_must_fit):
        """A request's first slots: its prefix hits, then new blocks for the rest."""
        bs = self.block_size
        rid = request.request_id
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        held = len(new_computed_blocks)
        # A hit block no request holds sits in the free queue: taking it uses up a free block.
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        free = self.pool.free_queue.num_free
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if max(cdiv(full, bs) - held, 0) + evictable > free:
                return None
        num_tokens_need_slot = min(total_computed + num_new_tokens, self.max_model_len)
        num_new_blocks = max(cdiv(num_tokens_need_slot, bs) - held, 0)
        if num_new_blocks + evictable > free:
            return None

        self.pool.touch(new_computed_blocks)
        req_blocks = self.req_to_blocks[rid] = list(new_computed_blocks)
        self.num_cached_block[rid] = len(req_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            num_full = min(total_computed + num_new_tokens, request.num_tokens) // bs
            if num_full > self.num_cached_block[rid]:
                self._cache_blocks(request, req_blocks, num_full)
        return new_blocks

    def _cache_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_full: int) -> None:
        """Hash and publish the request's blocks up to `num_full` full ones."""
        rid = request.request_id
        num_cached = self.num_cached_block[rid]
        hashes = update_block_hashes(request, self.block_size)
        self.pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
        self.num_cached_block[rid] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
