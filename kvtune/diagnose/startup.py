"""F5: out of memory, or a failed start, although the KV pool looked large enough; START: a refused config.

A failed run has no series: only its error text and its config. The error is
judged by its root cause, the line of the server's log that says why it failed
(kvtune.targets.startlog.root_cause: vLLM prints it in its EngineCore process,
above the API server's wrapper tracebacks). F5 only when that line is about
memory; a value the server refuses (a block size its attention backend does not
take, a dtype it does not know) is START, with the value it takes where the line
tells it; anything else is no fault of the KV cache (run.py).

The F5 fix is computed with kvengine.core.memory where the run names model and
device presets (the smallest utilisation or batch budget that starts), else it
follows the fault card's rules of thumb and the numbers in the line itself.
"""
from __future__ import annotations

import math
import re

import numpy as np
from kvengine.config import ConfigError, GiB
from kvengine.core.memory import KVCacheMemoryError, activation_peak_bytes, plan_memory

from ..results import RunResult, engine_config
from ..targets.rules import OVERRIDE, UTILIZATION
from ..targets.startlog import is_wrapper, read_log, root_cause
from .facts import RunFacts
from .fixes import CPU_KV_SPACE, fp8_bytes_text, limit_noted, pool_change, request_limit, rules_of
from .model import Diagnosis, Evidence, FlagChange, Thresholds, fixes as options
from .pool import specs

# What a line says when memory is the cause (the KV pool, activations, other processes); never plain "memory":
# vLLM's logs mention memory everywhere ("No available shared memory broadcast block found in 60 seconds").
MEMORY_MARKERS = ("out of memory", "outofmemory", "memoryerror", "no available memory for the cache blocks",
                  "to serve at least one request", "do not fit", "does not fit", "less than desired",
                  "cannot allocate memory", "std::bad_alloc", "insufficient memory")
MAX_LEN_HINT = re.compile(r"estimated maximum model length is (\d+)")
MAX_LEN_ASKED = re.compile(r"max seq len \((\d+)\)")
# vLLM: "Available memory on node 0 (17.31/21.96 GiB) on startup is less than desired CPU memory utilization
# (0.99, 21.74 GiB)"; on a GPU "Free memory on device cuda:0 (70.1/79.2 GiB) on startup is less than desired ..."
FREE_OF_TOTAL = re.compile(r"\((\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) GiB\) on startup is less than desired")
# vLLM CPU: "Explicitly set (0.0/21.96) GiB for KV cache on node 0." (VLLM_CPU_KVCACHE_SPACE)
KVCACHE_SPACE_SET = re.compile(r"Explicitly set \((\d+(?:\.\d+)?)/\d+(?:\.\d+)?\) GiB for KV cache")
FULL_LOG = re.compile(r"^full log: (.+)$", re.MULTILINE)
UTILIZATION_CUT = 0.07  # the card's example: 0.92 → 0.85
UTILIZATION_STEP = 0.05
ACTIVATION_SHARE_LARGE = 0.5  # an activation peak over half of what the weights leave drives the first fix
CAUSE = ("memory outside the KV pool: prefill activations at max_num_batched_tokens, CUDA graphs, other "
         "processes (and fragmentation with contiguous allocators)")


def is_memory_error(text: str | None) -> bool:
    """The text says that memory is the cause (an OOM, a pool that cannot hold a request, ...)."""
    return bool(text) and any(marker in text.lower() for marker in MEMORY_MARKERS)


def start_cause(error: str | None) -> str:
    """The line of a failed start's error that says why: its root cause, else its first line."""
    text = (error or "").strip()
    return root_cause(text) or (text.splitlines()[0] if text else "")


def _cause_line(error: str) -> str:
    """The error's root-cause line; where the error only carries a wrapper ("the server exited with
    status 1 before it was healthy") and names its kept log, the log's own root cause."""
    line = start_cause(error)
    path = log_path_of(error)
    if path and (not line or is_wrapper(line)):
        return root_cause(read_log(path)) or line
    return line


def log_path_of(error: str | None) -> str | None:
    """The path of the server's kept log that a start error names (`full log: PATH`)."""
    match = FULL_LOG.search(error or "")
    return match.group(1).strip() if match else None


def failed_start(result: RunResult, error: str, th: Thresholds) -> Diagnosis | None:
    """F5 or START for a run that never started (or died), from its error's root cause and its config."""
    cause_line = _cause_line(error)
    if is_memory_error(cause_line):
        return _out_of_memory(result, error, cause_line, th)
    return refused_config(result, error, cause_line)


