"""The planner's capacity table for the study's model and device, at the workload's own context lengths."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from kvengine.config import ConfigError, EngineConfig, device_preset, model_preset
from kvengine.memory import KVCacheMemoryError

from ..plan import WORKLOAD_QUANTILES, CapacityPlan, plan_capacity, workload_contexts
from ..workload import TraceError, read_workload


@dataclass
class Capacity:
    plan: CapacityPlan | None
    source: str  # where the context lengths came from
    note: str = ""  # why there is no plan


def capacity_for(config: EngineConfig, preset: str | None, device: str | None, workload_path: str | None,
                 profile: dict | None) -> Capacity:
    """Auto (the model's dtype) and fp8 side by side, whatever dtype the config uses."""
    contexts, source = _contexts(workload_path, profile or {})
    try:
        model, dev = model_preset(preset or ""), device_preset(device or "")
        auto = dataclasses.replace(config, kv_cache_dtype="auto", num_gpu_blocks_override=None)
        plan = plan_capacity(model, dev, auto, list(contexts.values()) or [auto.resolve(model, dev).max_model_len])
    except (ConfigError, KVCacheMemoryError) as err:
        return Capacity(None, source, f"The planner cannot size this config: {err}")
    plan.workload_contexts = contexts
    return Capacity(plan, source)


def _contexts(path: str | None, profile: dict) -> tuple[dict[str, int], str]:
    """p50/p95/p99 of prompt + output tokens per request: from the trace when it is still there."""
    if path and os.path.exists(path):
        try:
            return workload_contexts(read_workload(path)), f"the workload {path}"
        except (TraceError, OSError, ValueError):
            pass
    inputs, outputs = profile.get("input_len") or {}, profile.get("output_len") or {}
    contexts = {f"p{q}": math.ceil(inputs[f"p{q}"] + outputs[f"p{q}"]) for q in WORKLOAD_QUANTILES
                if f"p{q}" in inputs and f"p{q}" in outputs}
    return contexts, ("the run's workload profile (prompt and output percentiles added: a slight over-estimate)"
                      if contexts else "none: the workload was not found")
