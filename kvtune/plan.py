"""Capacity planning from the fault card's formulas, computed by kvengine.core.memory.

    KV bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes per element
    KV pool            = total × gpu_memory_utilization − weights − activation peak − overhead
                         (or − a fixed reserve instead of activation peak and overhead)
    concurrency at L   = pool blocks / blocks of one L-token request

For the KV dtype asked and fp8 side by side, plus what a contiguous worst-case
reservation at max_model_len would hold in the same pool instead.

`plan_server_pool` does the same for a pool a live server reports (vllm:cache_config_info):
its blocks are the tokens that fit, its bytes per token the server's own, and the other
dtype is the same memory at that dtype's element size.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import numpy as np
from kvengine.config import (
    DTYPE_BYTES,
    DeviceSpec,
    EngineConfig,
    GiB,
    ModelSpec,
    device_preset,
    model_preset,
)
from kvengine.core.memory import (KVCacheMemoryError, kv_bytes_per_token, kv_elements_per_token, max_concurrency,
                                  plan_memory, served_shard)

from .results import Launch
from .targets.rules import CPU_KV_SPACE_ENV
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

    def tp_shard(self, tp: int) -> "PlannedModel":
        shard = super().tp_shard(tp)
        given = None if self.weights_bytes is None else math.ceil(self.weights_bytes / tp)
        return dataclasses.replace(shard, weights_bytes=given) if tp > 1 else shard


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
class ModelChoice:
    """The model `kvtune plan` and the UI's planner are asked about: one of a preset, a Hugging
    Face config (a config.json or its folder), or a custom shape (layers, kv_heads, head_dim)."""
    preset: str | None = None
    hf_config: str | None = None
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    heads: int | None = None
    dtype: str = "bfloat16"
    weights_gib: float | None = None


def planned_model(choice: ModelChoice) -> PlannedModel:
    custom = [choice.layers, choice.kv_heads, choice.head_dim]
    chosen = sum(x is not None for x in (choice.preset, choice.hf_config, choice.layers))
    if chosen > 1:
        raise ValueError("give one model: --preset, --hf-config, or --layers/--kv-heads/--head-dim")
    weights = None if choice.weights_gib is None else int(choice.weights_gib * GiB)
    if any(x is not None for x in custom):
        if None in custom:
            raise ValueError("a custom model needs --layers, --kv-heads and --head-dim")
        return custom_model(choice.layers, choice.kv_heads, choice.head_dim, choice.dtype, choice.heads,
                            weights_bytes=weights)
    spec = _hf_model(choice.hf_config) if choice.hf_config else model_preset(choice.preset or "llama-3-8b")
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return PlannedModel(**fields, weights_bytes=weights)


def _hf_model(path: str) -> ModelSpec:
    """A config.json (or its folder), read where it is: every complaint names that file."""
    from kvengine.model.hf_config import CheckpointError, model_spec_from_config_path

    if not os.path.exists(path):
        raise ValueError(f"--hf-config {path}: no such file or folder")
    try:
        return model_spec_from_config_path(path)
    except CheckpointError as err:
        raise ValueError(f"--hf-config {err}") from None


def planned_device(name: str | None, memory_bytes: int | None) -> DeviceSpec:
    """A device preset (default h100-80gb), its memory replaced by `memory_bytes` when given."""
    if name is None and memory_bytes is not None:
        base = device_preset("h100-80gb")  # its overhead estimate; the memory is the user's
        return dataclasses.replace(base, name=f"{memory_bytes / GiB:g} GiB device", memory_bytes=memory_bytes)
    device = device_preset(name or "h100-80gb")
    if memory_bytes is not None:
        device = dataclasses.replace(device, name=f"{device.name} ({memory_bytes / GiB:g} GiB)",
                                     memory_bytes=memory_bytes)
    return device

@dataclass(frozen=True)
class ServerPool:
    """A live server's KV pool as it reports it (vllm:cache_config_info, kept in the run's config)."""

    num_gpu_blocks: int  # vLLM's count, the null block included
    block_size: int
    kv_cache_dtype: str  # as the server ran it: auto, fp8..., or the served dtype's name
    pool_bytes: int | None = None  # kv_cache_memory_bytes, where the server reports it
    set_by: str = ""  # what sized it, for the reader: "VLLM_CPU_KVCACHE_SPACE=1"

    @property
    def tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens"."""
        return self.num_gpu_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int | None:
        """The server's own K/V bytes per token (its pool's bytes over its tokens), when it reports the bytes."""
        return self.pool_bytes // self.tokens if self.pool_bytes and self.tokens else None


