"""Fixes as concrete flag changes, computed from the run's config, its pool and its contexts."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..targets.sim import engine_config
from .facts import RunFacts
from .model import FlagChange
from .pool import fp8_gain, replan

UTILIZATION_STEP = 0.05


def fp8_kv(f: RunFacts, why: str = "") -> FlagChange | None:
    """8-bit K/V; for room only where the pool is sized in bytes: --num-gpu-blocks-override fixes the
    block count, so fp8 then halves the bytes each step reads but holds not one token more."""
    dtype = f.config.get("kv_cache_dtype") or "auto"
    if dtype != "auto" or (not why and f.config.get("num_gpu_blocks_override")):
        return None
    if f.config.get("num_gpu_blocks_override"):
        return FlagChange("--kv-cache-dtype", dtype, "fp8", why)
    gain = fp8_gain(f.result)
    effect = why
    if f.pool:
        effect = f"pool {f.pool.tokens:,} → {int(f.pool.tokens * gain):,} tokens" + (f", {why}" if why else "")
    return FlagChange("--kv-cache-dtype", dtype, "fp8", effect)


def fp8_gain_of(f: RunFacts) -> float:
    return fp8_gain(f.result)


CPU_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"


def on_cpu(f: RunFacts) -> bool:
    """The server ran on a CPU: a CPU device (kvengine's, CPU vLLM's label), or a pool sized by
    CPU vLLM's VLLM_CPU_KVCACHE_SPACE. Tensor parallelism over GPUs means nothing there."""
    devices = (f.result.device, f.config.get("device"), f.config.get("vllm_platform"))
    if any(isinstance(d, str) and "cpu" in d.lower() for d in devices):
        return True
    return CPU_KV_SPACE in (f.config.get("launch_env") or {})
POOL_GROWTH = 1.5  # where a size fixes the pool, the fix asks for half as much again


def raise_utilization(f: RunFacts) -> FlagChange | None:
    """A few points more of the device for the pool, never past the suggested ceiling; where
    the pool is sized another way (CPU vLLM's VLLM_CPU_KVCACHE_SPACE, --kv-cache-memory-bytes)
    utilisation does nothing, and the fix grows that knob instead."""
    sized = grow_fixed_pool(f)
    if sized is not None:
        return sized
    current = f.config.get("gpu_memory_utilization")
    ceiling = f.th.max_suggested_utilization
    if current is None or current >= ceiling:
        return None
    target = round(min(current + UTILIZATION_STEP, ceiling), 2)
    # The plan's growth applied to the pool the run had (a server's may differ from the plan)
    now, bigger = replan(f.result), replan(f.result, gpu_memory_utilization=target)
    effect = ""
    if now and bigger and f.pool:
        effect = f"pool {f.pool.tokens:,} → {f.pool.tokens * bigger.num_gpu_blocks // now.num_gpu_blocks:,} tokens"
    return FlagChange("--gpu-memory-utilization", current, target, effect)


def grow_fixed_pool(f: RunFacts) -> FlagChange | None:
    """The pool's own size knob, half as large again, where the server's pool has one."""
    space = (f.config.get("launch_env") or {}).get(CPU_KV_SPACE)
    grown = f"pool {f.pool.tokens:,} → {int(f.pool.tokens * POOL_GROWTH):,} tokens" if f.pool else ""
    if space is not None:
        try:
            gib = float(space)
        except ValueError:
            return None
        return FlagChange(CPU_KV_SPACE, space, f"{gib * POOL_GROWTH:g}",
                          grown + (", " if grown else "") + "GiB of host memory for the KV pool "
                          "(gpu_memory_utilization is ignored while it is set)")
    blocks = f.config.get("num_gpu_blocks_override")
    if blocks:
        return FlagChange("--num-gpu-blocks-override", blocks, int(blocks * POOL_GROWTH),
                          grown + (", " if grown else "") + "the pool's size is fixed in blocks: "
                          "utilisation and fp8 do not change it")
    nbytes = f.config.get("kv_cache_memory_bytes")
    if nbytes:
        return FlagChange("--kv-cache-memory-bytes", nbytes, int(nbytes * POOL_GROWTH), grown)
    return None


