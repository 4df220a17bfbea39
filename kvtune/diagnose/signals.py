"""A run's server series as time-weighted signals, the same for sim steps and live scrapes.

Both kinds of series carry `time` (the end of each sample) and `duration`
(what the sample covers): a sim step lasts its step time and idle gaps between
steps have no sample (nothing runs, nothing waits); a scrape covers the
interval since the previous one. So a time-weighted mean is
sum(value × duration) / window length, and "sustained" is the share of the
run's time a condition held, whatever the sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..scrape.log import SERIES_COUNTERS


class Series:
    """Numpy views of RunResult.series; gauges that a scrape missed are NaN and carry no weight."""

    def __init__(self, series: dict[str, list]):
        self._raw = series
        self._arrays: dict[str, np.ndarray] = {}
        self.time = self._array("time")
        duration = self._array("duration") if "duration" in series else None
        self.duration = np.zeros_like(self.time) if duration is None else np.nan_to_num(duration)
        self.start = float(np.min(self.time - self.duration)) if len(self.time) else 0.0
        self.end = float(np.max(self.time)) if len(self.time) else 0.0

    def __len__(self) -> int:
        return len(self.time)

    def busy(self) -> "Series":
        """The samples from the first busy one to the one after the last:
        a watch that began before the traffic, or ran on after it, reads the same windows and shares
        of time as a run of that traffic alone."""
        if self.get("num_running") is None:
            return self
        # Busy: a request running or waiting at the sample, or any work counted since the last one
        # (a request may come and go between two scrapes: its counts must not be cut off)
        active = np.zeros(len(self), dtype=bool)
        for name in ("num_running", "num_waiting", *SERIES_COUNTERS, "num_tokens"):
            values = self.get(name)
            if values is not None:
                active |= np.nan_to_num(values) > 0
        if not active.any():
            return self
        n = len(self)
        first, last = int(np.argmax(active)), n - 1 - int(np.argmax(active[::-1]))
        if first == 0 and last == n - 1:
            return self
        return Series({k: (v[first:last + 1] if isinstance(v, list) and len(v) == n else v)
                       for k, v in self._raw.items()})

    @property
    def span_s(self) -> float:
        return self.end - self.start

    def has(self, name: str) -> bool:
        """Present, aligned with `time` (one value per sample) and not all missing."""
        values = self._raw.get(name)
        return bool(values) and len(values) == len(self.time) and any(v is not None for v in values)

    def get(self, name: str) -> np.ndarray | None:
        return self._array(name) if self.has(name) else None

    def _array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            values = self._raw.get(name, ())
            self._arrays[name] = np.array([np.nan if v is None else v for v in values], dtype=float)
        return self._arrays[name]

    # -- whole-run figures ---------------------------------------------------
    def total(self, name: str) -> float | None:
        values = self.get(name)
        return None if values is None else float(np.nansum(values))

    def peak(self, name: str) -> float | None:
        values = self.get(name)
        return None if values is None else float(np.nanmax(values))

    def time_mean(self, name: str) -> float | None:
        values = self.get(name)
        if values is None or self.span_s <= 0:
            return None
        return float(np.nansum(values * self.duration) / self.span_s)

    def time_quantile(self, name: str, q: float) -> float | None:
        """The level a gauge stays at or under for q % of the sampled time (None without it)."""
        values = self.get(name)
        return None if values is None else time_quantile(values, self.duration, q)

    def fraction_of_time(self, mask: np.ndarray) -> float:
        """Share of the run's time covered by the samples where `mask` holds."""
        if self.span_s <= 0:
            return 0.0
        return float(self.duration[mask].sum() / self.span_s)

    # -- windows in words ----------------------------------------------------
    def whole(self) -> str:
        return f"whole run ({self.start:.1f}–{self.end:.1f} s)"

    def window(self, first: int, last: int) -> str:
        return f"{self.time[first] - self.duration[first]:.1f}–{self.time[last]:.1f} s"


def time_quantile(values: np.ndarray, durations: np.ndarray, q: float) -> float:
    """The value that a step series stays at or under for q % of its time (NaN samples carry no
    weight); the highest value where no sample has a duration."""
    keep = np.isfinite(values) & (durations > 0)
    if not keep.any():
        return float(np.nanmax(values)) if np.isfinite(values).any() else 0.0
    values, durations = values[keep], durations[keep]
    order = np.argsort(values, kind="stable")
    covered = np.cumsum(durations[order])
    return float(values[order][np.searchsorted(covered, q / 100 * covered[-1])])


