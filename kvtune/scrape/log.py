"""ScrapeLog: the snapshots of one run, as series, counter increases, rates and windowed quantiles.

Windows `t0`, `t1` are seconds since the first snapshot (the clock of
`series()["time"]`), both ends included; None means the start or the end of
the log. Increases are raw differences between the snapshots inside the
window (no extrapolation to the window's edges, unlike PromQL's increase()).
A counter that goes down restarted from 0, so its new value counts as the
increase, as in Prometheus; one that first appears mid-window was created
then (from 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from .histogram import Histogram, Quantile
from .parse import Snapshot

# RunResult series name -> canonical name
SERIES_GAUGES = {
    "num_running": "running",
    "num_waiting": "waiting",
    "kv_usage": "kv_usage",
    "prefix_hit_rate_gauge": "prefix_hit_rate_gauge",
    "kvengine_num_free_blocks": "kvengine_num_free_blocks",
    "kvengine_num_cached_blocks": "kvengine_num_cached_blocks",
}
SERIES_COUNTERS = {  # exported as per-interval deltas
    "num_preemptions": "preemptions",
    "prefix_queries": "prefix_queries",
    "prefix_hits": "prefix_hits",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "requests_finished": "request_success",
    "kvengine_evictions": "kvengine_evictions",
}


@dataclass
class GaugeStats:
    min: float
    mean: float
    max: float
    last: float


@dataclass
class ScrapeLog:
    snapshots: list[Snapshot] = field(default_factory=list)
    url: str | None = None
    errors: int = 0  # failed scrapes (after retries)
    last_error: str | None = None

    def __len__(self) -> int:
        return len(self.snapshots)

    @property
    def start(self) -> float | None:
        """time.time() of the first snapshot: add it to a window time to get wall-clock time."""
        return self.snapshots[0].t if self.snapshots else None

    def window(self, t0: float | None = None, t1: float | None = None) -> list[Snapshot]:
        if not self.snapshots:
            return []
        lo = -float("inf") if t0 is None else self.start + t0
        hi = float("inf") if t1 is None else self.start + t1
        return [s for s in self.snapshots if lo <= s.t <= hi]

    # -- series in the RunResult convention ---------------------------------
    def series(self) -> dict[str, list]:
        """Gauges as sampled, counters as per-interval deltas; a metric the server lacks is left out."""
        snaps = self.snapshots
        if not snaps:
            return {"time": [], "duration": []}
        out: dict[str, list] = {"time": [s.t - self.start for s in snaps],
                                "duration": [0.0] + [b.t - a.t for a, b in pairwise(snaps)]}
        for key, name in SERIES_GAUGES.items():
            values = [s.gauges.get(name) for s in snaps]
            if any(v is not None for v in values):
                out[key] = values
        for key, name in SERIES_COUNTERS.items():
            values = [s.counters.get(name) for s in snaps]
            if any(v is not None for v in values):
                out[key] = _deltas(values)
        return out

    def newest_samples(self) -> list[tuple[float, str, float]]:
        """The newest snapshot as (time.time(), series name, value) rows in series()'s convention
        (gauges as sampled, counters as the increase since the snapshot before): what a run in
        progress streams to the store for the UI."""
        if not self.snapshots:
            return []
        pair = ScrapeLog(self.snapshots[-2:]).series()
        t = self.snapshots[-1].t
        return [(t, key, values[-1]) for key, values in pair.items()
                if key not in ("time", "duration") and values[-1] is not None]

    # -- counters ------------------------------------------------------------
    def counter_increase(self, name: str, t0: float | None = None, t1: float | None = None) -> float | None:
        """Increase over the window, through counter resets; None if the server never exported it."""
        values = [s.counters.get(name) for s in self.window(t0, t1)]
        if all(v is None for v in values):
            return None
        return sum(_deltas(values))

    def rate(self, name: str, t0: float | None = None, t1: float | None = None) -> float | None:
        """Per-second increase between the first and last snapshot of the window."""
        snaps = self.window(t0, t1)
        times = [s.t for s in snaps if name in s.counters]
        if not times:
            return None
        first = snaps[0].t if name not in snaps[0].counters else times[0]
        span = times[-1] - first
        return self.counter_increase(name, t0, t1) / span if span > 0 else None

    # -- histograms ----------------------------------------------------------
    def histogram_window(self, name: str, t0: float | None = None, t1: float | None = None) -> Histogram | None:
        """What the histogram observed within the window (bucket increases, through resets)."""
        hists = [s.histograms.get(name) for s in self.window(t0, t1)]
        present = [h for h in hists if h is not None]
        if not present:
            return None
        total = Histogram(list(present[0].bounds), [0.0] * len(present[0].bounds))
        prev, born = None, hists[0] is None
        for h in present:
            if prev is not None or born:
                total = total + h.increase_since(prev)
            prev = h
        return total

    def histogram_quantile(self, name: str, q: float, t0: float | None = None,
                           t1: float | None = None) -> float | None:
        """Prometheus' histogram_quantile over the window's bucket increases; None when it is empty."""
        h = self.histogram_window(name, t0, t1)
        return h.quantile(q) if h is not None else None

    def histogram_quantile_bound(self, name: str, q: float, t0: float | None = None,
                                 t1: float | None = None) -> Quantile:
        """The quantile as the buckets can tell it: a value, "< first bound" or "> last bound"."""
        h = self.histogram_window(name, t0, t1)
        return h.quantile_bound(q) if h is not None else Quantile()

    def histogram_count(self, name: str, t0: float | None = None, t1: float | None = None) -> float | None:
        h = self.histogram_window(name, t0, t1)
        return h.count if h is not None else None

    def histogram_mean(self, name: str, t0: float | None = None, t1: float | None = None) -> float | None:
        h = self.histogram_window(name, t0, t1)
        return h.mean() if h is not None else None

    # -- gauges --------------------------------------------------------------
    def gauge_stats(self, name: str, t0: float | None = None, t1: float | None = None) -> GaugeStats | None:
        values = [s.gauges[name] for s in self.window(t0, t1) if name in s.gauges]
        if not values:
            return None
        return GaugeStats(min(values), sum(values) / len(values), max(values), values[-1])


def _deltas(values: list[float | None]) -> list[float]:
    """Per-snapshot increase of a cumulative counter: 0 for the first, through resets and gaps."""
    out, prev = [], None
    born = values and values[0] is None  # absent at first, so created (at 0) later
    for v in values:
        if v is None:
            out.append(0.0)
            continue
        if prev is None:
            out.append(v if born and out else 0.0)
        else:
            out.append(v - prev if v >= prev else v)
        prev = v
    return out