def _out_of_memory(result: RunResult, error: str, cause_line: str, th: Thresholds) -> Diagnosis:
    lowered = cause_line.lower()
    log = read_log(path) if (path := log_path_of(error)) else ""
    if "to serve at least one request" in lowered:
        cause = "the KV pool left after weights, activations and overhead cannot hold one max_model_len request"
        fixes = _pool_below_max_len_fixes(result, cause_line, th)
    elif "no available memory" in lowered:
        cause = "nothing is left for the KV pool after the weights, the activation peak and the overhead"
        fixes = [_kvcache_space(result, log or error), _batched_tokens_that_start(result),
                 _utilization_that_starts(result)]
        if not any(fixes):
            fixes = [_halve_batched_tokens(result.config, th), _raise_utilization(result, th)]
        if not any(fixes):
            fixes = [("raise `--gpu-memory-utilization` or lower `--max-num-batched-tokens` (the cited line says "
                      "which budget is short)")]
    elif "less than desired" in lowered:
        cause = "other processes hold the memory that the asked share of the device (or host) needs"
        fixes = [_utilization_that_is_free(result, cause_line), "stop the processes that hold the memory"]
    elif "does not fit" in lowered:  # kvengine on a GPU: the planned pool is more than is free
        cause = "the KV pool as planned does not fit in the memory free on the device: other processes hold some"
        fixes = _headroom_fixes(result.config, th) + ["set `--num-gpu-blocks-override` to a pool that fits"]
    elif "do not fit" in lowered:
        cause = "the share of the device given to the engine cannot hold even the weights"
        fixes = [_utilization_that_starts(result) or
                 "the weights need more memory than this device has: `--tensor-parallel-size 2` or a larger device"]
    else:  # an OOM at run time: the pool left too little for everything else
        cause, fixes = CAUSE, _headroom_fixes(result.config, th)
    return Diagnosis("F5", "critical", "failed start / out of memory although the KV pool looked large enough",
                     _start_evidence(result, error, cause_line, th), cause,
                     options(*fixes) or options(*_headroom_fixes(result.config, th)))


def _start_evidence(result: RunResult, error: str, cause_line: str, th: Thresholds) -> list[Evidence]:
    cfg = result.config
    evidence = [Evidence("start error", "start-up log", cause_line[:300], "memory / does not fit / OOM")]
    if path := log_path_of(error):
        evidence.append(Evidence("full log", "start-up", path, "kept"))
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
    """The smallest utilisation (in 0.01 steps) at which kvengine's memory plan starts; none where
    another knob sizes the pool (an override, VLLM_CPU_KVCACHE_SPACE)."""
    if not rules_of(result).moves_pool(UTILIZATION):
        return None
    current = engine_config(result.config).gpu_memory_utilization
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


def _pool_below_max_len_fixes(result: RunResult, cause_line: str, th: Thresholds) -> list:
    """A batch budget whose activation peak crowds out the pool is lowered first; where a size fixes the
    pool (an override, VLLM_CPU_KVCACHE_SPACE), that size grown to hold one max_model_len request; a
    shorter max_model_len comes first only where the workload's longest request still fits it, else
    last (it refuses requests)."""
    max_len = _max_len_from_hint(result, cause_line)
    limit = request_limit(result.config, max_len) if max_len is not None else None
    longest = _longest_request(result)
    refuses = limit is not None and longest is not None and limit[0] < longest
    batch = _batched_tokens_for_activations(result, th)
    rest = [_pool_that_holds_max_len(result, cause_line), _utilization_that_starts(result), _fp8_that_starts(result)]
    if not refuses:
        return [batch, max_len and limit_noted(result.config, max_len), *rest]
    max_len.effect += f"; it refuses the workload's longest requests ({longest:,} tokens)"
    return [batch, *rest, max_len]