def more_kv_room(f: RunFacts) -> list[FlagChange]:
    return [c for c in (fp8_kv(f), raise_utilization(f)) if c]


def seqs_that_fit(f: RunFacts) -> int | None:
    """The max_num_seqs the pool holds at the workload's p99 context."""
    if f.pool is None or f.contexts is None:
        return None
    return max(f.pool.holds_at(f.contexts.p99), 1)


@dataclass
class Concurrency:
    """Little's law: the requests the arrivals keep in service at once, L = lambda × W."""

    rate: float  # requests arriving per second
    service_s: float  # mean seconds a request is in service (scheduled to finished)

    @property
    def needed(self) -> int:
        return max(math.ceil(self.rate * self.service_s), 1)

    @property
    def text(self) -> str:
        return f"{self.rate:.2f} req/s × {self.service_s:.2f} s in service each"


def arrival_rate(f: RunFacts) -> float | None:
    arrivals = sorted(r.arrival_s for r in f.result.requests)
    if len(arrivals) >= 2 and arrivals[-1] > arrivals[0]:
        return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    finished = f.series.total("requests_finished")
    return finished / f.series.span_s if finished and f.series.span_s > 0 else None


def service_time(f: RunFacts) -> float | None:
    """Mean seconds from scheduled to finished. The queue wait is left out: it is what a starved
    queue adds, not what a request needs. Clients of a live server do not see the wait; there the
    TTFT stands in for it (it also leaves out the prefill, so the time is if anything short)."""
    times = [r.e2e_s - (r.queue_s if r.queue_s is not None else r.ttft_s)
             for r in f.requests if r.e2e_s is not None]
    if times:
        return max(float(np.mean(times)), 0.0)
    s = f.result.summary
    e2e, queue = s.get("server_e2e_p50"), s.get("server_queue_p50")
    return e2e - queue if e2e is not None and queue is not None and e2e > queue else None


def concurrency_needed(f: RunFacts) -> Concurrency | None:
    rate, service = arrival_rate(f), service_time(f)
    if not rate or not service:
        return None
    return Concurrency(rate, service)


def at_least_needed(f: RunFacts, target: int) -> int:
    """A max_num_seqs no lower than the arrivals need: below it the queue only grows."""
    need = concurrency_needed(f)
    return max(target, need.needed) if need is not None else target


def cap_max_num_seqs(f: RunFacts) -> FlagChange | None:
    """What the pool holds at the p99 context, offered only where that still serves the arrivals:
    a cap below L starves the queue (TTFT and e2e grow without bound), and then the fix is more pool."""
    fit = seqs_that_fit(f)
    current = f.max_num_seqs
    if fit is None or (current is not None and current <= fit):
        return None
    need = concurrency_needed(f)
    if need is not None and fit < need.needed:
        return None
    effect = f"what the {f.pool.tokens:,}-token pool holds at the p99 context of {f.contexts.p99:,.0f} tokens"
    if need is not None:
        effect += f"; the arrivals need {need.needed} ({need.text})"
    return FlagChange("--max-num-seqs", current, fit, effect)


def lower_max_model_len(f: RunFacts) -> FlagChange | None:
    """Down to the workload's longest request (whole blocks), when the limit is far above it: a
    limit under the longest request would refuse it."""
    current = f.config.get("max_model_len")
    if not current or f.contexts is None:
        return None
    block = engine_config(f.config).block_size
    longest = max(f.contexts.longest, f.contexts.p99)
    target = int(math.ceil(longest / block) * block)
    if current < 2 * target:
        return None
    return FlagChange("--max-model-len", current, target, f"the longest request ({longest:,.0f} tokens) still fits")
