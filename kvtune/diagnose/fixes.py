"""Fixes as concrete flag changes, computed from the run's config, its pool and its contexts."""
from __future__ import annotations

import math

from .facts import RunFacts
from .model import FlagChange
from .pool import fp8_gain, replan

UTILIZATION_STEP = 0.05


def fp8_kv(f: RunFacts, why: str = "") -> FlagChange | None:
    dtype = f.config.get("kv_cache_dtype") or "auto"
    if dtype != "auto":
        return None
    gain = fp8_gain(f.result)
    effect = why
    if f.pool:
        effect = f"pool {f.pool.tokens:,} → {int(f.pool.tokens * gain):,} tokens" + (f", {why}" if why else "")
    return FlagChange("--kv-cache-dtype", dtype, "fp8", effect)


CPU_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"
POOL_GROWTH = 1.5  # where a size fixes the pool, the fix asks for half as much again


def raise_utilization(f: RunFacts) -> FlagChange | None:
    """A few points more of the device for the pool, never past the suggested ceiling; where
    the pool is sized another way (CPU vLLM's VLLM_CPU_KVCACHE_SPACE, --kv-cache-memory-bytes)
    utilisation does nothing, and the fix grows that knob instead."""
    if f.config.get("num_gpu_blocks_override"):
        return None
    sized = grow_fixed_pool(f)
    if sized is not None:
        return sized
    current = f.config.get("gpu_memory_utilization")
    ceiling = f.th.max_suggested_utilization
    if current is None or current >= ceiling:
        return None
    target = round(min(current + UTILIZATION_STEP, ceiling), 2)
    bigger = replan(f.result, gpu_memory_utilization=target)
    effect = f"pool {f.pool.tokens:,} → {bigger.tokens:,} tokens" if bigger and f.pool else ""
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


def cap_max_num_seqs(f: RunFacts) -> FlagChange | None:
    fit = seqs_that_fit(f)
    current = f.max_num_seqs
    if fit is None or (current is not None and current <= fit):
        return None
    return FlagChange("--max-num-seqs", current, fit,
                      f"what the {f.pool.tokens:,}-token pool holds at the p99 context of "
                      f"{f.contexts.p99:,.0f} tokens")


def lower_max_model_len(f: RunFacts) -> FlagChange | None:
    """Down to the workload's p99 context (whole blocks), when the limit is far above it."""
    current = f.config.get("max_model_len")
    if not current or f.contexts is None:
        return None
    block = int(f.config.get("block_size") or 16)
    target = int(math.ceil(f.contexts.p99 / block) * block)
    if current < 2 * target:
        return None
    return FlagChange("--max-model-len", current, target, "the p99 context; longer requests are refused")
