"""KV-cache memory arithmetic: bytes per token and block, the pool, concurrency.

`plan_memory` follows vLLM's `determine_available_memory` + `get_num_blocks`:
    requested = ceil(total * gpu_memory_utilization)
    available = requested - weights - activation peak - non-torch overhead
    num_gpu_blocks = available // bytes_per_block (all layers)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvengine.config import GiB, DeviceSpec, EngineConfig, ModelSpec


class KVCacheMemoryError(RuntimeError):
    """The engine cannot start: the KV pool cannot hold what the config asks."""


def kv_element_bytes(kv_cache_dtype: str, model: ModelSpec) -> int:
    if kv_cache_dtype == "auto":
        return model.dtype_bytes
    return 1  # fp8 variants and int8 store one byte per element (scales are per block/head)


def kv_elements_per_token(model: ModelSpec) -> int:
    """K and V, every layer: 2 * layers * kv_heads * head_dim."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim


def kv_bytes_per_token(model: ModelSpec, kv_cache_dtype: str = "auto") -> int:
    """K and V, every layer, at the KV dtype's bytes per element."""
    return kv_elements_per_token(model) * kv_element_bytes(kv_cache_dtype, model)


def kv_bytes_per_block(model: ModelSpec, kv_cache_dtype: str, block_size: int) -> int:
    return kv_bytes_per_token(model, kv_cache_dtype) * block_size


def activation_peak_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Estimated torch peak of vLLM's profile run at `max_num_batched_tokens`.

    The largest live set of one layer: the residual stream and normed input,
    q/k/v, the gate and up projections and their product; plus fp32 logits for
    one sampled token per sequence.
    """
    h, inter = model.hidden_size, model.intermediate_size
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_token = (2 * h + qkv + 3 * inter) * model.dtype_bytes
    logits = min(max_num_seqs, max_num_batched_tokens) * model.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int
    requested_bytes: int
    weights_bytes: int
    activation_bytes: int
    overhead_bytes: int
    kv_cache_bytes: int
    block_bytes: int
    block_size: int
    num_gpu_blocks: int  # includes vLLM's null block
    activation_measured: bool = False  # a profile run's peak, not the estimate

    @property
    def num_usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def num_tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens"."""
        return self.num_gpu_blocks * self.block_size

    def max_concurrency(self, context_len: int) -> float:
        return max_concurrency(self.num_gpu_blocks, self.block_size, context_len)

    def log_lines(self, max_model_len: int) -> list[str]:
        """The lines vLLM prints at start-up, for operators who grep for them."""
        how = "measured by a profile run" if self.activation_measured else "estimated"
        return [
            f"Memory profiling: model weights take {self.weights_bytes / GiB:.2f} GiB; "
            f"non-torch memory takes {self.overhead_bytes / GiB:.2f} GiB; activation peak "
            f"memory takes {self.activation_bytes / GiB:.2f} GiB ({how}); the rest of "
            f"{self.requested_bytes / GiB:.2f} GiB is reserved for KV cache.",
            f"Available KV cache memory: {self.kv_cache_bytes / GiB:.2f} GiB",
            f"GPU KV cache size: {self.num_tokens:,} tokens",
            f"Maximum concurrency for {max_model_len:,} tokens per request: "
            f"{self.max_concurrency(max_model_len):.2f}x",
        ]


def max_concurrency(num_gpu_blocks: int, block_size: int, context_len: int) -> float:
    """Requests of `context_len` tokens the pool holds at once (vLLM's formula)."""
    blocks_per_request = math.ceil(context_len / block_size)
    return num_gpu_blocks / blocks_per_request


def plan_memory(model: ModelSpec, device: DeviceSpec, config: EngineConfig,
                activation_bytes: int | None = None) -> MemoryPlan:
    """Size the KV pool; raise KVCacheMemoryError as vLLM fails at start-up.

    `activation_bytes` is a measured activation peak (the torch executor's
    profiling pass); without one, the estimate is used."""
    unresolved = None in (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens)
    cfg = config.resolve(model, device) if unresolved else config
    block_bytes = kv_bytes_per_block(model, cfg.kv_cache_dtype, cfg.block_size)
    requested = math.ceil(device.memory_bytes * cfg.gpu_memory_utilization)
    weights = model.weight_bytes
    activation = (activation_peak_bytes(model, cfg.max_num_batched_tokens, cfg.max_num_seqs)
                  if activation_bytes is None else activation_bytes)
    overhead = device.non_torch_overhead_bytes
    available = requested - weights - activation - overhead
    if cfg.num_gpu_blocks_override is not None:
        num_blocks = cfg.num_gpu_blocks_override
        available = num_blocks * block_bytes
    elif cfg.kv_cache_memory_bytes is not None:  # vLLM: the given bytes, utilisation unused
        available = cfg.kv_cache_memory_bytes
        num_blocks = available // block_bytes
    elif weights >= requested:
        raise KVCacheMemoryError(
            f"The model weights ({weights / GiB:.2f} GiB) do not fit in {device.name} x "
            f"gpu_memory_utilization {cfg.gpu_memory_utilization} = {requested / GiB:.2f} GiB. "
            "Use a device with more memory or shard the model (tensor parallelism).")
    elif available <= 0:
        raise KVCacheMemoryError(
            f"No available memory for the cache blocks: {device.name} x "
            f"gpu_memory_utilization {cfg.gpu_memory_utilization} = {requested / GiB:.2f} GiB, "
            f"but weights take {weights / GiB:.2f} GiB, the activation peak at "
            f"max_num_batched_tokens={cfg.max_num_batched_tokens} {activation / GiB:.2f} GiB "
            f"and other overhead {overhead / GiB:.2f} GiB. Try increasing "
            "`gpu_memory_utilization` or decreasing `max_num_batched_tokens`.")
    else:
        num_blocks = available // block_bytes
    plan = MemoryPlan(device.memory_bytes, requested, weights, activation, overhead,
                      available, block_bytes, cfg.block_size, int(num_blocks),
                      activation_bytes is not None)
    _check_fits_one_request(plan, model, cfg)
    return plan


def _check_fits_one_request(plan: MemoryPlan, model: ModelSpec, cfg: EngineConfig) -> None:
    needed_blocks = math.ceil(cfg.max_model_len / cfg.block_size)
    if plan.num_usable_blocks >= needed_blocks:
        return
    needed = needed_blocks * plan.block_bytes
    estimated_len = max(0, plan.num_usable_blocks) * cfg.block_size
    raise KVCacheMemoryError(
        f"To serve at least one request with the model's max seq len ({cfg.max_model_len}), "
        f"({needed / GiB:.2f} GiB KV cache is needed, which is larger than the available KV "
        f"cache memory ({plan.kv_cache_bytes / GiB:.2f} GiB). Based on the available memory, "
        f"the estimated maximum model length is {estimated_len}. Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