@dataclass
class Bins:
    """The run cut into equal time windows: gauges as time-weighted means, counters as rates."""

    start: np.ndarray  # seconds
    length: float
    running: np.ndarray
    waiting: np.ndarray
    usage: np.ndarray
    generation_rate: np.ndarray  # tokens/s
    prefill_rate: np.ndarray  # prompt tokens/s
    preemptions: np.ndarray  # count in the window
    context_per_seq: np.ndarray | None  # tokens of K/V per running request

    def __len__(self) -> int:
        return len(self.start)

    @property
    def per_request_itl(self) -> np.ndarray:
        """Seconds between a running request's tokens, as the server's own counters imply."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.generation_rate > 0, self.running / self.generation_rate, np.nan)


SAMPLES_PER_BIN = 3  # a scraped gauge is one instant: average a few before comparing windows


def time_bins(series: Series, count: int, pool_tokens: int | None = None) -> Bins | None:
    """`count` windows over the run, each at least SAMPLES_PER_BIN sampling intervals long; None
    without the basic series."""
    if not len(series) or series.span_s <= 0 or not series.has("num_running"):
        return None
    sampled = series.duration[series.duration > 0]
    interval = float(np.median(sampled)) if len(sampled) else 0.0
    shortest = max(series.span_s / count, SAMPLES_PER_BIN * interval)
    n = max(int(series.span_s / shortest + 1e-9), 1)
    length = series.span_s / n  # equal windows that tile the run exactly
    index = np.clip(((series.time - series.start) / length).astype(int), 0, n - 1)

    def gauge(name: str) -> np.ndarray:
        values = series.get(name)
        if values is None:
            return np.zeros(n)
        weight = np.where(np.isnan(values), 0.0, series.duration)
        return np.bincount(index, np.nan_to_num(values) * weight, n) / length

    def counter(name: str) -> np.ndarray:
        values = series.get(name)
        return np.zeros(n) if values is None else np.bincount(index, np.nan_to_num(values), n)

    running = gauge("num_running")
    bins = Bins(start=series.start + np.arange(n) * length, length=length, running=running,
                waiting=gauge("num_waiting"), usage=gauge("kv_usage"),
                generation_rate=counter("generation_tokens") / length,
                prefill_rate=_prefill_tokens(series, counter) / length,
                preemptions=counter("num_preemptions"), context_per_seq=None)
    bins.context_per_seq = _context_per_seq(series, index, n, bins, pool_tokens)
    return bins


def _prefill_tokens(series: Series, counter) -> np.ndarray:
    """Live servers count prompt tokens; a sim step's computed tokens beyond the sampled ones are prefill."""
    if series.has("prompt_tokens"):
        return counter("prompt_tokens")
    return np.maximum(counter("num_tokens") - counter("generation_tokens"), 0)


def _context_per_seq(series: Series, index: np.ndarray, n: int, bins: Bins,
                     pool_tokens: int | None) -> np.ndarray | None:
    """The sim logs the K/V each step read; elsewhere the pool's used tokens per running request."""
    with np.errstate(divide="ignore", invalid="ignore"):
        if series.has("context_tokens") and series.has("num_seqs"):
            read = np.bincount(index, np.nan_to_num(series.get("context_tokens")), n)
            seqs = np.bincount(index, np.nan_to_num(series.get("num_seqs")), n)
            return np.where(seqs > 0, read / seqs, np.nan)
        if pool_tokens and series.has("kv_usage"):
            return np.where(bins.running > 0, bins.usage * pool_tokens / bins.running, np.nan)
    return None


def best_intervals_rate(series: Series, hits: str, queries: str, share: float) -> float | None:
    """hits / queries over the samples (scrape intervals, sim steps) with the highest ratio that together
    carry `share` of all queries; None without queries."""
    num, den = series.get(hits), series.get(queries)
    if num is None or den is None:
        return None
    num, den = np.nan_to_num(num), np.nan_to_num(den)
    asked = den > 0
    if not asked.any():
        return None
    num, den = num[asked], den[asked]
    order = np.argsort(-(num / den), kind="stable")
    covered = np.cumsum(den[order])
    best = order[: int(np.searchsorted(covered, share * covered[-1])) + 1]
    return float(num[best].sum() / den[best].sum())


def quartile_masks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Masks of the bottom and top quartile of the finite values (NaN in neither)."""
    finite = np.isfinite(values)
    if finite.sum() < 2:
        return np.zeros_like(finite), np.zeros_like(finite)
    low, high = np.percentile(values[finite], [25, 75])
    return finite & (values <= low), finite & (values >= high)
