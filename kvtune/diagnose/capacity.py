"""Faults of a KV pool too small for what it is asked to hold: F1, F6, F8."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .facts import RunFacts
from .fixes import (MAX_TOKENS, cap_max_num_seqs, concurrency_needed, fp8_gain_of, lower_max_model_len, more_kv_room,
                    fp8_kv, on_cpu, seqs_that_fit)
from .signals import time_quantile
from .model import Diagnosis, Evidence, FlagChange, fixes


def head_of_line_blocking(f: RunFacts) -> Diagnosis | None:
    """F1: usage at the limit for a sustained time while the queue grows: new requests get no blocks."""
    s, th = f.series, f.th
    usage, waiting = s.get("kv_usage"), s.get("num_waiting")
    if usage is None or waiting is None:
        return None
    blocked = (usage >= th.usage_high) & (waiting > 0)
    share = s.fraction_of_time(blocked)
    if share < th.sustained_fraction:
        return None
    first = int(np.argmax(blocked))
    peak_at = int(np.argmax(np.where(blocked, waiting, -np.inf)))
    if waiting[peak_at] - waiting[first] < th.queue_growth:
        return None
    ttft, ttft_name = f.ttft_p95()
    over_slo = ttft is not None and ttft > th.ttft_p95_slo_s
    evidence = [
        Evidence("vllm:kv_cache_usage_perc with num_requests_waiting > 0", s.whole(),
                 round(share, 3), f">= {th.sustained_fraction:g} of run time at usage >= {th.usage_high:g}"),
        Evidence("vllm:num_requests_waiting", s.window(first, peak_at),
                 f"{waiting[first]:.0f} → {waiting[peak_at]:.0f}", f"rises by >= {th.queue_growth}"),
    ]
    if ttft is not None:
        evidence.append(Evidence(ttft_name, s.whole(), round(ttft, 3), f"> {th.ttft_p95_slo_s:g} s (SLO)"))
    return Diagnosis(
        "F1", "critical" if over_slo else "warning",
        "queue grows and TTFT spikes while the KV pool is near its limit",
        evidence,
        "KV blocks near the limit: new requests cannot get blocks for their prompts (head-of-line blocking)",
        fixes(*more_kv_room(f), lower_max_model_len(f), cap_max_num_seqs(f)) or
        "more KV room: raise --gpu-memory-utilization, use --kv-cache-dtype fp8, or lower --max-num-seqs")


def preemption_thrash(f: RunFacts) -> Diagnosis | None:
    """F6: preemptions over the run with the pool full: too many running sequences for it.

    Judged on the server's counters, never on a sampled gauge: vllm:num_preemptions_total, and
    where the server has it vllm:request_num_preemptions (how many finished requests were preempted
    at least once). vLLM preempts only when no block is free, so a preemption is itself the proof
    that the pool ran out; kv_cache_usage_perc, one instant per scrape, read 89.7 % in one watch
    and 94.9 % in another of the same traffic, so it is shown, not compared. It fires where the
    preemptions are spread over the run's windows, or reach preempted_share_critical of the
    requests however bursty. A live run's clients cannot see preemptions, so their records
    (always 0) never lower the severity.
    """
    s, b, th = f.series, f.bins, f.th
    preemptions = s.total("num_preemptions")
    if not preemptions or preemptions < th.min_preemptions or b is None:
        return None
    sustained = float((b.preemptions > 0).sum() / len(b))
    preempted = f.preempted()
    share = preempted.share if preempted is not None else None
    spread = sustained >= th.preempting_fraction
    if not (spread or (share is not None and share >= th.preempted_share_critical)):
        return None
    evidence = [
        Evidence("vllm:num_preemptions_total", s.whole(), int(preemptions), f">= {th.min_preemptions}"),
        Evidence("windows with preemptions", f"{len(b)} windows of {b.length:.1f} s", round(sustained, 3),
                 f">= {th.preempting_fraction:g} of the windows, or the share preempted below"),
        _usage_evidence(f),
        _running_evidence(f),
    ]
    if preempted is not None and preempted.per_request is not None:
        evidence.append(Evidence(f"preemptions per request (mean, {preempted.source})", s.whole(),
                                 round(preempted.per_request, 2), "0 when the pool holds them all"))
    severity, why = pressure_severity(f, preemptions)
    return Diagnosis(
        "F6", severity,
        "preemptions climb and the waiting queue is long",
        evidence + why,
        "too many running sequences for the KV pool: as their outputs grow they run out of blocks "
        "and the newest are preempted and recomputed",
        fixes(cap_max_num_seqs(f), *more_kv_room(f), _cap_max_tokens(f)))


def _usage_evidence(f: RunFacts) -> Evidence:
    """The pool's usage, for the reader: the level it held for the busiest 5 % of the run's time."""
    s = f.series
    busy = s.time_quantile("kv_usage", 95)
    return Evidence("vllm:kv_cache_usage_perc, p95 over time", s.whole(), None if busy is None else round(busy, 3),
                    "shown, not compared: a preemption proves the pool ran out of free blocks")


def pressure_severity(f: RunFacts, preemptions: float) -> tuple[str, list[Evidence]]:
    """Critical only where it hurts, and the evidence that says so: TTFT p95 over its SLO, or
    preemptions reaching preempted_share_critical of the requests (the server's histogram, else the
    records, else preemptions per finished request as the most it can be). F6 and F8 both."""
    th, s = f.th, f.series
    found, critical = [], False
    ttft, ttft_name = f.ttft_p95()
    if ttft is not None:
        critical = ttft > th.ttft_p95_slo_s
        found.append(Evidence(ttft_name, s.whole(), round(ttft, 3), f"critical > {th.ttft_p95_slo_s:g} s (SLO)"))
    preempted = f.preempted()
    finished = len(f.requests) or s.total("requests_finished") or 0
    if preempted is not None and preempted.share is not None:
        name, window, share = (f"requests preempted at least once ({preempted.source})",
                               f"{preempted.text} finished requests", preempted.share)
    elif finished:
        name, window, share = ("preemptions per finished request (at most the share preempted)",
                               f"{int(preemptions)} over {int(finished)}", preemptions / finished)
    else:
        share = None
    if share is not None:
        critical = critical or share >= th.preempted_share_critical
        found.append(Evidence(name, window, round(share, 3), f"critical at >= {th.preempted_share_critical:g}"))
    return ("critical" if critical else "warning"), found


def _running_evidence(f: RunFacts) -> Evidence:
    s = f.series
    peak = s.peak("num_running") or 0
    fit = seqs_that_fit(f)
    limit = f"max_num_seqs {f.max_num_seqs}" if f.max_num_seqs else "max_num_seqs unknown"
    if fit is not None:
        limit += f"; the pool holds {fit} at p99 context"
    need = concurrency_needed(f)
    if need is not None:
        limit += f"; the arrivals need {need.needed} ({need.text}, Little's law)"
    return Evidence("vllm:num_requests_running peak", s.whole(), int(peak), limit)


def _cap_max_tokens(f: RunFacts) -> FlagChange | None:
    """The clients' max_tokens near the output p95, where a few outputs run far longer: a limit a
    request can hit, so the trial counts what it truncates (fixes.refusal)."""
    outputs = f.result.workload.get("output_len") or {}
    p95, top = outputs.get("p95"), outputs.get("max")
    if not p95 or not top or top <= 1.5 * p95:
        return None
    return FlagChange(MAX_TOKENS, None, int(math.ceil(p95)),
                      f"the requests' own cap, near the output p95; the longest asks {top:,}")


def context_overcommit(f: RunFacts) -> Diagnosis | None:
    """F8: the KV the concurrent requests hold at their full context is more than the pool."""
    s, th = f.series, f.th
    if f.pool is None or f.contexts is None:
        return None
    demand = kv_demand(f)
    preemptions = s.total("num_preemptions") or 0
    # The preemptions prove the pool ran out (see preemption_thrash); the demand says why.
    if demand is None or demand.tokens <= f.pool.tokens or preemptions < th.min_preemptions:
        return None
    c = f.contexts
    at_mean = c.mean * demand.concurrency
    mean_note = "fits: planning at the mean hides the tail" if at_mean <= f.pool.tokens else \
        "over the pool even at the mean"
    evidence = [
        Evidence(f"KV demand: {demand.how} (tokens)", s.whole(),
                 int(demand.tokens), f"> pool {f.pool.tokens:,} tokens ({f.pool.source})"),
        Evidence(f"p99 context ({c.source})", s.whole(), round(c.p99), f"mean {c.mean:,.0f}"),
        Evidence(f"mean context × {demand.concurrency} concurrent (tokens)", s.whole(), int(at_mean), mean_note),
        Evidence("vllm:num_preemptions_total", s.whole(), int(preemptions), f">= {th.min_preemptions}"),
        _usage_evidence(f),
    ]
    severity, why = pressure_severity(f, preemptions)
    return Diagnosis(
        "F8", severity,
        "KV memory exhausted under high concurrency with long contexts",
        evidence + why,
        "KV demand is concurrency × context: the contexts of the requests in service at once exceed the pool",
        fixes(*more_kv_room(f), _tensor_parallel(f, demand.tokens), cap_max_num_seqs(f)))


DEMAND_QUANTILE = 99


@dataclass
class Demand:
    tokens: float
    concurrency: int
    how: str


def kv_demand(f: RunFacts) -> Demand | None:
    """The p99 over the run's time of the K/V that the requests in service at once hold at their full
    context (prompt + output), from the run's own records: each request counts from when it was
    scheduled (else its first token) to its last token. A request in service at a random moment is
    picked in proportion to how long it stays, so the long requests that hold the most K/V also stay
    the longest; Little's law with one mean service time and contexts drawn per arrival misses that
    and put a saturated, preempting pool under its own demand. Shared prefixes count once per request.
    Without records (a watched server) it is the p99 context × the p99 over time of running requests."""
    spans = [(r.arrival_s + (r.queue_s if r.queue_s is not None else r.ttft_s), r.arrival_s + r.e2e_s,
              r.prompt_tokens + r.output_tokens) for r in f.requests if r.e2e_s is not None]
    if len(spans) >= f.th.min_requests:
        held, running = _in_service(np.array(spans, dtype=float))
        return Demand(held, running, f"p{DEMAND_QUANTILE} over time of the full contexts of the requests in "
                                     "service at once (the run's records)")
    running = f.series.time_quantile("num_running", DEMAND_QUANTILE)
    if not running or f.contexts is None:
        return None
    concurrency = int(math.ceil(running))
    if not concurrency:
        return None
    return Demand(f.contexts.p99 * concurrency, concurrency,
                  f"p99 context × {concurrency} running (p{DEMAND_QUANTILE} over time of the server's gauge)")


def _in_service(spans: np.ndarray) -> tuple[float, int]:
    """(p99 over time of the summed contexts in service, p99 over time of the requests in service) for
    rows of (start, end, context): a step function from the starts and ends."""
    starts, ends, contexts = spans[:, 0], np.maximum(spans[:, 1], spans[:, 0]), spans[:, 2]
    times = np.concatenate([starts, ends])
    order = np.argsort(times, kind="stable")
    held = np.cumsum(np.concatenate([contexts, -contexts])[order])
    count = np.cumsum(np.concatenate([np.ones_like(contexts), -np.ones_like(contexts)])[order])
    lasting = np.diff(times[order], append=times[order][-1])
    return (time_quantile(held, lasting, DEMAND_QUANTILE),
            int(round(time_quantile(count, lasting, DEMAND_QUANTILE))))


def _tensor_parallel(f: RunFacts, demand: float) -> FlagChange | None:
    """The smallest power-of-two GPU count whose combined pool (at least) covers the demand; none
    where fp8 K/V alone covers it (one GPU, no weight split) or the server runs on a CPU."""
    fp8 = fp8_kv(f)
    if on_cpu(f) or (fp8 is not None and f.pool.tokens * fp8_gain_of(f) >= demand):
        return None
    current, pool_tokens = int(f.config.get("tensor_parallel_size") or 1), f.pool.tokens
    ways = 1
    while ways * pool_tokens < demand and ways < 8:
        ways *= 2
    return FlagChange("--tensor-parallel-size", current, current * ways,
                      f"at least {ways}× the pool on {ways} GPUs, the weights split among them")
