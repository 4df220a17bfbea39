"""Faults of prefix reuse: F4 (hit rate low: template or thrash), F7 (multi-call sessions re-prefill)."""
from __future__ import annotations

from dataclasses import dataclass

from ..results import Launch, engine_config
from .facts import RunFacts
from .fixes import more_kv_room
from .model import Diagnosis, Evidence, FlagChange, fixes
from .signals import best_intervals_rate

TEMPLATE_FIX = ("stabilise the prompt template: put the shared system prompt (and tool descriptions) first "
                "and byte-identical in every request; move per-request content (dates, ids, user data) after it")
ENABLE_CACHING = FlagChange("--enable-prefix-caching", "off", "on", "reuse the K/V of shared prompt prefixes")
# Without a workload profile the ideal hit rate is unknown: the server's counters stand in for it.
REUSE_SEEN = 0.05  # a hit rate that shows the prompts do reuse blocks (a trace that shares nothing reads ~0)
EVICTED_POOLS = 1.0  # heavy evictions: at least the whole pool's worth of cached blocks evicted over the run
BEST_SHARE = 0.25  # the cache at its best: its intervals with the most hits, carrying a quarter of the queries
STEADY_HITS = 0.75  # a cache that keeps what it reuses serves about its best rate all along; under this share
#                     of it, hits come and go: the reused blocks are evicted between their uses


@dataclass
class LostReuse:
    """Why the hit rate is low although the prompts share: the evidence it stands on."""

    evidence: list[Evidence]


def _hit_rate_evidence(f: RunFacts, observed: float | None) -> list[Evidence]:
    th, s = f.th, f.series
    out = [Evidence("vllm:prefix_cache_hits / prefix_cache_queries", s.whole(),
                    None if observed is None else round(observed, 3), f"< {th.low_hit_rate:g}")]
    if f.ideal_hit_rate is not None:
        out.append(Evidence("ideal hit rate (unbounded cache, from the workload)", "workload",
                            round(f.ideal_hit_rate, 3), f"template problem below {th.ideal_high:g}"))
    return out


def low_prefix_hits(f: RunFacts) -> Diagnosis | None:
    """F4: the hit rate stays low; the ideal rate tells a template problem from capacity thrash (without a
    workload profile, hits that come and go under heavy evictions stand in for a high ideal)."""
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
    lost = _lost_reuse(f, observed)
    if not (observed < th.low_hit_rate or lost):
        return None
    if lost is None and (ideal is None or ideal < th.ideal_high):
        return _template_problem(f, observed)
    return _thrash(f, observed, lost)


def _lost_reuse(f: RunFacts, observed: float) -> LostReuse | None:
    """The cache loses blocks the prompts would reuse: the hit rate well under the workload's ideal; or,
    without a profile, blocks evidently reused (hits >= REUSE_SEEN) while the cache evicts its pool over,
    and a hit rate well under what the cache gives: under the share below which the card calls a
    workload's sharing low (ideal_high), or under STEADY_HITS of its own best intervals."""
    th, ideal = f.th, f.ideal_hit_rate
    if ideal is not None:
        return LostReuse([]) if ideal >= th.ideal_high and observed < th.thrash_ratio * ideal else None
    if observed < REUSE_SEEN:
        return None  # nothing is reused, so no reusable block was lost
    best = best_intervals_rate(f.series, "prefix_hits", "prefix_queries", BEST_SHARE) or observed
    short = observed < th.ideal_high or observed < STEADY_HITS * best
    pressure = _pressure_evidence(f) if short else []
    if not pressure:
        return None
    return LostReuse([Evidence("hit rate of the best intervals (a quarter of the queried tokens)", f.series.whole(),
                               round(best, 3), f"observed under {STEADY_HITS:g}× of it, or under "
                                               f"{th.ideal_high:g}: reused blocks do not stay"), *pressure])


def _pressure_evidence(f: RunFacts) -> list[Evidence]:
    """Heavy evictions where the server counts them (kvengine), else a full pool or preemptions."""
    s = f.series
    if s.has("kvengine_evictions"):
        evicted = int(s.total("kvengine_evictions")) * engine_config(f.config).block_size
        heavy = f.pool is not None and evicted >= EVICTED_POOLS * f.pool.tokens
        return [Evidence("kvengine:prefix_cache_evictions_total (tokens)", s.whole(), evicted,
                         f">= the {f.pool.tokens:,}-token pool: the cache turned over")] if heavy else []
    usage, preemptions = s.time_mean("kv_usage") or 0, s.total("num_preemptions") or 0
    if usage < f.th.usage_high and not preemptions:
        return []
    return [Evidence("vllm:kv_cache_usage_perc mean / num_preemptions_total", s.whole(),
                     f"{usage:.3f} / {int(preemptions)}", f">= {f.th.usage_high:g} or > 0")]


