"""Per-request block tables over a BlockPool (vLLM V1's KVCacheManager, one group)."""
from __future__ import annotations

from dataclasses import dataclass

from kvengine.core.block_pool import BlockPool
from kvengine.core.kv_cache_utils import KVCacheBlock, update_block_hashes
from kvengine.core.request import Request

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


class PoolQueries:
    """What the scheduler and the metrics read of a manager's BlockPool (`self.pool`)."""

    pool: BlockPool

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


class KVCacheManager(PoolQueries):
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
