"""Fixes as concrete flag changes, computed from the run's config, its pool and its contexts.

Every change is one the run's server takes (kvtune.targets.rules: its types and ranges, and the knob
that sizes its pool); a change of a limit a request can hit says what it refuses (`refusal`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..results import Launch, RunResult, engine_config
from ..targets.rules import CPU_KV_SPACE_ENV as CPU_KV_SPACE
from ..targets.rules import OVERRIDE, SIZE_KNOBS, UTILIZATION, TargetRules, as_number, run_rules
from .facts import RunFacts
from .model import FlagChange
from .pool import Pool, fp8_gain, pool_of, replan

UTILIZATION_STEP = 0.05
POOL_GROWTH = 1.5  # where a size fixes the pool, the fix asks for half as much again


def rules_of(result: RunResult) -> TargetRules:
    """What the run's server takes, and what sizes its pool."""
    return run_rules(result.config, result.target, result.device)


def fp8_kv(f: RunFacts, why: str = "") -> FlagChange | None:
    """8-bit K/V; for room only where it grows the pool: --num-gpu-blocks-override fixes the block
    count, so fp8 then cuts the bytes each step reads but holds not one token more."""
    dtype = f.config.get("kv_cache_dtype") or "auto"
    rules = rules_of(f.result)
    if dtype != "auto" or rules.refuses("--kv-cache-dtype", "fp8"):
        return None
    if not rules.moves_pool("--kv-cache-dtype"):
        return FlagChange("--kv-cache-dtype", dtype, "fp8", why) if why else None
    gain = fp8_gain(f.result)
    effect = why
    if f.pool:
        effect = f"pool {f.pool.tokens:,} → {int(f.pool.tokens * gain):,} tokens" + (f", {why}" if why else "")
    return FlagChange("--kv-cache-dtype", dtype, "fp8", effect)


def fp8_gain_of(f: RunFacts) -> float:
    return fp8_gain(f.result)


def fp8_bytes_text(result: RunResult, what: str = "the K/V bytes every decode step reads") -> str:
    """What fp8 K/V does to the bytes of `what`: the real gain over the model's own K/V dtype."""
    gain = fp8_gain(result)
    if math.isclose(gain, 2.0):
        return f"halves {what}"
    return f"cuts {what} to 1/{gain:g} (8 bits in place of the model's {8 * gain:g}-bit K/V)"


def on_cpu(f: RunFacts) -> bool:
    """The server ran on a CPU: a CPU device (kvengine's, CPU vLLM's label), or a pool sized by
    CPU vLLM's VLLM_CPU_KVCACHE_SPACE. Tensor parallelism over GPUs means nothing there."""
    devices = (f.result.device, f.config.get("device"), f.config.get("vllm_platform"))
    if any(isinstance(d, str) and "cpu" in d.lower() for d in devices):
        return True
    launch = Launch.of(f.config)
    return launch is not None and CPU_KV_SPACE in launch.env


def raise_utilization(f: RunFacts) -> FlagChange | None:
    """A few points more of the device for the pool, never past the suggested ceiling; where
    the pool is sized another way (an override, --kv-cache-memory-bytes, CPU vLLM's
    VLLM_CPU_KVCACHE_SPACE) utilisation does nothing, and the fix grows that knob instead."""
    sized = grow_fixed_pool(f)
    if sized is not None or not rules_of(f.result).moves_pool(UTILIZATION):
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
    """The pool's own size knob, half as large again, where a size (not utilisation) fixes it."""
    return pool_change(f.result, POOL_GROWTH, f.pool)


POOL_WHY = {
    OVERRIDE: "the pool's size is fixed in blocks: utilisation, VLLM_CPU_KVCACHE_SPACE and fp8 do not change it",
    CPU_KV_SPACE: "whole GiB of host memory for the KV pool (gpu_memory_utilization is ignored while it is set)",
}


def pool_change(result: RunResult, growth: float, pool: Pool | None = None, effect: str | None = None) \
        -> FlagChange | None:
    """The knob that sizes the run's pool (the rules' pool_knob: an override in force beats
    VLLM_CPU_KVCACHE_SPACE, the bytes and utilisation), `growth` times its size and rounded to a
    value the server takes (up when growing); None where utilisation sizes the pool."""
    rules = rules_of(result)
    knob, old = rules.pool_knob, rules.pool_size
    if knob == UTILIZATION or old is None:
        return None
    try:
        wanted = float(old) * growth
    except ValueError:
        return None
    new = rules.taken(knob, wanted, up=growth >= 1)  # a count or whole GiB rounds away from the old size
    if new is None or float(new) == float(old):
        return None
    if effect is None:
        grown = f"pool {pool.tokens:,} → {int(pool.tokens * float(new) / float(old)):,} tokens" if pool else ""
        effect = ", ".join(t for t in (grown, POOL_WHY.get(knob, "")) if t)
    return FlagChange(knob, old, new, effect)


def size_growth(result: RunResult, change: FlagChange) -> float | None:
    """How many times the pool's tokens a change of a size knob asks for, where known."""
    if change.flag == UTILIZATION:
        now, then = replan(result), replan(result, gpu_memory_utilization=change.new)
        return then.num_gpu_blocks / now.num_gpu_blocks if now and then and now.num_gpu_blocks else None
    try:
        return float(change.new) / float(change.old) if float(change.old) else None
    except (TypeError, ValueError):
        return None


