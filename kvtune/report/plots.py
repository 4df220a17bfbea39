"""kvtune's charts, for the report and the UI (kvtune.ui.charts) alike, as PNG bytes through `png`.

Each chart takes plain data and returns a matplotlib Figure on the Agg canvas, or None
when there is nothing to draw. No pyplot: it would switch the backend of whatever
process imports the report.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import io
import math

import numpy as np

from ..search.report_data import RunView
from ..search.measurement import Measurement
from ..search.ranking import SIM_TIE, within_tie
from .words import metric_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..plan import CapacityPlan

FEASIBLE, INFEASIBLE, FAILED, BEST = "#1f77b4", "#d62728", "#7f7f7f", "#2ca02c"
HIT_RATE, SO_FAR = "#9467bd", "#ff7f0e"
RUN_COLOURS = ("#2ca02c", "#ff7f0e")  # recommended, default
MAX_POINTS = 400  # time bins per series: a sim run has a point per engine step
GAUGES = ("kv_usage", "num_running", "num_waiting")  # peak per bin
BINNED = ("time", *GAUGES, "preemptions", "preemptions_total", "hit_rate")


def new_figure(width: float, height: float) -> Figure:
    """A figure on matplotlib's Agg canvas; matplotlib is imported here, by the commands that draw, so
    the others (`kvtune run`, `--help`) start without it."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


# ---------------------------------------------------------------- a study's trials

