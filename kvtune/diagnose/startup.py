"""F5: out of memory, or a failed start, although the KV pool looked large enough.

A failed run has no series: only its error text and its config. The fix is
computed with kvengine.memory where the run names model and device presets
(the smallest utilisation or batch budget that starts), else it follows the
fault card's rules of thumb.
"""
from __future__ import annotations

import math
import re

import numpy as np
from kvengine.config import ConfigError, GiB
from kvengine.memory import KVCacheMemoryError, activation_peak_bytes, plan_memory

from ..results import RunResult
from .facts import RunFacts
from .model import Diagnosis, Evidence, FlagChange, Thresholds, join_fixes
from .pool import engine_config, specs

MEMORY_MARKERS = ("out of memory", "outofmemory", "do not fit", "to serve at least one request",
                  "no available memory", "memory")
MAX_LEN_HINT = re.compile(r"estimated maximum model length is (\d+)")
MAX_LEN_ASKED = re.compile(r"max seq len \((\d+)\)")
UTILIZATION_CUT = 0.07  # the card's example: 0.92 → 0.85
CAUSE = ("memory outside the KV pool: prefill activations at max_num_batched_tokens, CUDA graphs, other "
         "processes (and fragmentation with contiguous allocators)")


def is_memory_error(text: str | None) -> bool:
    return bool(text) and any(marker in text.lower() for marker in MEMORY_MARKERS)


def failed_start(result: RunResult, error: str, th: Thresholds) -> Diagnosis | None:
    """F5 for a run that never started (or died): its error text and its config."""
    if not is_memory_error(error):
        return None
    lowered = error.lower()
    if "to serve at least one request" in lowered:
        cause = "the KV pool left after weights, activations and overhead cannot hold one max_model_len request"
        fixes = [_max_len_from_hint(result, error), _utilization_that_starts(result), _fp8(result)]
    elif "no available memory" in lowered:
        cause = "nothing is left for the KV pool after the weights, the activation peak and the overhead"
        fixes = [_batched_tokens_that_start(result), _utilization_that_starts(result)]
    elif "do not fit" in lowered:
        cause = "the share of the device given to the engine cannot hold even the weights"
        fixes = [_utilization_that_starts(result) or
                 "the weights need more memory than this device has: `--tensor-parallel-size 2` or a larger device"]
    else:  # an OOM at run time: the pool left too little for everything else
        cause, fixes = CAUSE, _headroom_fixes(result.config, th)
    return Diagnosis("F5", "critical", "failed start / out of memory although the KV pool looked large enough",
                     _start_evidence(result, error, th), cause,
                     join_fixes(*fixes) or join_fixes(*_headroom_fixes(result.config, th)))


def _start_evidence(result: RunResult, error: str, th: Thresholds) -> list[Evidence]:
    cfg = result.config
    first_line = error.strip().splitlines()[0] if error.strip() else error
    evidence = [Evidence("start error", "start-up", first_line[:300], "memory / does not fit / OOM")]
    util = cfg.get("gpu_memory_utilization")
    if util is not None:
        evidence.append(Evidence("gpu_memory_utilization", "config", util,
                                 f"close to 1 at >= {th.utilization_near_full:g}"))
    found = specs(result)
    try:
        resolved = engine_config(cfg).resolve(*found) if found else None
    except ConfigError:
        resolved = None
    if resolved is not None:
        model, device = found
        activation = activation_peak_bytes(model, resolved.max_num_batched_tokens, resolved.max_num_seqs)
        evidence.append(Evidence("max_num_batched_tokens (activation peak, GiB)", "config",
                                 f"{resolved.max_num_batched_tokens} ({activation / GiB:.2f})",
                                 f"large at >= {th.large_batched_tokens}"))
        requested = device.memory_bytes * resolved.gpu_memory_utilization
        evidence.append(Evidence("weights vs total × utilisation (GiB)", "config",
                                 f"{model.weight_bytes / GiB:.2f} of {requested / GiB:.2f}",
                                 f"{device.name}: {device.memory_bytes / GiB:.0f} GiB"))
    elif cfg.get("max_num_batched_tokens"):
        evidence.append(Evidence("max_num_batched_tokens", "config", cfg["max_num_batched_tokens"],
                                 f"large at >= {th.large_batched_tokens}"))
    return evidence


