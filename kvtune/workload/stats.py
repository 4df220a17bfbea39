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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import Workload
from .tokens import splitmix64, workload_token_arrays

_POSITION_BITS = np.uint64(32)


@dataclass
class PrefixReuse:
    prompt_tokens: int
    cached_tokens: int
    distinct_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefix_reuse(workload: Workload, block_size: int = 16) -> PrefixReuse:
    """Replay the prompts through an unbounded block cache (see the module docstring)."""
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
    return PrefixReuse(prompt_tokens, cached_tokens, len(cached))


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
    reuse = prefix_reuse(workload, block_size)
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
        "distinct_prefix_blocks": reuse.distinct_blocks,
        "ideal_cached_tokens": reuse.cached_tokens,
        "ideal_prefix_hit_rate": reuse.hit_rate,
        "skipped": workload.skipped,
        "failed": workload.failed,
    }