def history(trials: list[Measurement], value_label: str) -> Figure | None:
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
    title = "Optimisation history (stage 1, simulator)"
    low, high = min(t.value for t in done), max(t.value for t in done)
    if within_tie(low, high):
        # no offset axis magnifying differences the simulator cannot resolve: the axis starts at 0
        ax.set_ylim(min(0.0, low), high * 1.1 if high > 0 else 1.0)
        title += f": every trial within {SIM_TIE:.0%}, the simulator's tie"
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.set(xlabel="trial", ylabel=value_label, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def _best_so_far(trials: list[Measurement]) -> list[tuple[int, float]]:
    best, steps = -math.inf, []
    for t in sorted(trials, key=lambda t: t.number):
        if t.feasible and _finite(t.value):
            best = max(best, t.value)
        if best > -math.inf:
            steps.append((t.number, best))
    return steps


def tradeoff_points(trials: list[Measurement], latency: str) -> list[tuple[Measurement, float, float]]:
    """(trial, throughput, latency in s) of each completed trial that is not a repeat of another."""
    points = []
    for t in trials:
        if not t.ok or t.duplicate_of is not None:
            continue
        observed = t.observed.get(latency)
        y = observed if observed is not None else t.summary.get(latency)
        if _finite(t.throughput_rps) and _finite(y):
            points.append((t, t.throughput_rps, y))
    return points


def pareto(points: list[tuple[Measurement, float, float]], front: Collection[int], latency_label: str,
           slo_limit_s: float | None) -> Figure | None:
    """Throughput against a latency percentile; the front (trial numbers no other beats on both) joined by a line."""
    if not points:
        return None
    fig = new_figure(8, 3.6)
    ax = fig.subplots()
    for feasible, colour, marker, label in ((True, FEASIBLE, "o", "meets the SLOs"),
                                            (False, INFEASIBLE, "x", "misses an SLO")):
        sel = [(x, y * 1000) for t, x, y in points if t.feasible == feasible]
        if sel:
            ax.scatter(*zip(*sel), c=colour, marker=marker, s=28, label=label)
    on_front = sorted((x, y * 1000) for t, x, y in points if t.number in front)
    if on_front:
        ax.plot(*zip(*on_front), c=BEST, lw=1.5, marker="o", ms=4, label="Pareto front")
    if slo_limit_s is not None:
        ax.axhline(slo_limit_s * 1000, c=INFEASIBLE, ls="--", lw=1, label=f"{latency_label} SLO")
    latencies = [y for _, _, y in points if y > 0]
    if latencies and max(latencies) > 20 * min(latencies):  # minutes of queueing next to milliseconds
        ax.set_yscale("log")
    ax.set(xlabel="throughput (req/s)", ylabel=f"{latency_label} (ms)",
           title=f"Throughput vs {latency_label} (stage 1, simulator)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def tradeoff(trials: list[Measurement], latency: str, front: Collection[int],
             slo_limit: float | None) -> Figure | None:
    """The report's Pareto chart: its front is the study's own (multi objective), else empty."""
    return pareto(tradeoff_points(trials, latency), front, metric_label(latency), slo_limit)


def importance(values: dict[str, float]) -> Figure | None:
    if not values:
        return None
    names = list(values)[::-1]  # largest on top
    fig = new_figure(7, 0.5 * len(names) + 1.2)
    ax = fig.subplots()
    ax.barh(names, [values[n] * 100 for n in names], color=FEASIBLE)
    for y, name in enumerate(names):
        ax.text(values[name] * 100, y, f" {values[name] * 100:.0f} %", va="center", fontsize=8)
    ax.set(xlabel="importance (%)", title="Parameter importance", xlim=(0, 110))
    ax.grid(axis="x", alpha=0.3)
    return fig


# ---------------------------------------------------------------- runs over time

def kv_over_time(runs: list[RunView]) -> Figure | None:
    """KV usage, prefix-cache hit rate and preemptions over each run, the runs overlaid."""
    runs = [r for r in runs if len(r.result.series.get("time") or [])]
    if not runs:
        return None
    fig = new_figure(8, 7)
    usage_ax, hit_ax, pre_ax = fig.subplots(3, 1, sharex=True)
    most = 0.0
    for run, colour in zip(runs, RUN_COLOURS):
        s = binned(run.result.series)
        label = f"{run.label}, {run.stage} run"
        usage_ax.plot(s["time"], s["kv_usage"] * 100, c=colour, lw=1.2, label=label)
        hit_ax.plot(s["time"], s["hit_rate"] * 100, c=colour, lw=1.2, label=label)
        pre_ax.step(s["time"], s["preemptions_total"], c=colour, lw=1.2, where="post", label=label)
        most = max(most, float(s["preemptions_total"][-1]))
    usage_ax.set(ylabel="KV blocks used (%)", ylim=(0, 105), title="KV cache over the run")
    hit_ax.set(ylabel="prefix hit rate so far (%)", ylim=(0, 105))
    pre_ax.set(ylabel="preemptions so far", xlabel="time (s)", ylim=(0, max(1.0, most * 1.1)))
    for ax in (usage_ax, hit_ax, pre_ax):
        ax.grid(alpha=0.3)
    usage_ax.legend(fontsize=8, loc="best")
    return fig


def timeline(series: dict) -> Figure | None:
    """KV usage, running and waiting requests, prefix hit rate and preemptions over one run (or a live scrape)."""
    s = binned(series)
    if not len(s["time"]):
        return None
    fig = new_figure(12, 8)  # the UI's full page width
    usage_ax, queue_ax, hit_ax, pre_ax = fig.subplots(4, 1, sharex=True)
    usage_ax.plot(s["time"], s["kv_usage"] * 100, c=FEASIBLE, lw=1.2)
    usage_ax.set(title="KV blocks in use (%)", ylim=(0, 105))
    queue_ax.plot(s["time"], s["num_running"], c=BEST, lw=1.2, label="running")
    queue_ax.plot(s["time"], s["num_waiting"], c=INFEASIBLE, lw=1.2, label="waiting")
    queue_ax.set(title="requests running and waiting", ylim=(0, None))
    hit_ax.plot(s["time"], s["hit_rate"] * 100, c=HIT_RATE, lw=1.2)
    hit_ax.set(title="prefix cache hit rate so far (%)", ylim=(0, 105))
    pre_ax.vlines(s["time"], 0, s["preemptions"], colors=FAILED, lw=2, label="in the interval")
    pre_ax.step(s["time"], s["preemptions_total"], c=SO_FAR, ls=":", lw=1.5, where="post", label="so far")
    pre_ax.set(title="preemptions", xlabel="time (s)", ylim=(0, max(1.0, float(s["preemptions_total"][-1]) * 1.1)))
    for ax in (usage_ax, queue_ax, hit_ax, pre_ax):
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    queue_ax.legend(fontsize=8, loc="upper left")
    pre_ax.legend(fontsize=8, loc="upper left")
    fig.set_layout_engine("constrained")
    return fig


def binned(series: dict, max_points: int = MAX_POINTS) -> dict[str, np.ndarray]:
    """A run's series (or a live scrape's) cut into time bins, the empty ones skipped (a sim run's steps are
    irregular): gauge peaks, preemptions per bin and so far, and the prefix hit rate so far."""
    t = _array(series.get("time"))
    n = len(t)
    if not n:
        return {name: np.empty(0) for name in BINNED}
    bins = max(1, min(n, max_points))
    edges = np.linspace(t[0], t[-1], bins + 1) if t[-1] > t[0] else np.array([t[0], t[0] + 1e-9])
    bins = len(edges) - 1
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    out = {"time": edges[1:]}
    for name in GAUGES:
        out[name] = np.full(bins, np.nan)
        np.fmax.at(out[name], idx, _array(series.get(name), n))  # fmax skips the gaps (None)
    preempted, queries, hits = (np.bincount(idx, np.nan_to_num(_array(series.get(name), n)), bins)
                                for name in ("num_preemptions", "prefix_queries", "prefix_hits"))
    out["preemptions"], out["preemptions_total"] = preempted, np.cumsum(preempted)
    # So far, not per bin: most bins of a sim run hold no new prompt, and a per-bin rate is mostly gaps.
    queries, hits = np.cumsum(queries), np.cumsum(hits)
    with np.errstate(invalid="ignore", divide="ignore"):
        out["hit_rate"] = np.where(queries > 0, hits / queries, np.nan)
    filled = np.bincount(idx, minlength=bins) > 0
    return {name: values[filled] for name, values in out.items()}


# ---------------------------------------------------------------- a workload, a capacity plan

def lengths(prompt_tokens: list[int], output_tokens: list[int]) -> Figure | None:
    """How long the workload's prompts and outputs were, per request."""
    if not prompt_tokens:
        return None
    fig = new_figure(12, 3)
    prompt_ax, output_ax = fig.subplots(1, 2)
    prompt_ax.hist(prompt_tokens, bins=40, color=FEASIBLE)
    prompt_ax.set(title="prompt tokens per request", ylabel="requests")
    output_ax.hist(output_tokens, bins=40, color=BEST)
    output_ax.set(title="output tokens per request")
    for ax in (prompt_ax, output_ax):
        ax.title.set_fontsize(9)
        ax.grid(axis="y", alpha=0.3)
    fig.set_layout_engine("constrained")
    return fig


def capacity(plan: CapacityPlan) -> Figure | None:
    """Requests that fit at once: paged blocks at each context length, against a contiguous reservation."""
    if not plan.by_dtype:
        return None
    groups = [f"paged\n{n:,} tokens" for n in plan.contexts] + [
        f"contiguous\n{plan.config.max_model_len:,} reserved"]
    fig = new_figure(8, 3.6)
    ax = fig.subplots()
    width = 0.8 / len(plan.by_dtype)
    for i, c in enumerate(plan.by_dtype):
        label = f"auto ({plan.model_dtype})" if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
        counts = [c.max_concurrency[str(n)] for n in plan.contexts] + [c.contiguous_requests]
        bars = ax.bar(np.arange(len(groups)) + (i - (len(plan.by_dtype) - 1) / 2) * width, counts, width,
                      label=label)
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=8)
    ax.set_xticks(np.arange(len(groups)), groups, fontsize=8)
    ax.set(ylabel="requests at once")
    ax.margins(y=0.12)  # room for the counts above the bars
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def _array(values, n: int | None = None) -> np.ndarray:
    if values is None:
        return np.full(n or 0, np.nan)
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)