def admitted(result: RunResult, change: FlagChange, lengths: list[tuple[int, int]] | None = None) \
        -> FlagChange | None:
    """`change` as the run's server takes it, before it is tried or printed: a size knob that does not
    size this server's pool becomes the same growth of the one that does; a value the server refuses
    becomes the nearest it takes (None where there is none); a limit says what it refuses."""
    rules = rules_of(result)
    if change.flag in SIZE_KNOBS and not rules.moves_pool(change.flag):
        growth = size_growth(result, change)
        grown = pool_change(result, growth, pool_of(result)) if growth else None
        if grown is not None:
            grown.effect += f"; in place of `{change.flag} {change.old} → {change.new}`, which does not size this pool"
        return grown
    if rules.refuses(change.flag, change.new):
        old, new = as_number(change.old), as_number(change.new)
        up = old is None or new is None or new >= old
        new = rules.taken(change.flag, change.new, up=up)
        if new is None or new == change.old:
            return None
        change = FlagChange(change.flag, change.old, new, change.effect)
    return limit_noted(result.config, change, lengths)


# -- limits a request can hit ---------------------------------------------------------------------------

MAX_TOKENS = "max_tokens"  # a cap on the requests' own max_tokens (the clients'), not a server flag
MEASURES = {  # what a limit bounds: the tokens of a request it counts, and the words for them
    "context": (lambda p, o: p + o, "reject", "requests (prompt + output)", "requests longer than"),
    "prompt": (lambda p, o: p, "reject", "prompts", "requests with prompts longer than"),
    "output": (lambda p, o: o, "truncate", "outputs", "requests with outputs longer than"),
}


@dataclass
class Refusal:
    """What a lowered limit refuses: requests longer than `limit` tokens by `measure` (MEASURES: prompt +
    output for max_model_len, the prompt for a batch budget without chunked prefill, the output for a
    max_tokens cap); of a trace, how many."""

    limit: int
    measure: str
    over: int | None = None  # None: no trace to count against
    total: int | None = None

    @property
    def text(self) -> str:
        _, verb, alone, of_trace = MEASURES[self.measure]
        if self.over is None:
            return f"{verb}s {alone} longer than {self.limit:,} tokens"
        return f"would {verb} {self.over} of {self.total} {of_trace} {self.limit:,} tokens"


def request_limit(config: dict, change: FlagChange) -> tuple[int, str] | None:
    """The longest request `change` lets through and what it measures (MEASURES); None where it bounds
    none or raises the bound. max_model_len bounds prompt + output (vLLM refuses a longer prompt and cuts
    the output short), max_num_batched_tokens the prompt where chunked prefill is off, a max_tokens cap
    the output."""
    if change.flag == "--max-model-len":
        measure = "context"
    elif change.flag == "--max-num-batched-tokens" and config.get("enable_chunked_prefill") is False:
        measure = "prompt"
    elif change.flag == MAX_TOKENS:
        measure = "output"
    else:
        return None
    new, old = as_number(change.new), as_number(change.old)
    if new is None or (old is not None and new >= old):
        return None
    return int(new), measure


def refusal(config: dict, change: FlagChange, lengths: list[tuple[int, int]] | None = None) -> Refusal | None:
    """What `change` refuses: with `lengths` (the trace's prompt and output tokens per request) the requests
    it refuses that the current limit lets through; without, the bound alone."""
    found = request_limit(config, change)
    if found is None:
        return None
    limit, measure = found
    if lengths is None:
        return Refusal(limit, measure)
    old = as_number(change.old) or math.inf
    sizes = [MEASURES[measure][0](p, o) for p, o in lengths]
    return Refusal(limit, measure, sum(limit < n <= old for n in sizes), len(sizes))


def limit_noted(config: dict, change: FlagChange, lengths: list[tuple[int, int]] | None = None) -> FlagChange:
    """A limit's change with what it refuses in its text, once (the trace's count where there is one)."""
    found = refusal(config, change, lengths)
    if found is None or found.over:  # refusing requests of the trace: its trial says so, and it is not printed
        return change
    note = found.text if found.over is None else f"{MEASURES[found.measure][1]}s none of the trace's {found.total} requests"
    if note in change.effect:
        return change
    return FlagChange(change.flag, change.old, change.new, "; ".join(t for t in (change.effect, note) if t))


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
    a cap below L starves the queue (TTFT and e2e grow without bound), and then the fix is more pool.
    Where L is not known (no arrivals or service times to read) no cap is offered: it could be the one
    that starves them (a watched server running 8 was told 2)."""
    fit = seqs_that_fit(f)
    current = f.max_num_seqs
    if fit is None or (current is not None and current <= fit):
        return None
    need = concurrency_needed(f)
    if need is None or fit < need.needed:
        return None
    effect = (f"what the {f.pool.tokens:,}-token pool holds at the p99 context of {f.contexts.p99:,.0f} tokens; "
              f"the arrivals need {need.needed} ({need.text})")
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
    return limit_noted(f.config, FlagChange("--max-model-len", current, target,
                                            f"the longest request ({longest:,.0f} tokens) still fits"))
