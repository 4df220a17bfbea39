"""Faults of prefix reuse: F4 (hit rate low: template or thrash), F7 (multi-call sessions re-prefill)."""
from __future__ import annotations

from .facts import RunFacts
from .fixes import more_kv_room
from .model import Diagnosis, Evidence, FlagChange, fixes

TEMPLATE_FIX = ("stabilise the prompt template: put the shared system prompt (and tool descriptions) first "
                "and byte-identical in every request; move per-request content (dates, ids, user data) after it")
ENABLE_CACHING = FlagChange("--enable-prefix-caching", "off", "on", "reuse the K/V of shared prompt prefixes")


def _hit_rate_evidence(f: RunFacts, observed: float | None) -> list[Evidence]:
    th, s = f.th, f.series
    out = [Evidence("vllm:prefix_cache_hits / prefix_cache_queries", s.whole(),
                    None if observed is None else round(observed, 3), f"< {th.low_hit_rate:g}")]
    if f.ideal_hit_rate is not None:
        out.append(Evidence("ideal hit rate (unbounded cache, from the workload)", "workload",
                            round(f.ideal_hit_rate, 3), f"template problem below {th.ideal_high:g}"))
    return out


def low_prefix_hits(f: RunFacts) -> Diagnosis | None:
    """F4: the hit rate stays low; the ideal rate tells a template problem from capacity thrash."""
    th, observed, ideal = f.th, f.hit_rate, f.ideal_hit_rate
    if f.prefix_caching_off:
        if ideal is None or ideal < th.ideal_high:
            return None
        return Diagnosis("F4", "warning", "prefix cache hit rate stays low (caching is off)",
                         _hit_rate_evidence(f, None),
                         f"prefix caching is off although {ideal:.0%} of prompt tokens are shared prefixes",
                         [ENABLE_CACHING])
    if observed is None:
        return None
    low = observed < th.low_hit_rate
    lost = ideal is not None and ideal >= th.ideal_high and observed < th.thrash_ratio * ideal
    if not (low or lost):
        return None
    if ideal is not None and ideal < th.ideal_high:
        return _template_problem(f, observed)
    if ideal is None and not _cache_under_pressure(f):
        return _template_problem(f, observed)
    return _thrash(f, observed)


def _cache_under_pressure(f: RunFacts) -> bool:
    s = f.series
    evictions = s.total("kvengine_evictions") or 0
    return (s.time_mean("kv_usage") or 0) >= f.th.usage_high or (s.total("num_preemptions") or 0) > 0 \
        or evictions > 0


def _template_problem(f: RunFacts, observed: float) -> Diagnosis:
    known = f.ideal_hit_rate is not None
    return Diagnosis(
        "F4", "info", "prefix cache hit rate stays low",
        _hit_rate_evidence(f, observed),
        "the prompts do not share stable prefixes" + ("" if known else
                                                       " (likely: the pool is not under pressure; no workload "
                                                       "profile to compare with)"),
        TEMPLATE_FIX)


def _thrash(f: RunFacts, observed: float) -> Diagnosis:
    s, th = f.series, f.th
    evidence = _hit_rate_evidence(f, observed)
    evidence.append(Evidence("vllm:kv_cache_usage_perc mean", s.whole(), round(s.time_mean("kv_usage") or 0, 3),
                             f"pressure at >= {th.usage_high:g}"))
    evidence.append(Evidence("vllm:num_preemptions_total", s.whole(), int(s.total("num_preemptions") or 0),
                             "> 0 evicts what could be reused"))
    if s.has("kvengine_evictions"):
        evidence.append(Evidence("kvengine:prefix_cache_evictions_total", s.whole(),
                                 int(s.total("kvengine_evictions")), "evictions of reusable blocks"))
    working_set = _distinct_prefix_tokens(f)
    if working_set and f.pool:
        evidence.append(Evidence("distinct prompt blocks of the workload (tokens)", "workload", working_set,
                                 f"pool {f.pool.tokens:,} tokens"))
    return Diagnosis(
        "F4", "warning", "prefix cache hit rate stays low although the prompts share prefixes",
        evidence,
        "capacity thrash: the cache is too small to keep the shared prefixes until they are reused",
        fixes(*more_kv_room(f), _smaller_blocks(f)) or
        "more KV room: raise --gpu-memory-utilization or use --kv-cache-dtype fp8")


def _distinct_prefix_tokens(f: RunFacts) -> int | None:
    w = f.result.workload
    blocks, block_size = w.get("distinct_prefix_blocks"), w.get("block_size")
    return int(blocks * block_size) if blocks and block_size else None


def _smaller_blocks(f: RunFacts) -> FlagChange | None:
    size = int(f.config.get("block_size") or 16)
    # the sizes the server takes, as its run recorded them; else GPU vLLM's multiples of 16
    allowed = [b for b in f.config.get("server_block_sizes") or (16, 32, 64, 128, 256) if b < size]
    if not allowed:
        return None
    return FlagChange("--block-size", size, max(allowed), "finer sharing: partial blocks are never reused")


def session_reprefill(f: RunFacts) -> Diagnosis | None:
    """F7: multi-call sessions pay a long prefill (TTFT) on every call because their shared context misses."""
    th, s, w = f.th, f.series, f.result.workload
    sessions, requests = w.get("sessions") or 0, w.get("requests") or 0
    if not sessions or not f.requests:
        return None
    calls = requests / sessions
    prompt_mean = sum(r.prompt_tokens for r in f.requests) / len(f.requests)
    cached_mean, cached_name = f.cached_tokens_per_request()
    ttft_mean = sum(r.ttft_s for r in f.requests) / len(f.requests)
    hit = f.hit_rate or 0.0
    ideal = f.ideal_hit_rate
    low = hit < th.low_hit_rate or (ideal is not None and hit < th.thrash_ratio * ideal)
    if calls < th.min_calls_per_session or prompt_mean < th.long_prompt_tokens or not low \
            or ttft_mean * calls < th.session_ttft_s:
        return None
    evidence = [
        Evidence("calls per session", "workload", round(calls, 1), f">= {th.min_calls_per_session:g}"),
        Evidence("TTFT per call (mean, clients) × calls", s.whole(),
                 f"{ttft_mean:.3f} s × {calls:.1f} = {ttft_mean * calls:.2f} s", f"> {th.session_ttft_s:g} s"),
        Evidence("prompt tokens per request (mean)", s.whole(), round(prompt_mean),
                 f"long at >= {th.long_prompt_tokens}"),
        Evidence(cached_name, s.whole(), None if cached_mean is None else round(cached_mean),
                 "most of the prompt"),
        *_hit_rate_evidence(f, None if f.prefix_caching_off else hit),
    ]
    action = "keep the shared context stable and first, and shorten tool descriptions"
    changes = [ENABLE_CACHING] if f.prefix_caching_off else more_kv_room(f)
    return Diagnosis(
        "F7", "warning", "multi-call (agent) sessions take seconds end to end",
        evidence,
        "TTFT is paid on every call: the long shared context is prefilled again instead of served from "
        "the prefix cache" + (" (prefix caching is off)" if f.prefix_caching_off else ""),
        [*changes, action])