def _template_problem(f: RunFacts, observed: float) -> Diagnosis:
    hidden = _body_behind_head(f)
    if hidden is not None:
        return hidden
    known = f.ideal_hit_rate is not None
    return Diagnosis(
        "F4", "info", "prefix cache hit rate stays low",
        _hit_rate_evidence(f, observed),
        "the prompts do not share stable prefixes" + ("" if known else
                                                       " (likely: no sign that the cache loses reused blocks; "
                                                       "no workload profile to compare with)"),
        TEMPLATE_FIX)


def _body_behind_head(f: RunFacts) -> Diagnosis | None:
    """The prompts do share a long body, but behind a per-request head: no chain of blocks matches past
    the head, so nothing of the body is served. Moving the head after the body is the whole fix."""
    w, th = f.result.workload, f.th
    repeated, ideal = w.get("repeated_block_share"), f.ideal_hit_rate or 0.0
    head, body = w.get("repeated_head_tokens") or 0, w.get("repeated_body_tokens") or 0
    if repeated is None or repeated - ideal < th.ideal_high or not head:
        return None
    evidence = _hit_rate_evidence(f, f.hit_rate)
    evidence += [
        Evidence("prompt tokens in blocks repeated at any position (workload)", "workload", round(repeated, 3),
                 f"vs {ideal:.0%} as a shared prefix: {repeated - ideal:.0%} >= {th.ideal_high:g} is hidden"),
        Evidence("varying head before the shared body (median, tokens)", "workload", int(head),
                 "> 0: differs in every request"),
        Evidence("shared body behind it (median, tokens)", "workload", int(body), "repeated across requests"),
    ]
    return Diagnosis(
        "F4", "warning", "prefix cache hit rate stays low although the prompts share a long body",
        evidence,
        f"every prompt starts with a {int(head):,}-token head that differs per request, then the same "
        f"{int(body):,}-token body: a cached block matches only behind an identical prefix, so none of the body "
        "is ever served from the cache",
        f"move the varying {int(head):,}-token header after the shared {int(body):,}-token body (shared system "
        f"prompt first, byte-identical; per-request dates, ids and user data after it): the cache then serves "
        f"those {int(body):,} tokens to every request, up to {repeated:.0%} of prompt tokens")


def _thrash(f: RunFacts, observed: float, lost: LostReuse | None) -> Diagnosis:
    s, th = f.series, f.th
    evidence = _hit_rate_evidence(f, observed)
    evidence += lost.evidence if lost else []
    evidence.append(Evidence("vllm:kv_cache_usage_perc mean", s.whole(), round(s.time_mean("kv_usage") or 0, 3),
                             f"pressure at >= {th.usage_high:g}"))
    evidence.append(Evidence("vllm:num_preemptions_total", s.whole(), int(s.total("num_preemptions") or 0),
                             "> 0 evicts what could be reused"))
    if s.has("kvengine_evictions") and not any(e.metric.startswith("kvengine:") for e in evidence):
        evidence.append(Evidence("kvengine:prefix_cache_evictions_total", s.whole(),
                                 int(s.total("kvengine_evictions")), "evictions of reusable blocks"))
    working_set = _distinct_prefix_tokens(f)
    if working_set and f.pool:
        evidence.append(Evidence("distinct prompt blocks of the workload (tokens)", "workload", working_set,
                                 f"pool {f.pool.tokens:,} tokens"))
    known = f.ideal_hit_rate is not None
    return Diagnosis(
        "F4", "warning", "prefix cache hit rate stays low although the prompts share prefixes",
        evidence,
        "capacity thrash: the cache is too small to keep the shared prefixes until they are reused"
        + ("" if known else " (no workload profile: the prompts do reuse blocks, yet the cache, evicting its "
                            "whole pool over, serves few of them)"),
        fixes(*more_kv_room(f), _smaller_blocks(f)) or
        "more KV room: raise --gpu-memory-utilization or use --kv-cache-dtype fp8")


def _distinct_prefix_tokens(f: RunFacts) -> int | None:
    w = f.result.workload
    blocks, block_size = w.get("distinct_prefix_blocks"), w.get("block_size")
    return int(blocks * block_size) if blocks and block_size else None


def _smaller_blocks(f: RunFacts) -> FlagChange | None:
    size = engine_config(f.config).block_size
    # the sizes the server takes, as its run recorded them; else GPU vLLM's multiples of 16
    launch = Launch.of(f.config)
    allowed = [b for b in (launch and launch.block_sizes) or (16, 32, 64, 128, 256) if b < size]
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
