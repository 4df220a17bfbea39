"""Faults of a decode that is bound by memory bandwidth: F2 (ITL grows with context), F3 (tokens/s
stops growing with load)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .facts import RunFacts
from .fixes import at_least_needed, fp8_bytes_text, fp8_kv
from .latency import itl_by_context
from .model import Diagnosis, Evidence, FlagChange, fixes
from .signals import Bins, quartile_masks


@dataclass
class Trend:
    """A latency in the lowest vs the highest quartile of some driver (context, running requests)."""

    metric: str
    window: str
    driver_low: float
    driver_high: float
    low: float
    high: float

    @property
    def ratio(self) -> float:
        return self.high / self.low if self.low > 0 else math.inf


def itl_against_client_context(f: RunFacts, q: float = 95) -> Trend | None:
    """ITL percentile `q` of the gaps at the longest vs the shortest quartile of context (prompt + position)."""
    context, itl = itl_by_context(f.requests)
    if len(itl) < f.th.min_itl_samples:
        return None
    low, high = quartile_masks(context.astype(float))
    if not low.any() or not high.any():
        return None
    return Trend(f"ITL p{q:g} (clients) by context quartile", f"{len(itl):,} inter-token gaps",
                 float(context[low].mean()), float(context[high].mean()),
                 float(np.percentile(itl[low], q)), float(np.percentile(itl[high], q)))


def itl_against_server_context(f: RunFacts) -> Trend | None:
    """Without client samples: the per-request ITL the server's counters imply, by context per request."""
    b = f.bins
    if b is None or b.context_per_seq is None:
        return None
    itl = b.per_request_itl
    usable = np.isfinite(itl) & np.isfinite(b.context_per_seq)
    if usable.sum() < f.th.min_bins:
        return None
    low, high = quartile_masks(np.where(usable, b.context_per_seq, np.nan))
    return Trend("ITL implied by running / generation tokens/s, by context quartile",
                 f"{usable.sum()} windows of {b.length:.1f} s",
                 float(b.context_per_seq[low].mean()), float(b.context_per_seq[high].mean()),
                 float(np.median(itl[low])), float(np.median(itl[high])))


def itl_trends(f: RunFacts) -> list[Trend]:
    """The clients' p95 and median ITL by context (a tail of prefill stalls can hide a median that
    doubles), else the server's implied ITL."""
    client = [t for t in (itl_against_client_context(f, 95), itl_against_client_context(f, 50)) if t]
    server = itl_against_server_context(f)
    return client or ([server] if server else [])


def throughput_by_context(f: RunFacts) -> tuple[float, float] | None:
    """Generation tokens/s in the windows of shortest vs longest context per running request."""
    b = f.bins
    if b is None or b.context_per_seq is None:
        return None
    busy = np.where(b.running > 0, b.context_per_seq, np.nan)
    low, high = quartile_masks(busy)
    if not low.any() or not high.any():
        return None
    return float(b.generation_rate[low].mean()), float(b.generation_rate[high].mean())


def bandwidth_bound_decode(f: RunFacts) -> Diagnosis | None:
    """F2: ITL (its p95 or its median) rises with context while throughput stays flat and the pool is well used."""
    th, s = f.th, f.series
    trends = itl_trends(f)
    # The level held for the busiest 5 % of the run's time, not one scrape's instant (which a rerun
    # or a second watcher reads differently)
    usage_busy = s.time_quantile("kv_usage", 95) or 0.0
    if not any(t.ratio >= th.itl_growth for t in trends) or usage_busy < th.usage_busy:
        return None
    throughput = throughput_by_context(f)
    if throughput is not None and throughput[1] > th.flat_throughput_gain * throughput[0]:
        return None  # tokens/s grew with context: more load, not a slower decode
    evidence = [Evidence(t.metric, t.window, f"{t.low * 1000:.1f} → {t.high * 1000:.1f} ms",
                         f"grows >= {th.itl_growth:g}× as context goes {t.driver_low:,.0f} → "
                         f"{t.driver_high:,.0f} tokens" + ("" if t.ratio >= th.itl_growth else " (not this one)"))
                for t in trends]
    evidence.append(Evidence("vllm:kv_cache_usage_perc, p95 over time", s.whole(), round(usage_busy, 3),
                             f">= {th.usage_busy:g}"))
    if throughput is not None:
        evidence.append(Evidence("generation tokens/s, short vs long context windows", s.whole(),
                                 f"{throughput[0]:,.0f} → {throughput[1]:,.0f}",
                                 f"flat: gains < {th.flat_throughput_gain:g}×"))
    grown = " and ".join(t.metric.split(" ")[1] for t in trends if t.ratio >= th.itl_growth)
    return Diagnosis(
        "F2", "warning",
        f"streaming slows: ITL ({grown}) worsens as contexts grow",
        evidence,
        "decode is memory-bandwidth bound: every step reads all live K/V, so each token costs more as "
        "contexts grow",
        fixes(fp8_kv(f, fp8_bytes_text(f.result)), _halve_max_num_seqs(f),
                   _chunked_prefill(f)))


