"""The workload data model: requests with arrival times, lengths and prefix ids.

Arrival times are in seconds from the start of the trace (the kvtune JSONL
format stores milliseconds; the reader and writer convert).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DEFAULT_HASH_BLOCK_SIZE = 512  # Mooncake's tokens per hash id


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    `hash_ids` are prefix-block ids: equal ids mean equal token blocks, each id
    covers `hash_block_size` tokens of the prompt and the last may be partial.
    `prompt_token_ids`, when set, are the exact tokens to send.
    """

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    session_id: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None


@dataclass
class Workload:
    """Requests in arrival order, plus what the reader left out.

    `skipped` counts bad records dropped because the caller asked to skip them;
    `failed` counts requests the trace records without an answer (BurstGPT rows
    with 0 response tokens, ShareGPT human turns with no reply), which cannot be
    replayed.

    `max_concurrency` makes the replay a closed loop (vLLM's `vllm bench serve
    --max-concurrency`): at most that many requests in flight, a request due while they are
    waiting, in trace order, until one finishes. None: open loop, each request at its arrival.
    """

    requests: list[TraceRequest]
    hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE
    source: str = ""
    skipped: int = 0
    failed: int = 0
    max_concurrency: int | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        """Time from the first arrival to the last (0 for fewer than 2 requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate_rps(self) -> float:
        """Mean arrival rate: gaps per second over the trace's span.

        Counting gaps rather than requests makes a constant-rate trace report
        exactly its rate. 0 when every request arrives at once.
        """
        duration = self.duration_s
        return (len(self.requests) - 1) / duration if duration > 0 else 0.0

    def with_requests(self, requests: list[TraceRequest]) -> Workload:
        """The same workload (block size, source, counters, concurrency limit) with other requests."""
        return dataclasses.replace(self, requests=requests)

    def closed_loop(self, max_concurrency: int | None) -> Workload:
        """The same requests replayed with at most `max_concurrency` in flight (None: open loop)."""
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {max_concurrency}")
        return dataclasses.replace(self, max_concurrency=max_concurrency)


def blocks_for(input_length: int, hash_block_size: int) -> int:
    """How many hash ids a prompt of `input_length` tokens has."""
    return -(-input_length // hash_block_size)


__all__ = ["TraceRequest", "Workload", "DEFAULT_HASH_BLOCK_SIZE", "blocks_for"]