def _pool_that_holds_max_len(result: RunResult, cause_line: str) -> FlagChange | None:
    """Where a size fixes the pool, that size grown until it holds one max_model_len request beside the
    null block (vLLM's estimate of the longest request leaves that block out)."""
    hint, asked = MAX_LEN_HINT.search(cause_line), MAX_LEN_ASKED.search(cause_line)
    max_len = result.config.get("max_model_len") or (int(asked.group(1)) if asked else None)
    rules = rules_of(result)
    if rules.pool_knob == UTILIZATION or not max_len:
        return None
    block = engine_config(result.config).block_size
    needed = math.ceil(max_len / block) + 1
    if rules.pool_knob == OVERRIDE:
        change = pool_change(result, needed / rules.pool_size, effect="")
    elif hint:
        change = pool_change(result, needed / (int(hint.group(1)) // block + 1), effect="")
    else:
        return None
    if change is not None:
        change.effect = (f"{needed:,} blocks of {block} hold one {max_len:,}-token request beside the null block"
                         if change.flag == OVERRIDE else f"room for one {max_len:,}-token request")
    return change


def _longest_request(result: RunResult) -> int | None:
    """The workload profile's longest prompt plus its longest output (an upper bound on any request's)."""
    inputs, outputs = result.workload.get("input_len") or {}, result.workload.get("output_len") or {}
    if not inputs.get("max"):
        return None
    return int(inputs["max"]) + int(outputs.get("max") or 0)


def _batched_tokens_for_activations(result: RunResult, th: Thresholds) -> FlagChange | None:
    """Where the activation peak at a large max_num_batched_tokens takes a large share of what the weights
    leave, the largest smaller budget that starts (the KV pool gets the activations' memory)."""
    found = specs(result)
    if found is None:
        return None
    model, device = found
    try:
        resolved = engine_config(result.config).resolve(model, device)
    except ConfigError:
        return None
    budget = resolved.max_num_batched_tokens
    activation = activation_peak_bytes(model, budget, resolved.max_num_seqs)
    left = device.memory_bytes * resolved.gpu_memory_utilization - model.weight_bytes
    if budget < th.large_batched_tokens or left <= 0 or activation < ACTIVATION_SHARE_LARGE * left:
        return None
    change = _batched_tokens_that_start(result)
    if change is None:
        return None
    smaller = activation_peak_bytes(model, change.new, resolved.max_num_seqs)
    change.effect = (f"the activation peak at {budget:,} tokens ({activation / GiB:.2f} GiB) takes "
                     f"{activation / left:.0%} of the {left / GiB:.2f} GiB the weights leave; at {change.new:,} it is "
                     f"{smaller / GiB:.2f} GiB and the pool holds a max_model_len request")
    return change


def _fp8_that_starts(result: RunResult) -> FlagChange | None:
    """fp8 K/V, unless the run's presets show that even half the bytes per token do not start, or an
    override fixes the block count (fp8 then holds no more tokens)."""
    if not rules_of(result).moves_pool("--kv-cache-dtype"):
        return None
    change = _fp8(result)
    if change is None or (specs(result) is not None and not _starts(result, kv_cache_dtype="fp8")):
        return None
    return change


def _max_len_from_hint(result: RunResult, error: str) -> FlagChange | None:
    match = MAX_LEN_HINT.search(error)
    if not match or not int(match.group(1)):
        return None
    block = engine_config(result.config).block_size
    target = int(match.group(1)) // block * block
    asked = MAX_LEN_ASKED.search(error)
    current = result.config.get("max_model_len") or (int(asked.group(1)) if asked else None)
    return FlagChange("--max-model-len", current, target, "the longest request the available KV memory holds")


def _kvcache_space(result: RunResult, log: str) -> FlagChange | None:
    """vLLM CPU: VLLM_CPU_KVCACHE_SPACE=0 (the log's "Explicitly set (0.0/…) GiB for KV cache") leaves no
    pool; the fix is the smallest value it takes (whole GiB); none where an override sizes the pool."""
    match = KVCACHE_SPACE_SET.search(log)
    rules = rules_of(result)
    if not match or float(match.group(1)) > 0 or not rules.moves_pool(CPU_KV_SPACE):
        return None
    return FlagChange(CPU_KV_SPACE, 0, rules.taken(CPU_KV_SPACE, 1),
                      "vLLM's CPU backend sizes its KV pool in whole GiB from this variable: 0 leaves none")


def _raise_utilization(result: RunResult, th: Thresholds) -> FlagChange | None:
    util = result.config.get("gpu_memory_utilization")
    if not util or util >= th.max_suggested_utilization or not rules_of(result).moves_pool(UTILIZATION):
        return None
    return FlagChange("--gpu-memory-utilization", util, round(min(util + UTILIZATION_STEP,
                                                                   th.max_suggested_utilization), 2),
                      "a larger share of memory, so something is left for the KV pool")


def _halve_batched_tokens(config: dict, th: Thresholds) -> FlagChange | None:
    budget = config.get("max_num_batched_tokens")
    if budget and budget >= th.large_batched_tokens:
        return FlagChange("--max-num-batched-tokens", budget, budget // 2, "a smaller prefill activation peak")
    return None


def _utilization_that_is_free(result: RunResult, line: str) -> FlagChange | None:
    """The largest utilisation (in 0.05 steps) under the share of memory free at start-up."""
    match = FREE_OF_TOTAL.search(line)
    asked = re.search(r"less than desired \w+ memory utilization \((\d+(?:\.\d+)?)", line)
    current = result.config.get("gpu_memory_utilization") or (float(asked.group(1)) if asked else None)
    if not match or not float(match.group(2)):
        return None
    free_share = float(match.group(1)) / float(match.group(2))
    new = math.floor(round(free_share / UTILIZATION_STEP, 6)) * UTILIZATION_STEP
    if new <= 0:
        return None
    if new >= free_share - 0.01:  # a step exactly at the free share leaves nothing for the process itself
        new -= UTILIZATION_STEP
    return FlagChange("--gpu-memory-utilization", current, round(new, 2),
                      f"under the {free_share:.0%} of memory free at start-up") if new > 0 else None


def _fp8(result: RunResult) -> FlagChange | None:
    dtype = result.config.get("kv_cache_dtype") or "auto"
    if dtype != "auto":
        return None
    return FlagChange("--kv-cache-dtype", dtype, "fp8", fp8_bytes_text(result, "the K/V bytes per token"))


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
                     options(*_headroom_fixes(f.config, f.th)))



# -- START: the server refused the config ------------------------------------------------------------------

START = "START"
REFUSED_TYPES = ("ValueError", "ConfigError", "ValidationError", "NotImplementedError", "TypeError",
                 "ArgumentError", "ArgumentTypeError")
REFUSED_WORDS = ("not supported", "unsupported", "is not allowed", "no common block size", "invalid choice",
                 "must be")
EXCEPTION_TYPE = re.compile(r"^(?:[A-Za-z_]\w*\.)*(?P<type>[A-Za-z_]\w*):")
# argparse: "api_server.py: error: argument --kv-cache-dtype: invalid choice: 'int8' (choose from 'auto', ...)"
ARGPARSE_ARGUMENT = re.compile(r"error: argument (?P<flag>--?[\w-]+)(?:/--?[\w-]+)*: (?P<what>.*)$")
# kvengine's ConfigError: "error: --block-size must be a power of two from 8 to 256 (8, 16, ...), got 12"
FLAG_ERROR = re.compile(r"error: (?P<flag>--[\w-]+)\b(?P<what>.*)$")
# vLLM: "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."
NO_COMMON_BLOCK = re.compile(r"No common block size for (?P<asked>\d+) \((?P<backends>.*)\)")
BACKEND_SIZES = re.compile(r"(?P<name>\w+): \[(?P<sizes>[^\]]*)\]")
INVALID_CHOICE = re.compile(r"invalid choice: '(?P<asked>[^']*)' \(choose from (?P<choices>.*)\)")
# pydantic, as startlog joins it: "ValidationError: 1 validation error for CacheConfig: gpu_memory_utilization:
# Input should be less than or equal to 1 [type=less_than_equal, input_value=1.5, input_type=float]"
VALIDATION = re.compile(r"validation errors? for \w+: (?P<field>\w+): (?P<what>[^\[]*?)\s*(?:\[(?P<meta>[^\]]*)\]|$)")
ALLOWED_GOT = re.compile(r"\((?P<allowed>\d+(?:, \d+)+)\),? got (?P<asked>-?\d+)")
VLLM_CPU_BLOCK_SIZE = 128  # vLLM CPU's default block size (reference/vllm-cpu.md); its CPU_ATTN backend names it
CANDIDATE_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def is_refusal(line: str) -> bool:
    """The line refuses a value of the config: a flag's value, a block size, a dtype."""
    if ARGPARSE_ARGUMENT.search(line) or FLAG_ERROR.search(line) or NO_COMMON_BLOCK.search(line):
        return True
    match = EXCEPTION_TYPE.match(line)
    if match and match.group("type") in REFUSED_TYPES:
        return True
    return any(word in line.lower() for word in REFUSED_WORDS)


def refused_config(result: RunResult, error: str, cause_line: str) -> Diagnosis | None:
    """START for a start the server refused; None when the root cause is not a refused value."""
    if not cause_line or not is_refusal(cause_line):
        return None
    path = log_path_of(error)
    flag, cause, fix = _refusal_fix(result, cause_line)
    evidence = [Evidence("root cause", "start-up log", cause_line[:500], "the line that says why the start failed")]
    key = flag.lstrip("-").replace("-", "_") if flag else None
    if key and result.config.get(key) is not None:
        evidence.append(Evidence(key, "config", result.config[key], "a value the server takes"))
    if path:
        evidence.append(Evidence("full log", "start-up", path, "kept"))
    if fix is None:
        where = f" and the full log ({path})" if path else ""
        fix = (f"read the cited line{where}: the server refused "
               + (f"this `{flag}`" if flag else "a value of this config") + "; give it a value the line allows")
    return Diagnosis(START, "critical", "the server refused the config", evidence, cause,
                     [fix] if isinstance(fix, FlagChange) else str(fix))


def _refusal_fix(result: RunResult, line: str) -> tuple[str | None, str, FlagChange | str | None]:
    """The flag the line names, the cause in words and the fix (None when the line does not tell one)."""
    if match := NO_COMMON_BLOCK.search(line):
        return ("--block-size",) + _block_size_fix(int(match.group("asked")), match.group("backends"))
    if match := VALIDATION.search(line):
        flag = "--" + match.group("field").replace("_", "-")
        value = re.search(r"input_value=([^,]+)", match.group("meta") or "")
        asked = f" {value.group(1)}" if value else ""
        return (flag, f"the server refused `{flag}{asked}`: {match.group('what')}",
                f"give `{flag}` a value that satisfies \"{match.group('what')}\" (the cited line)")
    argument = ARGPARSE_ARGUMENT.search(line)
    flag_error = None if argument else FLAG_ERROR.search(line)
    flag = (argument or flag_error).group("flag") if (argument or flag_error) else None
    if flag is None:
        return None, "the server refused a value of this config (not a KV-cache fault)", None
    if match := INVALID_CHOICE.search(line):
        choices = re.findall(r"'([^']*)'", match.group("choices"))
        return flag, f"the server has no `{flag} {match.group('asked')}`", _choice_fix(flag, match.group("asked"),
                                                                                      choices)
    if match := ALLOWED_GOT.search(line):
        allowed = [int(v) for v in match.group("allowed").split(", ")]
        asked = int(match.group("asked"))
        new = min((v for v in allowed if v >= asked), default=max(allowed))
        return (flag, f"the server does not take `{flag} {asked}`",
                FlagChange(flag, asked, new, f"the nearest value it takes at or above {asked}: "
                                             f"{', '.join(map(str, allowed))}"))
    return flag, f"the server refused the value of `{flag}`", None


def _block_size_fix(asked: int, backends: str) -> tuple[str, FlagChange | None]:
    found = {m.group("name"): m.group("sizes") for m in BACKEND_SIZES.finditer(backends)}

    def takes(size: int) -> bool:
        return all(_sizes_take(sizes, size) for sizes in found.values())

    names = ", ".join(found) or "its attention backend"
    described = "; ".join(f"{name}: {_describe_sizes(sizes)}" for name, sizes in found.items())
    cause = f"the attention backend ({names}) does not take block size {asked}" + (f" ({described})"
                                                                                  if described else "")
    if "CPU_ATTN" in found and takes(VLLM_CPU_BLOCK_SIZE):
        return cause, FlagChange("--block-size", asked, VLLM_CPU_BLOCK_SIZE,
                                 f"vLLM's default on CPU; the CPU attention backend takes "
                                 f"{_describe_sizes(found['CPU_ATTN'])}")
    new = next((size for size in CANDIDATE_BLOCK_SIZES if size >= asked and takes(size)), None)
    if new is None or not found:
        return cause, None
    return cause, FlagChange("--block-size", asked, new, f"the smallest block size at or above {asked} that "
                                                          f"{names} take{'s' if len(found) == 1 else ''}")


def _sizes_take(sizes: str, size: int) -> bool:
    for item in (s.strip() for s in sizes.split(",") if s.strip()):
        multiple = re.fullmatch(r"MultipleOf\((\d+)\)", item)
        if (multiple and size % int(multiple.group(1)) == 0) or item == str(size):
            return True
    return False


def _describe_sizes(sizes: str) -> str:
    multiples = re.findall(r"MultipleOf\((\d+)\)", sizes)
    fixed = [s.strip() for s in sizes.split(",") if s.strip().isdigit()]
    parts = [f"multiples of {m}" for m in multiples] + ([", ".join(fixed)] if fixed else [])
    return " or ".join(parts) or sizes


def _choice_fix(flag: str, asked: str, choices: list[str]) -> FlagChange | None:
    if not choices:
        return None
    shown = ", ".join(choices[:8]) + (", …" if len(choices) > 8 else "")
    if flag == "--kv-cache-dtype" and "fp8" in choices:
        return FlagChange(flag, asked, "fp8", f"the 8-bit KV cache this server takes; it takes {shown}")
    new = "auto" if "auto" in choices else choices[0]
    return FlagChange(flag, asked, new, f"it takes {shown}")
