"""The probe runs, and what they measured: each request's token receipt times, and from them
a probe's TTFT and steady inter-token gap (streams merged into chunks counted right), their
spread, and the server's speed drift over the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .design import ITL, PREFILL_TIME, TTFT, Probe


@dataclass
class RequestTiming:
    sent: float  # perf_counter seconds
    token_times: list[float] = field(default_factory=list)  # one per output token, receipt time

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent


@dataclass
class TrialRun:
    warmup: list[int] | None
    prompts: list[list[int]]
    requests: list[RequestTiming]
    # A loaded probe: the background's prompts and timings, and how many tokens its first
    # request had received when each arriving request was sent.
    background: list[list[int]] = field(default_factory=list)
    background_requests: list[RequestTiming] = field(default_factory=list)
    sent_at_tokens: list[int] = field(default_factory=list)
    # The server's mean vllm:request_prefill_time_seconds over the measured requests
    # (None: not exported, or other requests finished meanwhile).
    prefill_time_s: float | None = None


@dataclass
class ProbeRun:
    probe: Probe
    trials: list[TrialRun]

    def loaded_selection(self) -> list[int]:
        """A loaded probe's arrivals that count: all but the slowest fifth (a hiccup of
        the machine, not the server's way)."""
        ttfts = np.array([r.ttft for r in self.trials[0].requests])
        keep = max(1, int(np.ceil(0.8 * len(ttfts))))
        return sorted(np.argsort(ttfts, kind="stable")[:keep].tolist())

    def loaded_gaps(self) -> list[float]:
        """The background's gaps from the first arrival's send to the last one's answer."""
        trial = self.trials[0]
        start, end = trial.requests[0].sent, trial.requests[-1].token_times[0]
        gaps = []
        for r in trial.background_requests:
            arr = np.asarray(r.token_times)
            gaps.extend(chunk_gaps(arr[(arr >= start) & (arr <= end)]))
        return gaps

    @property
    def measures(self) -> tuple[str, ...]:
        """The probe's measures, and the server's prefill time where every trial read it."""
        timed = not self.probe.background and all(t.prefill_time_s is not None for t in self.trials)
        return (*self.probe.measures, *((PREFILL_TIME,) if timed else ()))

    def _per_trial(self, measure: str) -> list[float]:
        """An isolated probe's TTFT or server prefill time, one per trial (its first request)."""
        if measure == TTFT:
            return [t.requests[0].ttft for t in self.trials]
        return [t.prefill_time_s for t in self.trials]

    def measured(self, measure: str) -> float:
        """An observable in seconds: the median TTFT of the trials' first requests, or
        the median over trials of the steady mean inter-token gap (see `steady_itl`); for a
        loaded probe, the mean TTFT of its selected arrivals and the background's mean
        gap while they arrive (mixed steps included, as a TPOT under traffic has them)."""
        if self.probe.background:
            if measure == TTFT:
                requests = self.trials[0].requests
                return float(np.mean([requests[i].ttft for i in self.loaded_selection()]))
            gaps = self.loaded_gaps()  # none: the window held at most one chunk of each stream
            return float(np.mean(gaps)) if gaps else float("nan")
        if measure in (TTFT, PREFILL_TIME):
            return float(np.median(self._per_trial(measure)))
        # A trial whose streams came in too few chunks to time (nan) is left out, unless most are.
        values = [steady_itl([r.token_times for r in t.requests]) for t in self.trials]
        finite = [v for v in values if np.isfinite(v)]
        return float(np.median(finite)) if 2 * len(finite) > len(values) else float("nan")

    def spread(self, measure: str) -> float:
        """The observable's standard error, from the spread of what it is the median of
        (the trials' TTFTs; the window's gaps for an ITL): MAD * 1.4826 * 1.253 / sqrt(n);
        std / sqrt(n) for a loaded probe's means."""
        if self.probe.background:
            values = ([self.trials[0].requests[i].ttft for i in self.loaded_selection()] if measure == TTFT
                      else self.loaded_gaps())
            return float(np.std(values) / np.sqrt(len(values))) if len(values) > 1 else 0.0  # of a mean
        if measure in (TTFT, PREFILL_TIME):
            values = self._per_trial(measure)
        else:
            values = [g for t in self.trials for g in steady_gaps([r.token_times for r in t.requests])]
        if len(values) < 2:
            return 0.0
        arr = np.asarray(values)
        return float(1.4826 * 1.253 * np.median(np.abs(arr - np.median(arr))) / np.sqrt(len(arr)))


