"""Block tables for models whose layers differ (Gemma 2/3, gpt-oss, Mistral v0.1's window): vLLM
V1's hybrid KV cache coordinator over one shared BlockPool.

The layers form groups (kvengine.core.memory.kv_groups); each group keeps its own block table per
request and takes its block ids from the one pool. A full-attention group holds a block for every
token. A sliding-window group frees the blocks that fell wholly out of the window before it asks
for more (vLLM's SlidingWindowManager.remove_skipped_blocks), leaving the null block in their
place, so a long request holds about the window there. A prefix hit must hold in every group:
the full groups' longest cached prefix, cut back until each sliding group has the window's blocks
before the hit point cached (vLLM's find_longest_cache_hit). Block hashes carry their group, so a
group never hits another group's block.
"""
from __future__ import annotations

from kvengine.core.block_pool import BlockPool
from kvengine.core.kv_cache_manager import PoolQueries, PrefixCacheStats, cdiv
from kvengine.core.kv_cache_utils import KVCacheBlock, update_block_hashes
from kvengine.core.memory import KVGroups
from kvengine.core.request import Request


class HybridKVCacheManager(PoolQueries):
    """Per-group block tables over one BlockPool (vLLM's HybridKVCacheCoordinator)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, groups: KVGroups,
                 enable_caching: bool = True, in_flight_tokens: int = 0):
        self.block_size = block_size
        # What admission reserves in a sliding group: the window, the tokens in flight and a block
        # (vLLM's max_admission_blocks_per_request, the bound that sized the pool).
        self.admission_cap = groups.sliding_blocks(max_model_len, block_size, in_flight_tokens)
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.kinds = groups.kinds
        self.window = groups.window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: list[dict[str, list[KVCacheBlock]]] = [{} for _ in self.kinds]
        self.num_cached_block: list[dict[str, int]] = [{} for _ in self.kinds]
        self.prefix_stats = PrefixCacheStats()

    # -- queries -------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        """The first group's blocks (the executor's table; the null block where a window freed one)."""
        return [b.block_id for b in self.tables[0].get(request_id, ())]

    # -- prefix cache --------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Each group's cached blocks of the longest prefix every group holds, and its length in tokens."""
        if not self.enable_caching:
            return [[] for _ in self.kinds], 0
        bs = self.block_size
        hashes = update_block_hashes(request, bs)[:(request.num_tokens - 1) // bs]
        get = self.pool.cached.get_one_block
        hit = len(hashes)
        for g, kind in enumerate(self.kinds):  # full groups: a prefix of cached blocks
            if kind != "sliding":
                i = 0
                while i < hit and get((g, hashes[i])) is not None:
                    i += 1
                hit = i
        for g, kind in enumerate(self.kinds):
            if kind == "sliding":
                hit = self._sliding_hit(g, hashes, hit)
        null, skipped = self.pool.null_block, self._skipped_blocks(hit * bs)
        blocks = [[get((g, hashes[i])) if kind != "sliding" else (null if i < skipped else get((g, hashes[i])) or null)
                   for i in range(hit)] for g, kind in enumerate(self.kinds)]
        return blocks, hit * bs

    def _sliding_hit(self, g: int, hashes: list, limit: int) -> int:
        """The longest hit of at most `limit` blocks whose window is cached in group g: the top of the
        last run of cached blocks as long as the window, or a run from the first block."""
        need = max(cdiv(self.window - 1, self.block_size), 1)
        get, run = self.pool.cached.get_one_block, 0
        for i in range(limit - 1, -1, -1):
            run = run + 1 if get((g, hashes[i])) is not None else 0
            if run >= need:
                return i + need
        return run

    def _skipped_blocks(self, num_computed: int) -> int:
        """Blocks wholly before the window of the next token (vLLM: computed - window + 1 tokens)."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.enable_caching:
            self.prefix_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    # -- allocation ----------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=(), full_sequence_must_fit: bool = False) -> list[KVCacheBlock] | None:
        """Slots in every group for `num_new_tokens` more tokens; None if the pool cannot give them all."""
        rid, bs = request.request_id, self.block_size
        first = rid not in self.tables[0]
        if first:
            tables = list(new_computed_blocks) or [[] for _ in self.kinds]
        else:
            for g, kind in enumerate(self.kinds):
                if kind == "sliding":
                    self._free_skipped(self.tables[g][rid], request.num_computed_tokens)
            tables = [self.tables[g][rid] for g in range(len(self.kinds))]
        computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        need = min(computed + num_new_tokens, self.max_model_len)
        new_counts = [max(cdiv(need, bs) - len(t), 0) for t in tables]
        taken = sum(1 for t in tables for b in t if b.ref_cnt == 0 and b is not self.pool.null_block) if first else 0
        free = self.pool.free_queue.num_free
        if first and full_sequence_must_fit:
            whole = cdiv(min(request.num_tokens, self.max_model_len), bs)
            reserve = sum(max((min(whole, self.admission_cap) if kind == "sliding" else whole) - len(t), 0)
                          for kind, t in zip(self.kinds, tables))
            if reserve + taken > free:
                return None
        if sum(new_counts) + taken > free:
            return None
        if first:
            for t in tables:
                self.pool.touch([b for b in t if b is not self.pool.null_block])
        added = []
        for g, (t, n) in enumerate(zip(tables, new_counts)):
            if first:
                self.tables[g][rid] = t = list(t)
                self.num_cached_block[g][rid] = len(t)
            if n:
                new = self.pool.get_new_blocks(n)
                t.extend(new)
                added += new
            if self.enable_caching:
                self._cache_blocks(g, request, t, min(need, request.num_tokens) // bs)
        return added

    def _free_skipped(self, table: list[KVCacheBlock], num_computed: int) -> None:
        """Free the blocks that slid wholly out of the window, newest first, and leave the null block."""
        null, freed = self.pool.null_block, []
        for i in range(min(self._skipped_blocks(num_computed), len(table)) - 1, -1, -1):
            if table[i] is null:
                break  # everything before it went earlier
            freed.append(table[i])
            table[i] = null
        if freed:
            self.pool.free_blocks(freed)

    def _cache_blocks(self, g: int, request: Request, table: list[KVCacheBlock], num_full: int) -> None:
        rid = request.request_id
        start = self.num_cached_block[g][rid]
        if num_full <= start:
            return
        hashes = update_block_hashes(request, self.block_size)
        insert, null = self.pool.cached.insert, self.pool.null_block
        for i in range(start, num_full):
            blk = table[i]
            if blk is not null and blk.block_hash is None:
                blk.block_hash = (g, hashes[i])
                insert(blk.block_hash, blk)
        self.num_cached_block[g][rid] = num_full

    def free(self, request: Request) -> None:
        null = self.pool.null_block
        for g in range(len(self.kinds)):
            blocks = self.tables[g].pop(request.request_id, None)
            self.num_cached_block[g].pop(request.request_id, None)
            if blocks:
                self.pool.free_blocks([b for b in reversed(blocks) if b is not null])

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
