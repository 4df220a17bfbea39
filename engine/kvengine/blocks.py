"""Paged KV blocks with vLLM V1 semantics: BlockPool and KVCacheManager.

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

from .request import Request

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
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

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


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free_queue = FreeBlockQueue(num_blocks)
        self.blocks = self.free_queue.blocks  # the blocks made so far (the rest were never used)
        # hash -> block, or hash -> {block_id: block} when two requests computed
        # the same block at once (both copies stay reachable, as in vLLM).
        self.cached: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
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

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        entry = self.cached.get(block_hash)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        return next(iter(entry.values()))

    def cache_full_blocks(self, blocks: list[KVCacheBlock], hashes: list[bytes],
                          start: int, end: int) -> None:
        cached = self.cached
        for i in range(start, end):
            blk = blocks[i]
            if blk.block_hash is not None:
                continue  # shared with a forked parent: already cached
            h = hashes[i]
            blk.block_hash = h
            entry = cached.get(h)
            if entry is None:
                cached[h] = blk
            elif type(entry) is KVCacheBlock:
                cached[h] = {entry.block_id: entry, blk.block_id: blk}
            else:
                entry[blk.block_id] = blk

    def _evict(self, blk: KVCacheBlock) -> None:
        h = blk.block_hash
        blk.block_hash = None
        entry = self.cached.get(h)
        if entry is blk:
            del self.cached[h]
        elif type(entry) is dict:
            entry.pop(blk.block_id, None)
            if len(entry) == 1:
                self.cached[h] = next(iter(entry.values()))
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
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the executor
        self._forked = False  # no shared partial blocks can exist until a fork

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
        get = self.pool.cached.get
        hits = []
        for h in hashes[:max_blocks]:
            entry = get(h)
            if entry is None:
                break
            hits.append(entry if type(entry) is KVCacheBlock else next(iter(entry.values())))
        return hits, len(hits) * bs

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.enable_caching:
            self.prefix_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def take_prefix_stats(self) -> PrefixCacheStats:
        stats, self.prefix_stats = self.prefix_stats, PrefixCacheStats()
        return stats

    # -- allocation ----------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] = (),
                       full_sequence_must_fit: bool = False) -> list[KVCacheBlock] | None:
        """Give the request slots for `num_new_tokens` more tokens; None if the pool
        cannot (the caller preempts or stops admitting)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None or self._forked:
            return self._allocate(request, req_blocks, num_new_tokens, num_new_computed_tokens,
                                  new_computed_blocks, full_sequence_must_fit)
        # The hot path, inline: a running request with no shared blocks asks for more slots.
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

    def _allocate(self, request, req_blocks, num_new_tokens, num_new_computed_tokens,
                  new_computed_blocks, full_sequence_must_fit):
        bs = self.block_size
        rid = request.request_id
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        if req_blocks is None:
            held = len(new_computed_blocks)
            evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            cow = 0
        else:
            held = len(req_blocks)
            evictable = 0
            cow = self._shared_tail_index(req_blocks, total_computed) is not None
        free = self.pool.free_queue.num_free
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if max(cdiv(full, bs) - held, 0) + evictable + cow > free:
                return None
        num_tokens_need_slot = min(total_computed + num_new_tokens, self.max_model_len)
        num_new_blocks = max(cdiv(num_tokens_need_slot, bs) - held, 0)
        if num_new_blocks + evictable + cow > free:
            return None

        if req_blocks is None:
            self.pool.touch(new_computed_blocks)
            req_blocks = self.req_to_blocks[rid] = list(new_computed_blocks)
            self.num_cached_block[rid] = len(req_blocks)
        elif cow:
            self._copy_on_write(req_blocks, total_computed)
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

    # -- n > 1: fork with copy-on-write -------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; a shared partial block is
        copied on the first write (see allocate_slots)."""
        self._forked = True
        blocks = list(self.req_to_blocks.get(parent.request_id, ()))
        for b in blocks:
            b.ref_cnt += 1
        self.req_to_blocks[child.request_id] = blocks
        self.num_cached_block[child.request_id] = self.num_cached_block.get(parent.request_id, 0)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)

    def _shared_tail_index(self, req_blocks: list[KVCacheBlock], num_computed: int) -> int | None:
        """Index of the partially filled block the next token writes, if it is shared."""
        idx, offset = divmod(num_computed, self.block_size)
        if offset and idx < len(req_blocks) and req_blocks[idx].ref_cnt > 1:
            return idx
        return None

    def _copy_on_write(self, req_blocks: list[KVCacheBlock], num_computed: int) -> None:
        idx = self._shared_tail_index(req_blocks, num_computed)
        src = req_blocks[idx]
        (dst,) = self.pool.get_new_blocks(1)
        src.ref_cnt -= 1  # still > 0: another table holds it
        req_blocks[idx] = dst
        self.pending_copies.append((src.block_id, dst.block_id))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
