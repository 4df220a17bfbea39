"""The allocator PagedAttention replaced: one contiguous worst-case reservation per request.

Each admitted request reserves `max_model_len` tokens (rounded up to blocks)
as one contiguous run of blocks, first fit, and holds it until it finishes. No
sharing, no prefix caching. A kv_manager.KVManager, as KVCacheManager is, so
the scheduler and the executors run unchanged on top of it.
"""
from __future__ import annotations

import bisect

from kvengine.core.kv_cache_manager import PrefixCacheStats, cdiv
from kvengine.core.request import Request


class ContiguousKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = False):  # KVCacheManager's signature: the engine builds either
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.blocks_per_request = cdiv(max_model_len, block_size)
        # Free runs as sorted (start, length); block 0 stays the null block.
        self.free_runs: list[tuple[int, int]] = [(1, num_blocks - 1)]
        self.reservations: dict[str, tuple[int, int]] = {}
        self.num_reserved_blocks = 0
        self.prefix_stats = PrefixCacheStats()
        self.num_evictions = 0
        self.num_cached_blocks = None  # no prefix cache

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.num_usable_blocks - self.num_reserved_blocks

    def usage(self) -> float:
        return self.num_reserved_blocks / self.num_usable_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        start, length = self.reservations.get(request_id, (0, 0))
        return list(range(start, start + length))

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        return [], 0

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        pass  # no prefix cache: nothing is queried, as vLLM with caching off

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0, new_computed_blocks=(),
                       full_sequence_must_fit: bool = False) -> list[int] | None:
        rid = request.request_id
        if rid in self.reservations:
            return []  # the reservation already covers max_model_len
        start = self._first_fit(self.blocks_per_request)
        if start is None:
            return None
        self.reservations[rid] = (start, self.blocks_per_request)
        self.num_reserved_blocks += self.blocks_per_request
        return list(range(start, start + self.blocks_per_request))

    def _first_fit(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.free_runs):
            if length >= n:
                if length == n:
                    del self.free_runs[i]
                else:
                    self.free_runs[i] = (start + n, length - n)
                return start
        return None

    def free(self, request: Request) -> None:
        run = self.reservations.pop(request.request_id, None)
        if run is None:
            return
        self.num_reserved_blocks -= run[1]
        self._release(*run)

    def _release(self, start: int, length: int) -> None:
        runs = self.free_runs
        i = bisect.bisect_left(runs, (start, 0))
        if i < len(runs) and start + length == runs[i][0]:  # merge with the next run
            length += runs[i][1]
            del runs[i]
        if i > 0 and runs[i - 1][0] + runs[i - 1][1] == start:  # and the previous one
            start, length = runs[i - 1][0], runs[i - 1][1] + length
            del runs[i - 1]
            i -= 1
        runs.insert(i, (start, length))

    def reset_prefix_cache(self) -> bool:
        return True
