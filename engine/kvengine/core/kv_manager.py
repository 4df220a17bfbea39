"""KVManager: what the scheduler, the engine and the executors ask of a KV allocator.

Implemented by blocks.KVCacheManager (paged, prefix cache) and
contiguous.ContiguousKVCacheManager (one worst-case reservation per request).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvengine.core.kv_cache_manager import PrefixCacheStats
from kvengine.core.request import Request


class KVManager(Protocol):
    block_size: int
    prefix_stats: PrefixCacheStats

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_usable_blocks(self) -> int: ...

    @property
    def num_evictions(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int | None:
        """Hashes in the prefix cache; None where the allocator has none."""

    def usage(self) -> float: ...

    def get_block_ids(self, request_id: str) -> list[int]: ...

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """The cached prefix's blocks and its length in tokens."""

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0, new_computed_blocks: Sequence = (),
                       full_sequence_must_fit: bool = False) -> list | None:
        """Slots for `num_new_tokens` more tokens: the blocks added, or None if they do not fit.
        The scheduler reads a running request's added blocks' `block_id`s."""

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None: ...

    def free(self, request: Request) -> None: ...

    def reset_prefix_cache(self) -> bool: ...