def server_pool_of(config: dict) -> ServerPool | None:
    """The pool a live run's server reported (num_gpu_blocks, or kv_cache_size_tokens, and block_size)."""
    block_size, blocks = label_int(config.get("block_size")), label_int(config.get("num_gpu_blocks"))
    tokens = label_int(config.get("kv_cache_size_tokens"))
    if block_size and not blocks and tokens:
        blocks = tokens // block_size
    if not block_size or not blocks:
        return None
    pool_bytes = label_int(config.get("kv_cache_memory_bytes"))
    env = launch.env if (launch := Launch.of(config)) else {}
    if env.get(CPU_KV_SPACE_ENV) is not None:
        set_by = f"set by {CPU_KV_SPACE_ENV}={env[CPU_KV_SPACE_ENV]}"
    elif pool_bytes:
        set_by = "set by --kv-cache-memory-bytes"
    elif config.get("num_gpu_blocks_override"):
        set_by = "set by --num-gpu-blocks-override"
    elif config.get("gpu_memory_utilization") is not None:
        set_by = f"sized by `gpu_memory_utilization` {float(config['gpu_memory_utilization']):.2f} of the device"
    else:
        set_by = ""
    return ServerPool(blocks, block_size, str(config.get("kv_cache_dtype") or "auto"), pool_bytes, set_by)


