"""A run's series in at most SUMMARY_POINTS samples: how a run stored in summary keeps its charts."""
from __future__ import annotations

import math

import numpy as np

SUMMARY_POINTS = 200  # points per series of a run stored in summary
# Series that count events per sample (a sim step's tokens, a scrape interval's counter
# increase: kvtune.scrape.log.SERIES_COUNTERS): downsampled by their sum. Any other
# series but time and duration is a gauge (usage, running, waiting): by its peak.
COUNTER_SERIES = frozenset({
    "num_preemptions", "prefix_queries", "prefix_hits", "num_tokens", "generation_tokens", "num_seqs",
    "context_tokens", "prompt_tokens", "requests_finished", "kvengine_evictions"})
_SIGNIFICANT = 6  # digits a summary run's float series keep



def downsample_series(series: dict[str, list], points: int = SUMMARY_POINTS,
                      finished_at: list[float] | None = None) -> dict[str, list]:
    """A run's series in at most `points` samples, each one time bucket of the run.

    The run's span (first to last `time`) is cut into `points` equal windows and the
    samples in each are merged into one; empty windows (a sim run's idle gaps) give none;
    series of at most `points` samples keep every sample. A merged sample's `time` is its last sample's (a sample's time is its end), its
    `duration` the sum of theirs (the time they cover); a counter (COUNTER_SERIES: events
    per sample) is their sum, so totals, the prefix hit rate and the preemptions so far
    are exact; a gauge (KV usage, running, waiting, any other series) is their peak, as
    the report's and the UI's charts bin it, so the peaks they draw survive. Time-weighted
    means of gauges become upper bounds. Missing values (None, NaN) are skipped; a window
    with none stays None. Floats keep 6 significant digits.

    With `finished_at` (the completed requests' finish times) and no `requests_finished`
    series yet, one is added, as a live server's scrape has: requests finished per sample,
    so a summary run still says how many requests its series cover (the diagnosis reads it
    when there are no request records).

    Series not aligned with `time` are kept as they are when short, else thinned evenly."""
    times = series.get("time") or []
    n = len(times)
    out: dict[str, list] = {}
    if n == 0:
        return {name: _thin(values, points) for name, values in series.items()}
    t = _floats(times)
    finite = np.isfinite(t)
    lo, hi = (float(t[finite].min()), float(t[finite].max())) if finite.any() else (0.0, 0.0)
    t = np.where(finite, t, lo)
    width = (hi - lo) / points
    if n <= points:  # short enough: each sample stays one (so downsampling a summary run changes nothing)
        bucket = np.arange(n)
    elif width > 0:
        bucket = np.minimum(((t - lo) / width).astype(int), points - 1)
    else:
        bucket = np.zeros(n, int)
    used = np.unique(bucket)  # sorted: the buckets in time order
    slot = np.searchsorted(used, bucket)  # each sample's merged sample
    m = len(used)
    for name, values in series.items():
        if name == "time":
            merged = _merge(t, slot, m, "max")
        elif len(values) != n:
            out[name] = _thin(values, points)
            continue
        else:
            kind = "sum" if name == "duration" or name in COUNTER_SERIES else "max"
            merged = _merge(_floats(values), slot, m, kind)
        out[name] = _compact(merged, all(isinstance(v, int) or v is None for v in values))
    if finished_at and "requests_finished" not in series:
        ends = np.asarray(out["time"], dtype=float)
        at = np.clip(np.searchsorted(ends, np.asarray(finished_at, dtype=float) - 1e-9), 0, m - 1)
        out["requests_finished"] = [int(c) for c in np.bincount(at, minlength=m)]
    return out


def _floats(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _merge(values: np.ndarray, slot: np.ndarray, m: int, kind: str) -> np.ndarray:
    present = ~np.isnan(values)
    counts = np.bincount(slot[present], minlength=m)
    if kind == "sum":
        merged = np.bincount(slot[present], values[present], minlength=m)
    else:
        merged = np.full(m, -np.inf)
        np.maximum.at(merged, slot[present], values[present])
    return np.where(counts > 0, merged, np.nan)


def _compact(values: np.ndarray, ints: bool) -> list:
    if ints:
        return [None if math.isnan(v) else int(v) for v in values.tolist()]
    return [None if math.isnan(v) else float(f"{v:.{_SIGNIFICANT}g}") for v in values.tolist()]


def _thin(values: list, points: int) -> list:
    if len(values) <= points:
        return list(values)
    return [values[int(i)] for i in np.linspace(0, len(values) - 1, points)]
