"""Paged KV blocks, as vLLM V1's kv_cache_utils: the block, the free queue, the block hashes.

- Block 0 is the null block: never allocated, freed or cached.
- Free blocks sit in a doubly-linked queue in LRU-eviction order; a prefix hit
  takes a block out of the middle in O(1).
- Full blocks are hashed as a chain (parent hash, token ids, extra keys). A
  freed block keeps its hash, so it can still be hit until it is reused.
"""
from __future__ import annotations

import hashlib
from array import array

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