def label_int(value) -> int | None:
    """A config value or info label ("8", 8) as a positive integer; None for anything else."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def served_dtype(model: ModelSpec, pool: ServerPool) -> str | None:
    """The dtype a live server keeps `model`'s K/V in under kv_cache_dtype auto, where its reported pool
    says so and it is not the preset's; else None. vLLM's `--dtype auto` serves a float32 checkpoint
    in bf16 (fp16 on some devices), which holds twice the tokens in the same pool bytes: a simulator
    left on the preset's float32 halves that server's pool. The size is the one whose blocks of the
    pool's bytes are the blocks the server reports (its count is the floor of that division)."""
    if pool.kv_cache_dtype in DTYPE_BYTES:
        size = DTYPE_BYTES[pool.kv_cache_dtype]
    elif pool.kv_cache_dtype != "auto" or not pool.pool_bytes:
        return None
    else:
        block_elements = kv_elements_per_token(model) * pool.block_size
        size = next((n for n in (4, 2) if pool.pool_bytes // (n * block_elements) == pool.num_gpu_blocks),
                    element_bytes_from(pool.bytes_per_token, model))
    if size is None or size == model.dtype_bytes:
        return None
    return {2: "bfloat16", 4: "float32"}.get(size)


@dataclass
class DtypeCapacity:
    kv_cache_dtype: str
    kv_bytes_per_token: int | None  # None: a live pool of unknown bytes and model shape
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
    server_pool: ServerPool | None = None  # set: the plan describes this live pool, not the planner's
    auto_element_bytes: int | None = None  # live plans: bytes per K/V element under `auto`
    auto_dtype_source: str = ""  # live plans: how that was found ("the server's bytes per token", ...)
    refusal: str = ""  # vLLM would not start: the pool cannot hold one request of max_model_len

    @property
    def primary(self) -> DtypeCapacity:
        return self.by_dtype[0]

    @property
    def pool_fixed(self) -> bool:
        """The planner's pool is --kv-cache-memory-bytes (or the server's environment), not utilisation."""
        return (self.server_pool is None and self.config.kv_cache_memory_bytes is not None
                and self.config.num_gpu_blocks_override is None)


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
    try:
        plan_memory(model, device, resolved, reserve_bytes)
        refusal = ""
    except KVCacheMemoryError as err:
        refusal = str(err)
    return CapacityPlan(refusal=refusal, 
        model=model.name, model_dtype=model.dtype, device=device.name, total_bytes=first.total_bytes,
        requested_bytes=first.requested_bytes, weights_bytes=first.weights_bytes,
        activation_bytes=first.activation_bytes, overhead_bytes=first.overhead_bytes,
        reserve_given=reserve_bytes is not None, config=resolved, contexts=contexts,
        by_dtype=[_capacity(served_shard(model, resolved), dtype, memory, contexts,
                            resolved.max_model_len)
                  for dtype, memory in memories.items()])


def _dtypes(asked: str) -> list[str]:
    return [asked] if asked.startswith(FP8) else [asked, FP8]


def _capacity(model: ModelSpec, dtype: str, memory, contexts: list[int], max_model_len: int) -> DtypeCapacity:
    """One GPU's capacity at `dtype`; `model` is that GPU's shard."""
    blocks_per_max_len = memory.blocks_per_request(max_model_len)
    return DtypeCapacity(
        kv_cache_dtype=dtype, kv_bytes_per_token=kv_bytes_per_token(model, dtype),
        pool_bytes=memory.kv_cache_bytes, num_gpu_blocks=memory.num_gpu_blocks, pool_tokens=memory.num_tokens,
        max_concurrency={str(c): memory.max_concurrency(c) for c in contexts},
        contiguous_requests=max(memory.num_usable_blocks, 0) // blocks_per_max_len)


def is_one_byte(kv_cache_dtype: str) -> bool:
    """fp8 (any variant) and int8 store one byte per K/V element."""
    return kv_cache_dtype.startswith(FP8) or kv_cache_dtype == "int8"


def element_bytes_from(bytes_per_token: int | None, model: ModelSpec | None) -> int | None:
    """The bytes per K/V element a server's bytes per token mean for the model's shape: 1, 2 or 4,
    else None (no bytes, no shape, or a shape that is not the served model's)."""
    if not bytes_per_token or model is None:
        return None
    elements = kv_elements_per_token(model)
    size, rest = divmod(bytes_per_token, elements)
    return size if size in (1, 2, 4) and rest * 100 < elements else None


def plan_server_pool(pool: ServerPool, model: ModelSpec | None, contexts: list[int],
                     max_model_len: int | None, config: EngineConfig, device: str = "",
                     auto_element_bytes: int | None = None, auto_source: str = "") -> CapacityPlan:
    """The plan of a pool a live server reports: `auto` and fp8 side by side in its memory.

    The run's dtype column is the server's own (its blocks, its bytes per token); the other
    column is the same memory at the other dtype's bytes per element: fp8 one, `auto` the
    served dtype's, which the server's bytes per token give for `auto` runs, else
    `auto_element_bytes` (another live run's, say), else the model preset's."""
    served = pool.kv_cache_dtype
    run_is_auto = not is_one_byte(served)
    model_bytes = model.dtype_bytes if model is not None else 2  # served models store K/V in 16 bits
    auto_bytes, source = None, auto_source
    if served in DTYPE_BYTES:  # `auto` reported as the served dtype itself
        auto_bytes, source = DTYPE_BYTES[served], "the server's reported dtype"
    elif run_is_auto:
        auto_bytes = element_bytes_from(pool.bytes_per_token, model)
        source = "the server's bytes per token" if auto_bytes else ""
    if auto_bytes is None:
        auto_bytes, source = auto_element_bytes, (auto_source if auto_element_bytes else "")
    if auto_bytes is None:
        auto_bytes = model_bytes
        source = (f"assumed: the preset's {model.dtype}" if model is not None else "assumed: 16-bit")
    run_bytes = auto_bytes if run_is_auto else 1
    run_bpt = pool.bytes_per_token or (kv_elements_per_token(model) * run_bytes if model is not None else None)
    pool_bytes = pool.pool_bytes or (run_bpt * pool.tokens if run_bpt else None)
    columns = [("auto", auto_bytes), (FP8 if run_is_auto else served, 1)]
    contexts = sorted(set(contexts))
    by_dtype = []
    for dtype, element_bytes in columns:
        blocks = pool.num_gpu_blocks * run_bytes // element_bytes
        bpt = None if run_bpt is None else (run_bpt if element_bytes == run_bytes
                                            else run_bpt * element_bytes // run_bytes)
        by_dtype.append(DtypeCapacity(
            kv_cache_dtype=dtype, kv_bytes_per_token=bpt, pool_bytes=pool_bytes, num_gpu_blocks=blocks,
            pool_tokens=blocks * pool.block_size,
            max_concurrency={str(c): max_concurrency(blocks, pool.block_size, c) for c in contexts},
            contiguous_requests=(max(blocks - 1, 0) // math.ceil(max_model_len / pool.block_size)
                                 if max_model_len else 0)))
    dtype_label = {4: "float32", 2: "16-bit", 1: "8-bit"}.get(auto_bytes, f"{auto_bytes} bytes")
    if model is not None and model.dtype_bytes == auto_bytes:
        dtype_label = model.dtype
    return CapacityPlan(
        model=model.name if model is not None else "", model_dtype=dtype_label, device=device, total_bytes=0,
        requested_bytes=0, weights_bytes=0, activation_bytes=0, overhead_bytes=0, reserve_given=False,
        config=dataclasses.replace(config, block_size=pool.block_size, max_model_len=max_model_len,
                                   kv_cache_dtype=served if not run_is_auto else "auto"),
        contexts=contexts, by_dtype=by_dtype, server_pool=pool, auto_element_bytes=auto_bytes,
        auto_dtype_source=source)


def workload_contexts(workload: Workload) -> dict[str, int]:
    """p50/p95/p99 of input + output tokens per request, rounded up to whole tokens."""
    lengths = np.fromiter((r.input_length + r.output_length for r in workload.requests), dtype=np.int64)
    if not len(lengths):
        return {}
    return {f"p{q}": math.ceil(v) for q, v in zip(WORKLOAD_QUANTILES, np.percentile(lengths, WORKLOAD_QUANTILES))}
