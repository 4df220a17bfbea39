"""The UI's plotly figures. Each takes plain data and returns a figure, or None when there is nothing to draw.

Colours and meanings follow the report's matplotlib figures (kvtune.report.plots),
so a chart on screen and in report.html read the same.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..plan import CapacityPlan
from ..report.plots import BEST, FAILED, FEASIBLE, INFEASIBLE
from ..search.ranking import Measurement

MAX_POINTS = 400  # time bins: a sim run has a point per engine step
HEIGHT = 380
BELOW = {"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0}  # a legend that never hides points


def binned(series: dict, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """A run's series (or a live scrape's) cut into time bins: gauge peaks, counter sums, the hit rate so far."""
    t = _array(series.get("time"))
    if not len(t):
        return pd.DataFrame()
    n = len(t)
    bins = max(1, min(n, max_points))
    edges = np.linspace(t[0], t[-1], bins + 1) if t[-1] > t[0] else np.array([t[0], t[0] + 1e-9])
    bins = len(edges) - 1
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    frame = pd.DataFrame({"bin": idx})
    for name in ("kv_usage", "num_running", "num_waiting"):
        frame[name] = _array(series.get(name), n)
    for name in ("num_preemptions", "prefix_queries", "prefix_hits"):
        frame[name] = np.nan_to_num(_array(series.get(name), n))
    grouped = frame.groupby("bin")
    out = grouped[["kv_usage", "num_running", "num_waiting"]].max()
    sums = grouped[["num_preemptions", "prefix_queries", "prefix_hits"]].sum()
    out["time"] = edges[1:][out.index]
    out["preemptions"] = sums["num_preemptions"]
    out["preemptions_total"] = sums["num_preemptions"].cumsum()
    # So far, not per bin: most bins of a sim run hold no new prompt, and a per-bin rate is mostly gaps.
    queries, hits = sums["prefix_queries"].cumsum(), sums["prefix_hits"].cumsum()
    with np.errstate(invalid="ignore", divide="ignore"):
        out["hit_rate"] = np.where(queries > 0, hits / queries, np.nan)
    return out.reset_index(drop=True)


def _array(values, n: int | None = None) -> np.ndarray:
    if values is None:
        return np.full(n or 0, np.nan)
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def timeline(series: dict) -> go.Figure | None:
    """KV usage, running and waiting requests, prefix hit rate and preemptions over one run."""
    frame = binned(series)
    if frame.empty:
        return None
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("KV blocks in use (%)", "requests running and waiting",
                                        "prefix cache hit rate so far (%)", "preemptions"))
    fig.add_trace(go.Scatter(x=frame["time"], y=frame["kv_usage"] * 100, name="KV usage", line={"color": FEASIBLE}),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=frame["time"], y=frame["num_running"], name="running", line={"color": BEST}),
                  row=2, col=1)
    fig.add_trace(go.Scatter(x=frame["time"], y=frame["num_waiting"], name="waiting", line={"color": INFEASIBLE}),
                  row=2, col=1)
    fig.add_trace(go.Scatter(x=frame["time"], y=frame["hit_rate"] * 100, name="hit rate so far",
                             line={"color": "#9467bd"}), row=3, col=1)
    fig.add_trace(go.Bar(x=frame["time"], y=frame["preemptions"], name="preemptions", marker_color=FAILED),
                  row=4, col=1)
    fig.add_trace(go.Scatter(x=frame["time"], y=frame["preemptions_total"], name="preemptions so far",
                             line={"color": "#ff7f0e", "dash": "dot"}), row=4, col=1)
    fig.update_yaxes(range=[0, 105], row=1, col=1)
    fig.update_yaxes(range=[0, 105], row=3, col=1)
    fig.update_yaxes(rangemode="tozero", row=2, col=1)
    fig.update_yaxes(rangemode="tozero", row=4, col=1)
    fig.update_xaxes(title_text="time (s)", row=4, col=1)
    fig.update_layout(height=760, margin={"t": 40, "b": 40}, legend=BELOW)
    return fig


def lengths(prompt_tokens: list[int], output_tokens: list[int]) -> go.Figure | None:
    """How long the workload's prompts and outputs were, per request."""
    if not prompt_tokens:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("prompt tokens per request", "output tokens per request"))
    fig.add_trace(go.Histogram(x=prompt_tokens, name="prompt", marker_color=FEASIBLE, nbinsx=40), row=1, col=1)
    fig.add_trace(go.Histogram(x=output_tokens, name="output", marker_color=BEST, nbinsx=40), row=1, col=2)
    fig.update_yaxes(title_text="requests", row=1, col=1)
    fig.update_layout(height=300, showlegend=False, margin={"t": 40, "b": 30})
    return fig


