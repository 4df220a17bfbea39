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
from kvengine.model.spec import quantized


class KVCacheMemoryError(RuntimeError):
    """The engine cannot start: the KV pool cannot hold what the config asks."""


def kv_element_bytes(kv_cache_dtype: str, model: ModelSpec) -> int:
    if kv_cache_dtype == "auto":
        return model.dtype_bytes
    return 1  # fp8 variants and int8 store one byte per element (scales are per block/head)


def kv_elements_per_token_layer(model: ModelSpec) -> int:
    """One layer's cache of one token: K and V of each K/V head, or MLA's one latent
    (kv_lora_rank + qk_rope_head_dim, no separate V: vLLM's MLAAttentionSpec)."""
    if model.uses_mla:
        return model.kv_lora_rank + model.qk_rope_head_dim
    return 2 * model.num_kv_heads * model.head_dim


def kv_elements_per_token(model: ModelSpec) -> int:
    """Every layer's cache of one token held in full (a sliding layer's too, inside its window)."""
    return model.num_layers * kv_elements_per_token_layer(model)


def kv_bytes_per_token(model: ModelSpec, kv_cache_dtype: str = "auto") -> int:
    """Every layer's cache of one token, at the KV dtype's bytes per element."""
    return kv_elements_per_token(model) * kv_element_bytes(kv_cache_dtype, model)


@dataclass(frozen=True)
class KVGroups:
    """vLLM's KV cache groups (`get_kv_cache_groups`): every group has `layers_per_group`
    layers of one kind and draws its block ids from the one shared pool, so one block id
    costs a page in each layer of the widest group."""

    layers_per_group: int
    kinds: tuple[str, ...]  # one per group: "full", "sliding" or "mla"
    window: int | None  # the sliding layers' window

    def blocks_per_request(self, context_len: int, block_size: int, in_flight_tokens: int) -> int:
        """Blocks one request of `context_len` tokens holds at most, all groups together
        (vLLM's max_memory_usage_bytes per group over the page): a sliding group keeps the
        window and the tokens in flight, plus one block where the window starts mid-block."""
        full = -(-context_len // block_size)
        if self.window is None:
            return full * len(self.kinds)
        window = self.sliding_blocks(context_len, block_size, in_flight_tokens)
        return sum(window if kind == "sliding" else full for kind in self.kinds)

    def sliding_blocks(self, context_len: int, block_size: int, in_flight_tokens: int) -> int:
        """A sliding group's most blocks for one request (vLLM's max_admission_blocks_per_request)."""
        return -(-min(self.window - 1 + in_flight_tokens, context_len) // block_size) + 1


def kv_groups(model: ModelSpec) -> KVGroups:
    """One group of every layer when they are all alike; else each kind's layers split into
    groups of one size: the rarest kind's count, or the commonest's when that is under 1.5x
    it (vLLM's `_get_kv_cache_groups_uniform_page_size`; every kind here has one page size)."""
    kinds = model.attention_kinds
    window = model.sliding_window if "sliding" in kinds else None
    counts = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    if len(counts) == 1:
        return KVGroups(model.num_layers, tuple(counts), window)
    smallest, largest = min(counts.values()), max(counts.values())
    size = largest if largest < 1.5 * smallest else smallest
    return KVGroups(size, tuple(kind for kind, n in counts.items() for _ in range(-(-n // size))), window)


def kv_bytes_per_block(model: ModelSpec, kv_cache_dtype: str, block_size: int) -> int:
    """What one block id costs in the pool: a page of `block_size` tokens in each layer of a group."""
    page = block_size * kv_elements_per_token_layer(model) * kv_element_bytes(kv_cache_dtype, model)
    return kv_groups(model).layers_per_group * page


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
    groups: KVGroups | None = None  # None: one group of full-attention layers
    in_flight_tokens: int = 0  # tokens scheduled and not yet settled: a sliding window keeps them too

    @property
    def num_usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def num_tokens(self) -> int:
        """The pool's blocks times the block size: the tokens one layer group holds."""
        return self.num_gpu_blocks * self.block_size

    def blocks_per_request(self, context_len: int) -> int:
        if self.groups is None:
            return math.ceil(context_len / self.block_size)
        return self.groups.blocks_per_request(context_len, self.block_size, self.in_flight_tokens)

    def max_concurrency(self, context_len: int) -> float:
        """Requests of `context_len` tokens the pool holds at once (vLLM's formula)."""
        return self.num_gpu_blocks / self.blocks_per_request(context_len)

    def log_lines(self, max_model_len: int) -> list[str]:
        """The lines vLLM prints at start-up, for operators who grep for them."""
        how = "measured by a profile run" if self.activation_measured else "estimated"
        return [
            f"Memory profiling: model weights take {self.weights_bytes / GiB:.2f} GiB; "
            f"non-torch memory takes {self.overhead_bytes / GiB:.2f} GiB; activation peak "
            f"memory takes {self.activation_bytes / GiB:.2f} GiB ({how}); the rest of "
            f"{self.requested_bytes / GiB:.2f} GiB is reserved for KV cache.",
            f"Available KV cache memory: {self.kv_cache_bytes / GiB:.2f} GiB",
            # vLLM's get_kv_cache_capacity: the max concurrency times max_model_len (blocks times the
            # block size where every layer is full attention)
            f"GPU KV cache size: {int(self.max_concurrency(max_model_len) * max_model_len):,} tokens",
            f"Maximum concurrency for {max_model_len:,} tokens per request: "
            f"{self.max_concurrency(max_model_len):.2f}x",
        ]


def max_concurrency(num_gpu_blocks: int, block_size: int, context_len: int) -> float:
    """Requests of `context_len` tokens a pool of full-attention blocks holds at once."""
    blocks_per_request = math.ceil(context_len / block_size)
    return num_gpu_blocks / blocks_per_request


def plan_memory(model: ModelSpec, device: DeviceSpec, config: EngineConfig,
                activation_bytes: int | None = None) -> MemoryPlan:
    """Size the KV pool; raise KVCacheMemoryError as vLLM fails at start-up.

    `activation_bytes` is a measured activation peak (the torch executor's
    profiling pass); without one, the estimate is used."""
    unresolved = None in (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens)
    cfg = config.resolve(model, device) if unresolved else config
    model = served_shard(model, cfg)  # everything below is one GPU's
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
            "Use a device with more memory or split the model over more GPUs (--tensor-parallel-size).")
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
                      activation_bytes is not None, kv_groups(model),
                      concurrent_batches(device) * cfg.max_num_batched_tokens)
    _check_fits_one_request(plan, model, cfg)
    return plan


def served_shard(model: ModelSpec, config: EngineConfig) -> ModelSpec:
    """One GPU's share of the model as `config` serves it: its --quantization, then its
    --tensor-parallel-size (the one place both apply; the memory plan and the step cost read it)."""
    return quantized(model, config.quantization).tp_shard(config.tensor_parallel_size)


def concurrent_batches(device: DeviceSpec) -> int:
    """Steps in flight at once: two with a GPU's async scheduling, one on the CPU (vLLM's
    `max_concurrent_batches`, no pipeline parallelism)."""
    return 1 if device.platform == "cpu" else 2


def _check_fits_one_request(plan: MemoryPlan, model: ModelSpec, cfg: EngineConfig) -> None:
    needed_blocks = plan.blocks_per_request(cfg.max_model_len)
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
