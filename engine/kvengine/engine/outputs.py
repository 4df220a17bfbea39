"""What the engine core sends the frontend after each step: plain, picklable records.

The frontend never reads the engine's objects (they live in another process):
tokens for the streams, and the stats vLLM V1's core sends its frontend
(SchedulerStats, IterationStats, finished requests) for the Prometheus metrics.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvengine.config import EngineConfig
from kvengine.core.request import Request
from kvengine.metrics.stats import RequestTimings, request_timings


@dataclass(slots=True)
class TokenOutput:
    """One token for a request's stream, or its end (token_id None: ended without one)."""

    request_id: str
    token_id: int | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class SchedulerStats:
    """The engine's state after a step: gauges, and running totals the frontend diffs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    reserved_tokens: int
    num_evictions: int
    prefix_queries: int
    prefix_hits: int
    num_cached_blocks: int | None  # None: the allocator has no prefix cache pool


@dataclass(slots=True)
class IterationStats:
    num_preempted: int
    num_generation_tokens: int
    # Tokens computed this step, as vLLM's histogram counts them: each sampled token, plus a
    # first token's prompt less its prefix-cache hit (cached tokens are not computed).
    num_iteration_tokens: int
    first_tokens: list[tuple[int, int, float]]  # (prompt tokens, cached tokens, ttft)
    inter_token_latencies: list[float]


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    n: int
    num_preemptions: int
    prefill_kv_computed: int
    timings: RequestTimings | None  # None: ended before its first token


@dataclass(slots=True)
class CoreOutputs:
    tokens: list[TokenOutput] = field(default_factory=list)
    scheduler: SchedulerStats | None = None
    iteration: IterationStats | None = None
    finished: list[FinishedRequestStats] = field(default_factory=list)
    replies: list[tuple[int, object]] = field(default_factory=list)  # (call id, result)
    dead: str | None = None  # the engine core died; this is why

    def __bool__(self) -> bool:
        return bool(self.tokens or self.iteration or self.finished or self.replies or self.dead)


@dataclass(slots=True)
class EngineInfo:
    """What the frontend learns once, when the core has built its engine."""

    config: EngineConfig  # resolved
    model_name: str
    num_gpu_blocks: int
    memory_log_lines: list[str]
    tokenizer: object
    scheduler: SchedulerStats


def scheduler_stats(engine) -> SchedulerStats:
    kv, sched = engine.kv, engine.scheduler
    return SchedulerStats(
        num_running=len(sched.running), num_waiting=len(sched.waiting), kv_cache_usage=kv.usage(),
        num_free_blocks=kv.num_free_blocks,
        reserved_tokens=(kv.num_usable_blocks - kv.num_free_blocks) * engine.config.block_size,
        num_evictions=kv.num_evictions, prefix_queries=kv.prefix_stats.queries,
        prefix_hits=kv.prefix_stats.hits, num_cached_blocks=kv.num_cached_blocks)


def iteration_stats(step) -> IterationStats:
    first_tokens, itls, iteration = [], [], 0
    for req, _ in step.new_tokens:
        times = req.token_times
        iteration += 1
        if len(times) == 1:
            cached = max(req.num_cached_tokens, 0)
            iteration += req.num_prompt_tokens - cached
            first_tokens.append((req.num_prompt_tokens, cached, times[0] - req.arrival_time))
        else:
            itls.append(times[-1] - times[-2])
    return IterationStats(len(step.preempted), len(step.new_tokens), iteration, first_tokens, itls)


def finished_stats(req: Request) -> FinishedRequestStats:
    produced = bool(req.token_times) and req.first_scheduled_time is not None
    return FinishedRequestStats(
        finish_reason=req.finish_reason or "error", prompt_tokens=req.num_prompt_tokens,
        generation_tokens=req.num_output_tokens, max_tokens=req.max_tokens, n=req.sampling_params.n,
        num_preemptions=req.num_preemptions,
        prefill_kv_computed=req.num_prompt_tokens - max(req.num_cached_tokens, 0),
        # the metrics use the latencies, not the per-token gaps (already sent step by step)
        timings=dataclasses.replace(request_timings(req), itl=()) if produced else None)
