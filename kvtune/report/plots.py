"""The report's figures, drawn with matplotlib's Agg canvas straight to PNG bytes.

No pyplot: it would switch the backend of whatever process imports the report.
Each function returns None when there is nothing to draw.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import io
import math

import numpy as np

from ..search.results import RunView
from ..search.ranking import Measurement
from .words import metric_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FEASIBLE, INFEASIBLE, FAILED, BEST = "#1f77b4", "#d62728", "#7f7f7f", "#2ca02c"
RUN_COLOURS = ("#2ca02c", "#ff7f0e")  # recommended, default
MAX_POINTS = 400  # time bins per series: a sim run has a point per engine step


def new_figure(width: float, height: float) -> Figure:
    """A figure on matplotlib's Agg canvas; matplotlib is imported here, by the commands that draw, so
    the others (`kvtune run`, `--help`) start without it."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def history(trials: list[Measurement], value_label: str) -> bytes | None:
    """Each trial's objective value, feasible and not, with the best feasible value so far."""
    done = [t for t in trials if t.ok and _finite(t.value)]
    if not done:
        return None
    fig = new_figure(8, 3.6)
    ax = fig.subplots()
    for feasible, colour, marker, label in ((True, FEASIBLE, "o", "meets the SLOs"),
                                            (False, INFEASIBLE, "x", "misses an SLO")):
        pts = [t for t in done if t.feasible == feasible]
        if pts:
            ax.scatter([t.number for t in pts], [t.value for t in pts], c=colour, marker=marker, s=28, label=label)
    failed = [t for t in trials if t.state == "FAIL" and not t.surplus]
    if failed:
        low = min(t.value for t in done)
        ax.scatter([t.number for t in failed], [low] * len(failed), c=FAILED, marker="v", s=28,
                   label="failed (not plotted to scale)")
    steps = _best_so_far(trials)
    if steps:
        ax.step(*zip(*steps), where="post", c=BEST, lw=1.5, label="best so far (meets the SLOs)")
    ax.set(xlabel="trial", ylabel=value_label, title="Optimisation history (stage 1, simulator)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return png(fig)


def _best_so_far(trials: list[Measurement]) -> list[tuple[int, float]]:
    best, steps = -math.inf, []
    for t in sorted(trials, key=lambda t: t.number):
        if t.feasible and _finite(t.value):
            best = max(best, t.value)
        if best > -math.inf:
            steps.append((t.number, best))
    return steps


def tradeoff(trials: list[Measurement], latency: str, front: set[int], slo_limit: float | None) -> bytes | None:
    """Throughput against a latency percentile; the Pareto front (multi objective) joined by a line."""
    pts = [(t, t.throughput_rps, _latency(t, latency)) for t in trials if t.ok and t.duplicate_of is None]
    pts = [(t, x, y) for t, x, y in pts if _finite(x) and _finite(y)]
    if not pts:
        return None
    fig = new_figure(8, 3.6)
    ax = fig.subplots()
    for feasible, colour, marker, label in ((True, FEASIBLE, "o", "meets the SLOs"),
                                            (False, INFEASIBLE, "x", "misses an SLO")):
        sel = [(x, y * 1000) for t, x, y in pts if t.feasible == feasible]
        if sel:
            ax.scatter(*zip(*sel), c=colour, marker=marker, s=28, label=label)
    on_front = sorted((x, y * 1000) for t, x, y in pts if t.number in front)
    if on_front:
        ax.plot(*zip(*on_front), c=BEST, lw=1.5, marker="o", ms=4, label="Pareto front")
    if slo_limit is not None:
        ax.axhline(slo_limit * 1000, c=INFEASIBLE, ls="--", lw=1, label=f"{metric_label(latency)} SLO")
    latencies = [y for _, _, y in pts if y > 0]
    if latencies and max(latencies) > 20 * min(latencies):  # minutes of queueing next to milliseconds
        ax.set_yscale("log")
    ax.set(xlabel="throughput (req/s)", ylabel=f"{metric_label(latency)} (ms)",
           title=f"Throughput vs {metric_label(latency)} (stage 1, simulator)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return png(fig)


def _latency(t: Measurement, name: str) -> float | None:
    observed = t.observed.get(name)
    return observed if observed is not None else t.summary.get(name)


def importance(values: dict[str, float]) -> bytes:
    names = list(values)[::-1]  # largest on top
    fig = new_figure(7, 0.5 * len(names) + 1.2)
    ax = fig.subplots()
    ax.barh(names, [values[n] * 100 for n in names], color=FEASIBLE)
    for y, name in enumerate(names):
        ax.text(values[name] * 100, y, f" {values[name] * 100:.0f} %", va="center", fontsize=8)
    ax.set(xlabel="importance (%)", title="Parameter importance", xlim=(0, 110))
    ax.grid(axis="x", alpha=0.3)
    return png(fig)


def kv_over_time(runs: list[RunView]) -> bytes | None:
    """KV usage, prefix-cache hit rate and preemptions over each run, the runs overlaid."""
    runs = [r for r in runs if len(r.result.series.get("time") or [])]
    if not runs:
        return None
    fig = new_figure(8, 7)
    usage_ax, hit_ax, pre_ax = fig.subplots(3, 1, sharex=True)
    most = 0.0
    for run, colour in zip(runs, RUN_COLOURS):
        s = _binned(run.result.series)
        label = f"{run.label}, {run.stage} run"
        usage_ax.plot(s["time"], s["kv_usage"] * 100, c=colour, lw=1.2, label=label)
        hit_ax.plot(s["time"], s["hit_rate"] * 100, c=colour, lw=1.2, label=label)
        pre_ax.step(s["time"], s["preemptions"], c=colour, lw=1.2, where="post", label=label)
        most = max(most, float(s["preemptions"][-1]))
    usage_ax.set(ylabel="KV blocks used (%)", ylim=(0, 105), title="KV cache over the run")
    hit_ax.set(ylabel="prefix hit rate so far (%)", ylim=(0, 105))
    pre_ax.set(ylabel="preemptions so far", xlabel="time (s)", ylim=(0, max(1.0, most * 1.1)))
    for ax in (usage_ax, hit_ax, pre_ax):
        ax.grid(alpha=0.3)
    usage_ax.legend(fontsize=8, loc="best")
    return png(fig)


def _binned(series: dict) -> dict[str, np.ndarray]:
    """Per time bin that holds samples: peak KV usage, and the hit rate and preemptions up to its end."""
    t = _array(series.get("time"))
    n = len(t)
    edges = np.linspace(t[0], t[-1], min(n, MAX_POINTS) + 1) if n > 1 else np.array([t[0], t[0] + 1])
    bins = len(edges) - 1
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    usage = np.full(bins, -np.inf)
    np.fmax.at(usage, idx, np.nan_to_num(_array(series.get("kv_usage"), n), nan=-np.inf))
    queries = np.cumsum(np.bincount(idx, np.nan_to_num(_array(series.get("prefix_queries"), n)), bins))
    hits = np.cumsum(np.bincount(idx, np.nan_to_num(_array(series.get("prefix_hits"), n)), bins))
    preempted = np.cumsum(np.bincount(idx, np.nan_to_num(_array(series.get("num_preemptions"), n)), bins))
    with np.errstate(invalid="ignore", divide="ignore"):
        hit_rate = np.where(queries > 0, hits / queries, np.nan)
    usage[np.isinf(usage)] = np.nan
    filled = np.bincount(idx, minlength=bins) > 0  # a sim run's steps are irregular: skip empty bins
    return {"time": edges[1:][filled], "kv_usage": usage[filled], "hit_rate": hit_rate[filled],
            "preemptions": preempted[filled]}


def _array(values, n: int | None = None) -> np.ndarray:
    if values is None:
        return np.full(n or 0, np.nan)
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)
