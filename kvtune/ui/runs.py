"""Runs page: pick a stored run; its KV cache over time, client and server latencies, workload and diagnoses."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from kvtune.report import fmt
from kvtune.results import RunResult
from kvtune.store import RunSummaryRow
from kvtune.ui import charts, data, tables, widgets

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end"), ("queue", "queue"))
QUANTILES = (50, 95, 99)


def runs_frame(rows: list[RunSummaryRow]) -> pd.DataFrame:
    """One row a run, its leading figures: as many columns as the page's width holds (the Runs page shows
    the rest of the run picked); the model and the device in one column, a device nobody gave left out."""
    return pd.DataFrame([{
        "run": r.id, "created": r.created_at.strftime("%Y-%m-%d %H:%M"), "name": widgets.run_name(r),
        "target": r.target, "model on device": widgets.run_where(r, with_target=False), "status": r.status,
        "requests": r.requests, "completed": r.completed,
        "throughput (req/s)": r.throughput_rps, "TTFT p95 (ms)": _ms(r.ttft_p95),
        "KV usage peak (%)": _pct(r.kv_usage_peak), "preemptions": r.preemptions} for r in rows])


def latency_frame(summary: dict) -> pd.DataFrame:
    """Client percentiles next to the server's histogram percentiles (live runs only), as text:
    a server quantile that only a bucket bounds reads '< 300 ms', never an interpolated value."""
    rows = []
    for key, name in LATENCIES:
        row = {"latency": name}
        for q in QUANTILES:
            row[f"clients p{q}"] = fmt.quantile(summary, f"{key}_p{q}")
        for q in QUANTILES:
            row[f"server p{q}"] = fmt.quantile(summary, f"server_{key}_p{q}")
        rows.append(row)
    return pd.DataFrame(rows)


def profile_frame(profile: dict) -> pd.DataFrame:
    rows = []
    for key, name in (("input_len", "prompt"), ("output_len", "output")):
        q = profile.get(key) or {}
        if q:
            rows.append({"per request": name, **{f"{k} (tokens)": _float(q.get(k))
                                                 for k in ("p50", "p95", "p99", "max", "mean")}})
    return pd.DataFrame(rows)


def config_frame(config: dict) -> pd.DataFrame:
    """The run's config as the report names values: 0.86, not 0.8600000000000001."""
    return pd.DataFrame([{"setting": k, "value": _setting(k, v)} for k, v in config.items()],
                        columns=["setting", "value"])


def _setting(name: str, value) -> str:
    if value is None:
        return fmt.MISSING
    if isinstance(value, float):
        return fmt.param(name, value) if name == "gpu_memory_utilization" else f"{value:.4g}"
    return fmt.param(name, value)


def _float(value):
    return None if value is None else float(value)


def _ms(seconds):
    return None if seconds is None else seconds * 1000


def _pct(fraction):
    return None if fraction is None else fraction * 100


def render() -> None:
    st.title("Runs")
    db = data.database()
    if not widgets.require_data(db, "runs"):
        return
    rows = data.runs_list(db.url) if db.has_runs else []
    if not rows:
        st.info("No runs stored yet; the database holds only studies. See the Search page, or store a run:")
        st.code(widgets.fill_commands(db), language="bash")
        return
    own = [r for r in rows if r.study is None]
    show_trials = st.toggle("Include the runs of search trials", value=not own, key="runs_trials",
                            help=f"{len(rows) - len(own)} runs were made by searches")
    shown = rows if show_trials else own
    with st.expander(f"All {len(shown)} runs", expanded=False):
        tables.table(runs_frame(shown), key="runs_table",
                     column_config={"name": st.column_config.TextColumn(width="medium")})
    by_id = {r.id: r for r in shown}
    run_id = st.selectbox("Run", list(by_id), format_func=lambda i: widgets.run_label(by_id[i]), key="run")
    if run_id is None:
        return
    row = by_id[run_id]
    result = data.run_result(db.url, row.id, row.status)
    if result is None:
        st.warning(f"Run {row.id} is gone from the database.")
        return
    show_run(db.url, row, result)


def show_run(url: str, row: RunSummaryRow, result: RunResult) -> None:
    s = result.summary or {}
    if row.status == "failed":
        st.warning(f"This run failed: {row.error or 'no error text'}")
    elif row.status == "running":
        st.info("This run is still in progress; reload for more.")
    cols = st.columns(6)
    cols[0].metric("Requests completed", f"{fmt.count(s.get('completed'))} / {fmt.count(s.get('requests'))}")
    cols[1].metric("Throughput", fmt.rps(s.get("throughput_rps")))
    cols[2].metric("Output", fmt.tok_s(s.get("output_tok_s")))
    cols[3].metric("KV usage peak", fmt.pct(s.get("kv_usage_peak")))
    cols[4].metric("Prefix hit rate", fmt.pct(s.get("prefix_hit_rate")))
    cols[5].metric("Preemptions", fmt.count(s.get("preemptions")))

    st.subheader("The KV cache over time")
    series = result.series
    if row.status == "running" and not series.get("time"):
        series = data.sample_series(url, row.id)  # what was scraped so far
    figure = charts.timeline(series)
    if figure is None:
        st.info("This run stored no series.")
    else:
        charts.show(figure)

    st.subheader("Latency: what the clients saw and what the server said")
    tables.table(latency_frame(s), key="run_latency")
    if "server_ttft_p95" not in s:
        st.caption(f"The {result.target} target has no server histograms to read: the server columns fill "
                   "in for live runs (engine, vLLM, SGLang or a URL), from /metrics.")
    for note in s.get("disagreements") or []:
        st.warning(note)

    st.subheader("The workload")
    profile = result.workload or {}
    cols = st.columns(4)
    cols[0].metric("Requests", fmt.count(profile.get("requests")))
    cols[1].metric("Rate", fmt.rps(profile.get("rate_rps")))
    cols[2].metric("Span", fmt.seconds(profile.get("duration_s")))
    cols[3].metric("Ideal prefix hit rate", fmt.pct(profile.get("ideal_prefix_hit_rate")))
    frame = profile_frame(profile)
    if not frame.empty:
        tables.table(frame, key="run_profile")
    figure = charts.lengths([r.prompt_tokens for r in result.requests], [r.output_tokens for r in result.requests])
    if figure is not None:
        charts.show(figure)
    st.caption(f"Source: {profile.get('source', 'unknown')}; sessions: {fmt.count(profile.get('sessions'))}.")

    st.subheader("Diagnoses")
    diagnoses, stored = data.run_diagnoses(url, row)
    if not stored and diagnoses:
        st.caption("Worked out now by the fault rules (not stored; `kvtune diagnose --run "
                   f"{row.id}` stores them).")
    widgets.diagnosis_cards(diagnoses, key=f"run{row.id}")

    with st.expander("Config"):
        tables.table(config_frame(result.config), key="run_config")


if __name__ == "__main__":
    render()
