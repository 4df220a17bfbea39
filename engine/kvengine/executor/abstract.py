"""Executors run a scheduled batch and return one sampled token per finished prefill.

`SimExecutor` runs no model: the step takes the roofline cost model's time and
samples deterministic pseudo tokens. The torch executor (real forward passes)
implements the same `Executor` protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvengine.config import EngineConfig
from kvengine.executor.cost import StepCost, StepShape, step_shape
from kvengine.core.kv_manager import KVManager
from kvengine.core.scheduler import SchedulerOutput

# Pseudo tokens stay inside the id range every common tokenizer accepts and
# never hit special tokens (so the simulator never emits EOS).
SIM_TOKEN_LOW, SIM_TOKEN_HIGH = 1000, 30000


@dataclass(slots=True)
class ExecutorOutput:
    sampled: list[int | None]  # aligned with SchedulerOutput.scheduled
    step_time_s: float


class Executor(Protocol):
    """What LLMEngine calls, in this order: the first two once, at start-up."""

    def profile_activation_bytes(self, config: EngineConfig) -> int | None:
        """The activation peak a step at `config`'s limits needs, before the pool is
        sized; None: memory.plan_memory estimates it."""

    def initialize_cache(self, num_gpu_blocks: int, kv_manager: KVManager) -> None:
        """Allocate the KV cache for the pool the engine sized."""

    def execute(self, out: SchedulerOutput) -> ExecutorOutput: ...


class SimExecutor:
    def __init__(self, cost: StepCost):
        self.cost = cost

    def profile_activation_bytes(self, config: EngineConfig) -> None:
        return None  # no model runs: the memory plan's estimate stands

    def initialize_cache(self, num_gpu_blocks: int, kv_manager: KVManager) -> None:
        pass  # no KV tensors to allocate

    def execute(self, out: SchedulerOutput) -> ExecutorOutput:
        span = SIM_TOKEN_HIGH - SIM_TOKEN_LOW
        sampled: list[int | None] = []
        for req in out.scheduled:
            n = len(req.all_token_ids)
            if req.num_computed_tokens < n:
                sampled.append(None)  # mid-prefill chunk: no logits sampled
            else:
                seed = req.all_token_ids[0] if n else 0
                sampled.append(SIM_TOKEN_LOW + (seed * 7919 + n * 104729) % span)
        shape = step_shape(out, sampled, self.cost.attention_key_block, self.cost.context_chunk_all_keys,
                           self.cost.block_size, self.cost.window)
        return ExecutorOutput(sampled, self.step_time(shape))

    def step_time(self, shape: StepShape) -> float:
        return self.cost.step_time(shape)
