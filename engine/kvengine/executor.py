"""Executors run a scheduled batch and return one sampled token per finished prefill.

`SimExecutor` runs no model: the step takes the roofline cost model's time and
samples deterministic pseudo tokens. The torch executor (real forward passes)
implements the same `Executor` protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .config import EngineConfig
from .cost import StepCost
from .kv_manager import KVManager
from .scheduler import SchedulerOutput, kernel_pairs

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
        return ExecutorOutput(sampled, self.step_time(step_shape(out, sampled, self.cost.attention_key_block,
                                                                 self.cost.context_chunk_all_keys)))

    def step_time(self, shape: tuple[int, ...]) -> float:
        return self.cost.step_time(*shape)


# A step_shape's fields: StepCost.step_time's parameters, in order.
STEP_SHAPE_FIELDS = ("num_tokens", "num_seqs", "context_tokens", "attention_token_pairs", "num_samples",
                     "num_prefills", "num_busy_arrivals", "decode_token_pairs", "context_chunk_pairs")
SHAPE_FIELDS = len(STEP_SHAPE_FIELDS)


def step_shape(out: SchedulerOutput, sampled: list[int | None], key_block: int = 0,
               all_keys_after_context: bool = False) -> tuple[int, ...]:
    """StepCost.step_time's inputs for a scheduled step: tokens, sequences, context,
    attention pairs (those the kernel computes, scheduler.kernel_pairs), sampled tokens,
    prefill chunks (requests computing more than one token), requests arriving beside
    running ones (admitted for the first time, not resumed), the decodes' attention
    pairs (one query against its context, after the step), and the part of the pairs
    that prefill chunks after earlier context compute (a prefix hit's, a long prompt's
    later chunks)."""
    admitted = out.scheduled[len(out.scheduled) - out.num_new_reqs:]
    busy = len(out.scheduled) > out.num_new_reqs
    pairs, chunk_pairs = out.attention_token_pairs, out.context_chunk_pairs
    if key_block or all_keys_after_context:  # a decode's one query attends to its whole context anyway
        fresh = chunk_pairs = 0
        for req, n in zip(out.scheduled, out.num_new_tokens):
            if n > 1:
                chunk = kernel_pairs(n, req.num_computed_tokens, key_block, all_keys_after_context)
                if req.num_computed_tokens > n:
                    chunk_pairs += chunk
                else:
                    fresh += chunk
        pairs = out.decode_token_pairs + fresh + chunk_pairs
    return (out.total_tokens, len(out.scheduled), out.context_tokens, pairs,
            sum(1 for token in sampled if token is not None),
            sum(1 for n in out.num_new_tokens if n > 1),
            sum(1 for req in admitted if req.num_preemptions == 0) if busy else 0,
            out.decode_token_pairs, chunk_pairs)
