"""The run's KV pool: how many blocks it had, and what another config would give.

A live server reports `num_gpu_blocks` in vllm:cache_config_info (kept in the
run's config); a sim run is re-planned from its model and device presets with
kvengine.core.memory, the same arithmetic the engine used to size its pool.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvengine.config import ConfigError, DeviceSpec, ModelSpec, device_preset, model_preset
from kvengine.core.memory import KVCacheMemoryError, kv_bytes_per_token, max_concurrency, plan_memory

from ..results import RunResult, engine_config



@dataclass
class Pool:
    num_gpu_blocks: int  # vLLM's count, the null block included
    block_size: int
    source: str

    @property
    def tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def holds_at(self, context_tokens: float) -> int:
        """Requests of this context the pool holds at once (vLLM's max concurrency, floored)."""
        return int(max_concurrency(self.num_gpu_blocks, self.block_size, max(math.ceil(context_tokens), 1)))


def specs(result: RunResult) -> tuple[ModelSpec, DeviceSpec] | None:
    """The presets the run names, when it names presets (sim runs, engine runs with --preset)."""
    try:
        return model_preset(result.model), device_preset(result.device)
    except ConfigError:
        return None


def pool_of(result: RunResult) -> Pool | None:
    cfg, block_size = result.config, engine_config(result.config).block_size
    for key, source in (("num_gpu_blocks", "the server's vllm:cache_config_info"),
                        ("num_gpu_blocks_override", "--num-gpu-blocks-override")):
        if cfg.get(key):
            return Pool(int(cfg[key]), block_size, source)
    return replan(result)


def replan(result: RunResult, **changes) -> Pool | None:
    """The pool kvengine.core.memory plans for the run's presets and config, with `changes` applied."""
    found = specs(result)
    if found is None:
        return None
    model, device = found
    try:
        config = engine_config(result.config, **changes).resolve(model, device)
        # Sized without the one-request-at-max_model_len check: only the pool's size is wanted.
        plan = plan_memory(model, device, dataclasses.replace(config, max_model_len=config.block_size))
    except (ConfigError, KVCacheMemoryError, TypeError, ValueError):
        return None
    return Pool(plan.num_gpu_blocks, plan.block_size, f"kvengine memory plan for {model.name} on {device.name}")


def fp8_gain(result: RunResult) -> float:
    """How many times more tokens the same memory holds with fp8 K/V (2 for a 16-bit model)."""
    found = specs(result)
    if found is None:
        return 2.0  # every served vLLM model in practice stores K/V in 16 bits under `auto`
    model, _ = found
    return kv_bytes_per_token(model, "auto") / kv_bytes_per_token(model, "fp8")
