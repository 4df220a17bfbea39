"""Workload statistics, including the ideal prefix-cache hit rate.

The ideal hit rate is the share of prompt tokens an unbounded prefix cache
with `block_size`-token blocks would serve, replaying requests in arrival
order, as vLLM's automatic prefix caching does:

* a block is identified by its tokens and every token before it (a chain), so
  it matches only if all blocks before it match too;
* a request is served its longest run of leading full blocks already cached,
  but never its last prompt token (vLLM recomputes it to get logits), so at
  most input_length - 1 tokens, rounded down to whole blocks;
* afterwards all of its full prompt blocks are cached (outputs are not: a
  multi-turn trace re-sends them inside the next prompt anyway).

It runs on the requests' real token ids (`prompt_token_ids`), so it is exact
for any block size, not only multiples of the trace's hash block size.

Beside it, the same pass counts the prompt tokens in full blocks whose content an
earlier request also sent *at any block position* (`block_repeats`): content a
cache could share if it came first. Far more of it than the ideal hit rate is a
template problem with a varying head: a per-request header (a date, an id) in
front of a long shared body makes every chain differ from its first block on.
Blocks are compared at block-aligned positions, so a body is found behind a head
of any fixed length, not behind heads whose length varies from request to request.
A long trace is judged by the requests of its first 2**18 full blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from .model import Workload
from .tokens import splitmix64, workload_token_arrays

_POSITION_BITS = np.uint64(32)
_CONTENT_SALT = np.uint64(0x3C6EF372FE94F82B)


@dataclass
class PrefixReuse:
    prompt_tokens: int
    cached_tokens: int
    distinct_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class BlockRepeats:
    """Full prompt blocks whose content an earlier request also sent, at any block position."""

    repeated_tokens: int
    head_tokens: float  # median, over the requests with a repeated block: tokens before the first one
    body_tokens: float  # median, over the same requests: tokens in their repeated blocks


def prefix_reuse(workload: Workload, block_size: int = 16) -> PrefixReuse:
    """Replay the prompts through an unbounded block cache (see the module docstring)."""
    return _replay(workload, block_size, None)


def _replay(workload: Workload, block_size: int, contents: ContentHashes | None) -> PrefixReuse:
    """The cache replay; `contents`, where given, also takes every prompt's block content hashes."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    cached: set[int] = set()
    prompt_tokens = cached_tokens = 0
    for tokens in workload_token_arrays(workload):
        prompt_tokens += len(tokens)
        hashes = block_chain_hashes(tokens, block_size)
        servable = hashes[: max(len(tokens) - 1, 0) // block_size]
        hits = 0
        for block in servable:
            if block not in cached:
                break
            hits += 1
        cached_tokens += hits * block_size
        cached.update(hashes)
        if contents is not None:
            contents.add(tokens)
    return PrefixReuse(prompt_tokens, cached_tokens, len(cached))


class ContentHashes:
    """block_content_hashes of the prompts, hashed in batches (one numpy call per prompt costs more than
    the hashing itself), of the first MAX_BLOCKS blocks' requests: plenty to see a template, and a long
    trace's stats stay about as fast as the cache replay alone."""

    BATCH_TOKENS = 1 << 20
    MAX_BLOCKS = 1 << 18

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.prompt_tokens = 0  # of the requests taken
        self._blocks = 0
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._done: list[np.ndarray] = []
        self._counts: list[int] = []

    def add(self, tokens: np.ndarray) -> None:
        blocks = len(tokens) // self.block_size
        if self._blocks + blocks > self.MAX_BLOCKS and self._counts:
            return
        self._blocks += blocks
        self._counts.append(blocks)
        self.prompt_tokens += len(tokens)
        self._pending.append(tokens[:blocks * self.block_size])
        self._pending_tokens += blocks * self.block_size
        if self._pending_tokens >= self.BATCH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._done.append(block_content_hashes(np.concatenate(self._pending), self.block_size))
        self._pending, self._pending_tokens = [], 0

    def counts(self) -> np.ndarray:
        return np.array(self._counts, dtype=np.int64)

    def hashes(self) -> np.ndarray:
        self._flush()
        return np.concatenate(self._done) if self._done else np.empty(0, dtype=np.uint64)


def block_content_hashes(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """One 64-bit hash per full block of its own tokens (and their order), whatever came before it:
    a dot product with odd per-offset weights (wrapping), cheap beside the chain hashes."""
    full = len(tokens) // block_size * block_size
    blocks = tokens[:full].reshape(-1, block_size)
    return (blocks * _offset_weights(block_size)).sum(axis=1, dtype=np.uint64)


@cache
def _offset_weights(block_size: int) -> np.ndarray:
    return splitmix64(np.arange(block_size, dtype=np.uint64) ^ _CONTENT_SALT) | np.uint64(1)


def block_repeats(contents: ContentHashes) -> BlockRepeats:
    return _repeats(contents.counts(), contents.hashes(), contents.block_size)


def _repeats(counts: np.ndarray, hashes: np.ndarray, block_size: int) -> BlockRepeats:
    """`counts[i]` full blocks of request i, their content `hashes` in request order."""
    if not len(hashes):
        return BlockRepeats(0, 0.0, 0.0)
    owner = np.repeat(np.arange(len(counts)), counts)
    repeated = _sent_before(hashes, owner)
    per_request = np.bincount(owner, repeated, len(counts))
    having = per_request > 0
    if not having.any():
        return BlockRepeats(0, 0.0, 0.0)
    hit = np.flatnonzero(repeated)  # in request order, so each request's first one opens its run
    first = hit[np.r_[True, owner[hit][1:] != owner[hit][:-1]]]
    head = first - (np.cumsum(counts) - counts)[owner[first]]
    return BlockRepeats(len(hit) * block_size, float(np.median(head)) * block_size,
                        float(np.median(per_request[having])) * block_size)


def _sent_before(hashes: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """For each block, whether a request before its own sent the same content. One sort; only the
    contents sent more than once are looked at further (in most traces, few are)."""
    repeated = np.zeros(len(hashes), dtype=bool)
    order = np.argsort(hashes)
    ordered = hashes[order]
    again = ordered[1:] == ordered[:-1]
    if not again.any():
        return repeated
    shared = np.r_[again, False] | np.r_[False, again]
    blocks, opens = order[shared], np.r_[True, ~again][shared]
    owners = owner[blocks]
    earliest = np.minimum.reduceat(owners, np.flatnonzero(opens))
    repeated[blocks] = owners > earliest[np.cumsum(opens) - 1]
    return repeated


def block_chain_hashes(tokens: np.ndarray, block_size: int) -> list[int]:
    """One 64-bit hash per full block, each covering the block and all before it.

    A block's hash is the wrapping sum of a mix of (token, position) over the
    whole prefix it ends: a cumulative sum gives every block's at once.
    """
    full = len(tokens) // block_size * block_size
    if full == 0:
        return []
    keys = (tokens[:full] << _POSITION_BITS) | np.arange(full, dtype=np.uint64)
    return np.cumsum(splitmix64(keys), dtype=np.uint64)[block_size - 1::block_size].tolist()


def percentiles(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0, "mean": 0.0}
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99),
            "max": int(values.max()), "mean": float(values.mean())}


def workload_stats(workload: Workload, block_size: int = 16) -> dict:
    """Counts, rate, length percentiles and the ideal prefix-cache hit rate."""
    requests = workload.requests
    contents = ContentHashes(block_size)
    reuse = _replay(workload, block_size, contents)
    repeats = block_repeats(contents)
    inputs = np.fromiter((r.input_length for r in requests), dtype=np.int64, count=len(requests))
    outputs = np.fromiter((r.output_length for r in requests), dtype=np.int64, count=len(requests))
    return {
        "source": workload.source,
        "requests": len(requests),
        "duration_s": workload.duration_s,
        "rate_rps": workload.rate_rps,
        "input_len": percentiles(inputs),
        "output_len": percentiles(outputs),
        "prompt_tokens": reuse.prompt_tokens,
        "output_tokens": int(outputs.sum()),
        "sessions": len({r.session_id for r in requests if r.session_id is not None}),
        "block_size": block_size,
        # tokens per hash id the prompts were made with; None when no request has hash ids
        "hash_block_size": workload.hash_block_size if any(r.hash_ids for r in requests) else None,
        "distinct_prefix_blocks": reuse.distinct_blocks,
        "ideal_cached_tokens": reuse.cached_tokens,
        "ideal_prefix_hit_rate": reuse.hit_rate,
        # the template figures: prompt tokens in blocks repeated at any position, and where they sit
        "repeated_block_share": repeats.repeated_tokens / contents.prompt_tokens if contents.prompt_tokens else 0.0,
        "repeated_head_tokens": repeats.head_tokens,
        "repeated_body_tokens": repeats.body_tokens,
        "skipped": workload.skipped,
        "failed": workload.failed,
    }