def _halve_max_num_seqs(f: RunFacts) -> FlagChange | None:
    current = f.max_num_seqs
    peak = int(f.series.peak("num_running") or 0)
    if not peak:
        return None
    half = max(min(current or peak, peak) // 2, 1)
    target = at_least_needed(f, half)
    if target >= (current or peak):
        return None  # the arrivals need all of them: halving would starve the queue
    why = f"half the {peak} that ran at the peak" if target == half else \
        f"{target} of the {peak} that ran at the peak, what the arrivals need (Little's law)"
    return FlagChange("--max-num-seqs", current, target, why + ": less K/V per step")


def _chunked_prefill(f: RunFacts) -> FlagChange | None:
    if f.config.get("enable_chunked_prefill") is not False:
        return None
    return FlagChange("--enable-chunked-prefill", "off", "on", "long prefills no longer stall decodes")


# A peak window must be decode-dominant: prefill sharing its steps flattens tokens/s by itself (bursty
# arrivals: each burst's prefill lands in the windows where running peaks). In a typical window, prefill
# only lowers its tokens/s, which makes the test stricter, so there the looser Thresholds ratio holds.
PEAK_PREFILL_RATIO = 1.0  # prompt tokens per generated token
WAITING_BACKLOG = 1.0  # requests waiting on average in the peak windows: the queue backs up


@dataclass
class LoadStep:
    """Running requests and generation tokens/s, typical vs peak windows."""

    running: tuple[float, float]
    tokens_s: tuple[float, float]

    @property
    def growth(self) -> float:
        return self.running[1] / self.running[0]

    @property
    def elasticity(self) -> float:
        return math.log(max(self.tokens_s[1] / self.tokens_s[0], 1e-9)) / math.log(self.growth)

    @property
    def itl_s(self) -> tuple[float, float]:
        return self.running[0] / self.tokens_s[0], self.running[1] / self.tokens_s[1]


def memory_bound_throughput(f: RunFacts) -> Diagnosis | None:
    """F3: running requests grow but generation tokens/s does not follow, in decode-dominant peak
    windows, with a sign that the decode is saturated (ITL rising, a queue, TTFT over its SLO, a full pool)."""
    th = f.th
    windows = typical_and_decode_peak(f)
    if windows is None:
        return None
    busy, low, high = windows
    b = f.bins
    load = LoadStep((b.running[low].mean(), b.running[high].mean()),
                    (b.generation_rate[low].mean(), b.generation_rate[high].mean()))
    if load.growth < th.running_growth or load.elasticity > th.max_throughput_elasticity:
        return None
    saturated = saturation(f, high, load.itl_s[1] / load.itl_s[0])
    if not saturated:
        return None  # tokens/s is flat only as any busier decode's is: nothing waits, nothing slows much
    return Diagnosis(
        "F3", "warning",
        "the server looks busy but tokens/s does not grow with load",
        _load_evidence(f, load, low, high) + saturated + _gpu_evidence(f),
        "memory-bound decode, not compute-bound: more running requests only add K/V to read per step",
        fixes(_knee_max_num_seqs(f, busy), "raise prefix reuse (shared, stable prompt prefixes)",
                   fp8_kv(f, fp8_bytes_text(f.result))))


def typical_and_decode_peak(f: RunFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The decode windows, the typical ones among them and the decode-dominant peak ones; None when
    there are too few, or no sustained peak (then the peaks are bursts of prefill)."""
    b, th = f.bins, f.th
    if b is None:
        return None
    busy = decode_windows(b, th.decode_window_prefill_ratio)
    if busy.sum() < th.min_bins:
        return None
    low, high = typical_and_peak(np.where(busy, b.running, np.nan))
    high &= b.prefill_rate <= PEAK_PREFILL_RATIO * b.generation_rate
    if high.sum() < max(2, math.ceil(th.sustained_fraction * len(b))):
        return None
    return busy, low, high


def _load_evidence(f: RunFacts, load: LoadStep, low: np.ndarray, high: np.ndarray) -> list[Evidence]:
    b, th = f.bins, f.th
    window = f"{int(low.sum())} typical and {int(high.sum())} decode-dominant peak windows of {b.length:.1f} s"
    (run_low, run_high), (tps_low, tps_high), (itl_low, itl_high) = load.running, load.tokens_s, load.itl_s
    return [
        Evidence("vllm:num_requests_running, typical vs peak windows", window,
                 f"{run_low:.1f} → {run_high:.1f}", f"grows >= {th.running_growth:g}×"),
        Evidence("generation tokens/s, typical vs peak windows", window,
                 f"{tps_low:,.0f} → {tps_high:,.0f}", f"flat: elasticity {load.elasticity:.2f} <= "
                 f"{th.max_throughput_elasticity:g}"),
        Evidence("ITL implied by running / generation tokens/s", window,
                 f"{itl_low * 1000:.1f} → {itl_high * 1000:.1f} ms", "rises"),
        Evidence("prompt / generated tokens in the peak windows", window,
                 round(float(b.prefill_rate[high].sum() / b.generation_rate[high].sum()), 2),
                 f"<= {PEAK_PREFILL_RATIO:g}: decode-dominant"),
    ]


def _gpu_evidence(f: RunFacts) -> list[Evidence]:
    gpu = f.series.time_mean("gpu_utilization")
    if gpu is None:
        return []
    return [Evidence("NVML GPU utilisation (%)", f.series.whole(), round(gpu, 1),
                     f">= {f.th.gpu_busy_percent:g} looks busy")]


def saturation(f: RunFacts, peak: np.ndarray, itl_growth: float) -> list[Evidence]:
    """The signs, in the peak windows, that the decode is saturated rather than only busier."""
    b, th = f.bins, f.th
    window = f"{int(peak.sum())} peak windows"
    found = []
    if itl_growth >= th.itl_growth:
        found.append(Evidence("ITL implied, peak over typical windows (×)", window, round(itl_growth, 2),
                              f">= {th.itl_growth:g}: each token slows as requests are added"))
    waiting = float(b.waiting[peak].mean())
    if waiting >= WAITING_BACKLOG:
        found.append(Evidence("vllm:num_requests_waiting, peak windows (mean)", window, round(waiting, 1),
                              f">= {WAITING_BACKLOG:g}: the queue backs up"))
    usage = float(b.usage[peak].mean())
    if usage >= th.usage_high:
        found.append(Evidence("vllm:kv_cache_usage_perc, peak windows (mean)", window, round(usage, 3),
                              f">= {th.usage_high:g}"))
    ttft, name = f.ttft_p95()
    if ttft is not None and ttft > th.ttft_p95_slo_s:
        found.append(Evidence(name, f.series.whole(), round(ttft, 3), f"> SLO {th.ttft_p95_slo_s:g} s"))
    return found


def decode_windows(b: Bins, prefill_ratio: float) -> np.ndarray:
    """Windows where decoding dominates: prefill-heavy ones are slow for another reason, and windows
    with preemptions are F6's story (recomputation eats their tokens/s)."""
    prefill_light = b.prefill_rate <= prefill_ratio * b.generation_rate
    return (b.running > 0) & (b.generation_rate > 0) & prefill_light & (b.preemptions == 0)


def typical_and_peak(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Windows between the 25th and 50th percentile of `values`, and those in the top quartile.

    Below the 25th percentile the load is too light for K/V reads to outweigh the
    weights' (tokens/s still grows with load there in any server), so it is left out.
    """
    finite = np.isfinite(values)
    if finite.sum() < 2:
        return np.zeros_like(finite), np.zeros_like(finite)
    p25, p50, p75 = np.percentile(values[finite], [25, 50, 75])
    return finite & (values >= p25) & (values <= p50), finite & (values >= p75)


def _knee_max_num_seqs(f: RunFacts, busy: np.ndarray) -> FlagChange | None:
    """The fewest running requests at which tokens/s already reached 90% of its best."""
    b = f.bins
    best = b.generation_rate[busy].max()
    enough = busy & (b.generation_rate >= 0.9 * best)
    knee = max(math.ceil(b.running[enough].min()), 1)
    target = at_least_needed(f, knee)
    if f.max_num_seqs is not None and f.max_num_seqs <= target:
        return None
    effect = f"tokens/s was within 10% of its best ({best:,.0f}/s) at {knee} running"
    if target > knee:
        effect += f"; raised to the {target} the arrivals need (Little's law), below which the queue grows"
    return FlagChange("--max-num-seqs", f.max_num_seqs, target, effect)
