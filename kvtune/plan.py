"""Capacity planning from the fault card's formulas, computed by kvengine.memory.

    KV bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes per element
    KV pool            = total × gpu_memory_utilization − weights − activation peak − overhead
                         (or − a fixed reserve instead of activation peak and overhead)
    concurrency at L   = pool blocks / blocks of one L-token request

For the KV dtype asked and fp8 side by side, plus what a contiguous worst-case
reservation at max_model_len would hold in the same pool instead.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
from kvengine.config import DeviceSpec, EngineConfig, ModelSpec
from kvengine.memory import kv_bytes_per_token, plan_memory

from .workload import Workload

FP8 = "fp8"
WORKLOAD_QUANTILES = (50, 95, 99)


@dataclass(frozen=True)
class PlannedModel(ModelSpec):
    """A ModelSpec whose weights size is given (a quantised or custom model) instead of counted from its shape."""

    weights_bytes: int | None = None

    @property
    def weight_bytes(self) -> int:
        return self.weights_bytes if self.weights_bytes is not None else super().weight_bytes


def custom_model(layers: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16", heads: int | None = None,
                 hidden_size: int | None = None, intermediate_size: int | None = None, vocab_size: int = 32000,
                 weights_bytes: int | None = None, max_len: int = 1 << 20) -> PlannedModel:
    """A model known by its attention shape; the rest (for the activation estimate) from Llama's proportions."""
    heads = heads or kv_heads
    hidden = hidden_size or heads * head_dim
    intermediate = intermediate_size or int(math.ceil(hidden * 8 / 3 / 256) * 256)
    return PlannedModel(f"custom {layers}L×{kv_heads}kv×{head_dim}", layers, hidden, heads, kv_heads, head_dim,
                        intermediate, vocab_size, max_len, dtype=dtype, weights_bytes=weights_bytes)


@dataclass
class DtypeCapacity:
    kv_cache_dtype: str
    kv_bytes_per_token: int
    pool_bytes: int
    num_gpu_blocks: int
    pool_tokens: int
    max_concurrency: dict[str, float]  # context length (as a string) -> requests at once
    contiguous_requests: int  # reserving max_model_len per request, in the same pool


@dataclass
class CapacityPlan:
    model: str
    model_dtype: str
    device: str
    total_bytes: int
    requested_bytes: int
    weights_bytes: int
    activation_bytes: int  # the reserve when one was given
    overhead_bytes: int
    reserve_given: bool
    config: EngineConfig
    contexts: list[int]
    workload_contexts: dict[str, int] = field(default_factory=dict)  # "p50" -> tokens
    by_dtype: list[DtypeCapacity] = field(default_factory=list)  # the asked dtype first, then fp8

    @property
    def primary(self) -> DtypeCapacity:
        return self.by_dtype[0]


def plan_capacity(model: ModelSpec, device: DeviceSpec, config: EngineConfig, contexts: list[int],
                  reserve_bytes: int | None = None) -> CapacityPlan:
    """Raises kvengine's KVCacheMemoryError when not even the weights (and reserve) fit."""
    resolved = config.resolve(model, device)
    if reserve_bytes is not None:  # the reserve replaces the activation estimate and the overhead
        device = dataclasses.replace(device, non_torch_overhead_bytes=0)
    # Sized without the one-request-at-max_model_len check: the plan reports that itself.
    unchecked = dataclasses.replace(resolved, max_model_len=resolved.block_size)
    memories = {dtype: plan_memory(model, device, dataclasses.replace(unchecked, kv_cache_dtype=dtype), reserve_bytes)
                for dtype in _dtypes(resolved.kv_cache_dtype)}
    first = next(iter(memories.values()))
    contexts = sorted(set(contexts))
    return CapacityPlan(
        model=model.name, model_dtype=model.dtype, device=device.name, total_bytes=first.total_bytes,
        requested_bytes=first.requested_bytes, weights_bytes=first.weights_bytes,
        activation_bytes=first.activation_bytes, overhead_bytes=first.overhead_bytes,
        reserve_given=reserve_bytes is not None, config=resolved, contexts=contexts,
        by_dtype=[_capacity(model, dtype, memory, contexts, resolved.max_model_len)
                  for dtype, memory in memories.items()])


def _dtypes(asked: str) -> list[str]:
    return [asked] if asked.startswith(FP8) else [asked, FP8]


def _capacity(model: ModelSpec, dtype: str, memory, contexts: list[int], max_model_len: int) -> DtypeCapacity:
    blocks_per_max_len = math.ceil(max_model_len / memory.block_size)
    return DtypeCapacity(
        kv_cache_dtype=dtype, kv_bytes_per_token=kv_bytes_per_token(model, dtype),
        pool_bytes=memory.kv_cache_bytes, num_gpu_blocks=memory.num_gpu_blocks, pool_tokens=memory.num_tokens,
        max_concurrency={str(c): memory.max_concurrency(c) for c in contexts},
        contiguous_requests=max(memory.num_usable_blocks, 0) // blocks_per_max_len)


def workload_contexts(workload: Workload) -> dict[str, int]:
    """p50/p95/p99 of input + output tokens per request, rounded up to whole tokens."""
    lengths = np.fromiter((r.input_length + r.output_length for r in workload.requests), dtype=np.int64)
    if not len(lengths):
        return {}
    return {f"p{q}": math.ceil(v) for q, v in zip(WORKLOAD_QUANTILES, np.percentile(lengths, WORKLOAD_QUANTILES))}