def chunk_gaps(times) -> list[float]:
    """Per token after the first chunk, its share of the gap before the chunk it came in.

    A server may merge several tokens into one streamed chunk, or write several chunks in
    one burst (vLLM does both under load, when its frontend falls behind the engine): they
    arrive with one receipt time (repeated in `RequestTiming.token_times`, one per token, by
    the usage's token count; the lines of one network read, or of reads within stream.BURST_S,
    by stream_request). Their steps took the time since
    the chunk before, so each of its k tokens gets a k-th of that gap; the first chunk's
    tokens, whose steps began before the window, none. Without merging, np.diff(times).
    The gaps add up to the span: their mean is span / tokens after the first chunk."""
    arr = np.asarray(times, dtype=float)
    if len(arr) < 2:
        return []
    chunks, counts = np.unique(arr, return_counts=True)
    return np.repeat(np.diff(chunks) / counts[1:], counts[1:]).tolist()


def _steady_window(token_times: list[list[float]]) -> list[np.ndarray]:
    """Each request's token times while every request of a batch decodes.

    The window starts at the token (of each request) sent with the batch's last first
    token (every prefill done) and ends one token before the first request's last
    token (none has finished): the same steps for all requests, found by time. Too
    short a window: every token after the first. Tokens merged into one chunk share its
    time: the window starts at the last of the chunk's (those before it were made before
    the window), so its span over its gaps counts the tokens made in it."""
    start = max(times[0] for times in token_times)
    end = min(times[-1] for times in token_times)
    windows = []
    for times in token_times:
        arr = np.asarray(times)
        i0 = int(np.argmin(np.abs(arr - start)))
        i0 = int(np.searchsorted(arr, arr[i0], side="right")) - 1  # the last token of its chunk
        i1 = int(np.argmin(np.abs(arr - end))) - 1
        if i1 - i0 >= 1:
            windows.append(arr[i0:i1 + 1])
    if windows:
        return windows
    for times in token_times:
        i = int(np.searchsorted(times, times[0], side="right")) - 1  # the last token of the first chunk
        if len(times) > 2 and len(times) - i >= 2:
            windows.append(np.asarray(times[i:]))
    return windows


def steady_gaps(token_times: list[list[float]]) -> list[float]:
    """The gaps between tokens in the steady window (`_steady_window`)."""
    return [g for window in _steady_window(token_times) for g in chunk_gaps(window)]


def steady_itl(token_times: list[list[float]]) -> float:
    """The mean gap in the steady window: its span over its gaps, per request, then the
    median over the batch. A client that reads a token late moves one gap up and the next
    down, so the span is immune to it; a step the server stretches (a GC pause, a command
    read mid-loop) is in it, as it is in every TPOT. A median of gaps would drop those."""
    spans = [(w[-1] - w[0]) / (len(w) - 1) for w in _steady_window(token_times) if len(w) > 1]
    return float(np.median(spans)) if spans else float("nan")


def speed_drift(runs: list[ProbeRun]) -> dict | None:
    """The plan's closing drift checks against its opening ones, where the plan opens and closes
    with the same probe (design_probes' drift check): the median ITL of each end's runs of it
    (the first and the last half of them) and the relative change; `runs` says how many a side."""
    if len(runs) < 2 or runs[0].probe != runs[-1].probe or ITL not in runs[0].probe.measures:
        return None
    itls = [run.measured(ITL) for run in runs if run.probe == runs[0].probe]
    half = len(itls) // 2
    first, last = _finite_median(itls[:half]), _finite_median(itls[len(itls) - half:])
    if not (math.isfinite(first) and math.isfinite(last) and first > 0):  # checks without a timing
        return None
    return {"probe": runs[0].probe.label, "first_s": first, "last_s": last, "change": last / first - 1.0,
            "runs": half}


def _finite_median(values: list[float]) -> float:
    """The median of the finite values; nan unless they are most of them."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if 2 * len(finite) > len(values) else float("nan")


def merge_repeated(runs: list[ProbeRun]) -> list[ProbeRun]:
    """The runs with each probe's repeats (the drift checks) as one run of all their trials, where
    its first run was: the fit weighs the drift check as one decode probe, timed by the median of
    all its trials."""
    merged: dict[Probe, ProbeRun] = {}
    for run in runs:
        if run.probe in merged:
            merged[run.probe].trials.extend(run.trials)
        else:
            merged[run.probe] = ProbeRun(run.probe, list(run.trials))
    return list(merged.values())