def history(trials: list[Measurement], value_label: str) -> go.Figure | None:
    """Each stage-1 trial's objective value, feasible or not, and the best feasible value so far."""
    done = [t for t in trials if t.ok and _finite(t.value)]
    if not done:
        return None
    fig = go.Figure()
    for feasible, colour, symbol, label in ((True, FEASIBLE, "circle", "meets the SLOs"),
                                            (False, INFEASIBLE, "x", "misses an SLO")):
        pts = [t for t in done if t.feasible == feasible]
        if pts:
            fig.add_trace(go.Scatter(x=[t.number for t in pts], y=[t.value for t in pts], mode="markers",
                                     name=label, marker={"color": colour, "symbol": symbol, "size": 8},
                                     text=[_params(t.params) for t in pts]))
    failed = [t for t in trials if t.state == "FAIL" and not t.surplus]
    if failed:
        low = min(t.value for t in done)
        fig.add_trace(go.Scatter(x=[t.number for t in failed], y=[low] * len(failed), mode="markers",
                                 name="failed (not to scale)", text=[t.reason or "" for t in failed],
                                 marker={"color": FAILED, "symbol": "triangle-down", "size": 8}))
    best, xs, ys = -math.inf, [], []
    for t in sorted(trials, key=lambda t: t.number):
        if t.feasible and _finite(t.value):
            best = max(best, t.value)
        if best > -math.inf:
            xs.append(t.number)
            ys.append(best)
    if xs:
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"shape": "hv", "color": BEST},
                                 name="best so far (meets the SLOs)"))
    fig.update_layout(height=HEIGHT, xaxis_title="trial", yaxis_title=value_label, margin={"t": 20}, legend=BELOW)
    return fig


def pareto(points: list[tuple[Measurement, float, float]], front: list[int], latency_label: str,
           slo_limit_s: float | None) -> go.Figure | None:
    """Throughput against a latency percentile; the front (no config beats it on both) joined by a line."""
    if not points:
        return None
    fig = go.Figure()
    for feasible, colour, symbol, label in ((True, FEASIBLE, "circle", "meets the SLOs"),
                                            (False, INFEASIBLE, "x", "misses an SLO")):
        sel = [(t, x, y) for t, x, y in points if t.feasible == feasible]
        if sel:
            fig.add_trace(go.Scatter(x=[x for _, x, _ in sel], y=[y * 1000 for _, _, y in sel], mode="markers",
                                     name=label, marker={"color": colour, "symbol": symbol, "size": 8},
                                     text=[f"trial {t.number}: {_params(t.params)}" for t, _, _ in sel]))
    on_front = sorted((x, y * 1000) for t, x, y in points if t.number in front)
    if on_front:
        fig.add_trace(go.Scatter(x=[x for x, _ in on_front], y=[y for _, y in on_front], mode="lines+markers",
                                 name="Pareto front", line={"color": BEST}))
    if slo_limit_s is not None:
        fig.add_hline(y=slo_limit_s * 1000, line_dash="dash", line_color=INFEASIBLE,
                      annotation_text=f"{latency_label} SLO")
    latencies = [y for _, _, y in points if y > 0]
    if latencies and max(latencies) > 20 * min(latencies):  # minutes of queueing next to milliseconds
        fig.update_yaxes(type="log")
    fig.update_layout(height=HEIGHT, xaxis_title="throughput (req/s)", yaxis_title=f"{latency_label} (ms)",
                      margin={"t": 20}, legend=BELOW)
    return fig


def importance(values: dict[str, float]) -> go.Figure:
    names = list(values)[::-1]  # largest on top
    fig = go.Figure(go.Bar(x=[values[n] * 100 for n in names], y=names, orientation="h", marker_color=FEASIBLE,
                           text=[f"{values[n] * 100:.0f} %" for n in names], textposition="outside"))
    fig.update_layout(height=80 + 40 * len(names), xaxis_title="importance (%)", xaxis_range=[0, 110],
                      margin={"t": 20})
    return fig


def capacity(plan: CapacityPlan) -> go.Figure:
    """Requests that fit at once: paged blocks at each context length, against a contiguous reservation."""
    fig = go.Figure()
    for c in plan.by_dtype:
        label = f"auto ({plan.model_dtype})" if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
        x = [f"paged, {n:,} tok" for n in plan.contexts] + [f"contiguous, {plan.config.max_model_len:,} reserved"]
        y = [c.max_concurrency[str(n)] for n in plan.contexts] + [c.contiguous_requests]
        fig.add_trace(go.Bar(x=x, y=y, name=label, text=[f"{v:,.0f}" for v in y], textposition="outside"))
    fig.update_layout(barmode="group", height=HEIGHT, yaxis_title="requests at once", margin={"t": 20})
    return fig


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)