def _starts(result: RunResult, **changes) -> bool:
    found = specs(result)
    if found is None:
        return False
    try:
        plan_memory(*found, engine_config(result.config, **changes).resolve(*found))
    except (ConfigError, KVCacheMemoryError):
        return False
    return True


def _utilization_that_starts(result: RunResult) -> FlagChange | None:
    """The smallest utilisation (in 0.01 steps) at which kvengine's memory plan starts."""
    current = result.config.get("gpu_memory_utilization") or 0.92
    for hundredths in range(math.floor(current * 100) + 1, 99):
        if _starts(result, gpu_memory_utilization=hundredths / 100):
            return FlagChange("--gpu-memory-utilization", current, hundredths / 100,
                              "the smallest share of the device at which this config starts")
    return None


def _batched_tokens_that_start(result: RunResult) -> FlagChange | None:
    found = specs(result)
    if found is None:
        return None
    try:
        resolved = engine_config(result.config).resolve(*found)
    except ConfigError:
        return None
    budget = resolved.max_num_batched_tokens // 2
    while budget >= resolved.max_num_seqs:
        if _starts(result, max_num_batched_tokens=budget, max_num_seqs=resolved.max_num_seqs):
            return FlagChange("--max-num-batched-tokens", resolved.max_num_batched_tokens, budget,
                              "a smaller prefill activation peak")
        budget //= 2
    return None


def _max_len_from_hint(result: RunResult, error: str) -> FlagChange | None:
    match = MAX_LEN_HINT.search(error)
    if not match or not int(match.group(1)):
        return None
    block = int(result.config.get("block_size") or 16)
    target = int(match.group(1)) // block * block
    asked = MAX_LEN_ASKED.search(error)
    current = result.config.get("max_model_len") or (int(asked.group(1)) if asked else None)
    return FlagChange("--max-model-len", current, target,
                      "the longest request the available KV memory holds")


def _fp8(result: RunResult) -> FlagChange | None:
    dtype = result.config.get("kv_cache_dtype") or "auto"
    return FlagChange("--kv-cache-dtype", dtype, "fp8", "half the K/V bytes per token") if dtype == "auto" else None


def _headroom_fixes(config: dict, th: Thresholds) -> list[FlagChange]:
    out = []
    util = config.get("gpu_memory_utilization")
    if util:
        out.append(FlagChange("--gpu-memory-utilization", util, round(max(util - UTILIZATION_CUT, 0.5), 2),
                              "room for activations, CUDA graphs and other processes"))
    budget = config.get("max_num_batched_tokens")
    if budget and budget >= th.large_batched_tokens:
        out.append(FlagChange("--max-num-batched-tokens", budget, budget // 2, "a smaller prefill activation peak"))
    if config.get("enable_chunked_prefill") is False:
        out.append(FlagChange("--enable-chunked-prefill", "off", "on", "prefill in chunks within the budget"))
    return out


def oom_during_run(f: RunFacts) -> Diagnosis | None:
    """F5 for a run that started: requests failed with out-of-memory errors."""
    failed = [r for r in f.result.requests if r.error and r.finish_reason != "rejected" and is_memory_error(r.error)]
    if not failed:
        return None
    evidence = [Evidence("requests failed with a memory error", f.series.whole(), len(failed), "0"),
                Evidence("first such error", "requests", failed[0].error.strip()[:300], "memory / OOM")]
    used, total = f.series.get("gpu_memory_used"), f.series.get("gpu_memory_total")
    if used is not None and total is not None:
        evidence.append(Evidence("NVML used / total memory peak", f.series.whole(),
                                 round(float(np.nanmax(used / total)), 3), "near 1"))
    return Diagnosis("F5", "critical", "out of memory during the run", evidence, CAUSE,
                     join_fixes(*_headroom_fixes(f.config, f.th)))

