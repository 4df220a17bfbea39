"""The capacity table for the study's model and device, at the workload's own context lengths.

When the headline run is a live one whose server reported its KV pool (vllm:cache_config_info:
num_gpu_blocks, block_size, kv_cache_memory_bytes), the table describes that pool, so the page
never shows a planner's pool next to a different measured one; otherwise it is the planner's."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from kvengine.config import (
    DTYPE_BYTES,
    ConfigError,
    EngineConfig,
    ModelSpec,
    device_preset,
    model_preset,
)
from kvengine.core.memory import KVCacheMemoryError

from ..plan import (
    WORKLOAD_QUANTILES,
    CapacityPlan,
    ServerPool,
    element_bytes_from,
    is_one_byte,
    label_int,
    plan_capacity,
    plan_server_pool,
    server_pool_of,
    workload_contexts,
)
from ..results import RunResult
from ..search.report_data import RunView
from ..store import RunNotFoundError, Store, StoreError
from ..workload import TraceError, read_workload


@dataclass
class Capacity:
    plan: CapacityPlan | None
    source: str  # where the context lengths came from
    note: str = ""  # why there is no plan


def capacity_for(config: EngineConfig, preset: str | None, device: str | None, workload_path: str | None,
                 profile: dict | None, run: RunView | None = None, db_url: str | None = None,
                 live_run_ids: list[int | None] = ()) -> Capacity:
    """Auto (the model's dtype) and fp8 side by side, whatever dtype the config uses.

    `run`: the headline run; a live one whose config reports its pool is described as it is.
    `db_url` and `live_run_ids`: the study's other live runs, read only when the headline run's
    dtype is fp8 and one of them, run under `auto`, tells the served dtype's bytes per element."""
    contexts, source = _contexts(workload_path, profile or {})
    pool = server_pool_of(run.result.config) if run is not None and run.stage == "live" else None
    if pool is not None:
        return _live_capacity(pool, run, config, preset, device, contexts, source, db_url, live_run_ids)
    try:
        model, dev = model_preset(preset or ""), device_preset(device or "")
        auto = dataclasses.replace(config, kv_cache_dtype="auto", num_gpu_blocks_override=None)
        plan = plan_capacity(model, dev, auto, list(contexts.values()) or [auto.resolve(model, dev).max_model_len])
    except (ConfigError, KVCacheMemoryError) as err:
        return Capacity(None, source, f"The planner cannot size this config: {err}")
    plan.workload_contexts = contexts
    return Capacity(plan, source)


def _live_capacity(pool: ServerPool, run: RunView, config: EngineConfig, preset: str | None, device: str | None,
                   contexts: dict[str, int], source: str, db_url: str | None,
                   live_run_ids: list[int | None]) -> Capacity:
    model = _model(preset)
    max_len = (label_int(run.result.config.get("max_model_len")) or config.max_model_len
               or (model.max_position_embeddings if model is not None else None))
    hint, hint_source = (None, "")
    if is_one_byte(pool.kv_cache_dtype):  # its pool says nothing of `auto`'s bytes: ask the study's auto runs
        hint, hint_source = _auto_bytes_elsewhere(pool, run, model, db_url, live_run_ids)
    plan = plan_server_pool(pool, model, list(contexts.values()) or ([max_len] if max_len else []), max_len,
                            config, device or run.result.device, hint, hint_source)
    if model is None:
        plan.model = preset or run.result.model
    plan.workload_contexts = contexts
    return Capacity(plan, source)


def _auto_bytes_elsewhere(pool: ServerPool, run: RunView, model: ModelSpec | None, db_url: str | None,
                          run_ids: list[int | None]) -> tuple[int | None, str]:
    """Bytes per K/V element under `auto`, from another live run of this study on the same server and model."""
    ids = [i for i in dict.fromkeys(run_ids) if i is not None and i != run.run_id]
    if not db_url or not ids:
        return None, ""
    try:
        store = Store(db_url)
    except StoreError:
        return None, ""
    try:
        for run_id in ids:
            try:
                other = store.load_run(run_id)
            except RunNotFoundError:
                continue
            found = _auto_bytes_of(other, run.result, pool, model)
            if found is not None:
                return found, f"live run {run_id}, served with `auto`"
    finally:
        store.close()
    return None, ""


def _auto_bytes_of(other: RunResult, run: RunResult, pool: ServerPool, model: ModelSpec | None) -> int | None:
    if (other.target, other.model) != (run.target, run.model):
        return None
    theirs = server_pool_of(other.config or {})
    if theirs is None or is_one_byte(theirs.kv_cache_dtype):
        return None
    if theirs.kv_cache_dtype in DTYPE_BYTES:
        return DTYPE_BYTES[theirs.kv_cache_dtype]
    size = element_bytes_from(theirs.bytes_per_token, model)
    if size is None and theirs.bytes_per_token and pool.bytes_per_token:  # no shape: the ratio to ours (1 byte)
        ratio = theirs.bytes_per_token / pool.bytes_per_token
        size = next((n for n in (2, 4) if abs(ratio - n) < 0.01 * n), None)
    return size


def _model(preset: str | None) -> ModelSpec | None:
    try:
        return model_preset(preset or "")
    except ConfigError:
        return None


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
