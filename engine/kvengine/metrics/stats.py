"""Latencies derived from a request's timestamps, exactly as vLLM defines them.

    queue     = first scheduled - arrival
    ttft      = first token - arrival
    prefill   = first token - first scheduled (includes preemptions)
    decode    = last token - first token
    inference = last token - first scheduled
    e2e       = last token - arrival
    tpot      = decode / (generated tokens - 1), or 0 with one token
    itl       = the gaps between consecutive tokens
"""
from __future__ import annotations

from dataclasses import dataclass

from kvengine.core.request import Request


@dataclass(frozen=True, slots=True)
class RequestTimings:
    request_id: str
    arrival: float
    queue: float
    ttft: float
    prefill: float
    decode: float
    inference: float
    e2e: float
    tpot: float
    itl: tuple[float, ...]
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    num_preemptions: int
    finish_reason: str | None


def request_timings(req: Request) -> RequestTimings:
    """For a finished request that produced at least one token."""
    times = req.token_times
    if not times or req.first_scheduled_time is None:
        raise ValueError(f"request {req.request_id!r} produced no token")
    first, last = times[0], times[-1]
    n = len(times)
    decode = last - first
    return RequestTimings(
        request_id=req.request_id,
        arrival=req.arrival_time,
        queue=req.first_scheduled_time - req.arrival_time,
        ttft=first - req.arrival_time,
        prefill=first - req.first_scheduled_time,
        decode=decode,
        inference=last - req.first_scheduled_time,
        e2e=last - req.arrival_time,
        tpot=decode / (n - 1) if n > 1 else 0.0,
        itl=tuple(b - a for a, b in zip(times, times[1:])),
        prompt_tokens=req.num_prompt_tokens,
        output_tokens=req.num_output_tokens,
        cached_tokens=max(req.num_cached_tokens, 0),
        num_preemptions=req.num_preemptions,
        finish_reason=req.finish_reason,
    )
