"""Runs page: pick a stored run; its KV cache over time, client and server latencies, workload and diagnoses."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from kvtune.report import fmt
from kvtune.results import RunResult
from kvtune.store import RunSummaryRow
from kvtune.ui import charts, data, widgets

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end"), ("queue", "queue"))
QUANTILES = (50, 95, 99)


def runs_frame(rows: list[RunSummaryRow]) -> pd.DataFrame:
    return pd.DataFrame([{
        "run": r.id, "created": r.created_at.strftime("%Y-%m-%d %H:%M:%S"), "label": r.label or "",
        "target": r.target, "model": r.model, "device": r.device, "status": r.status,
        "study": r.study or "", "trial": r.trial_number, "requests": r.requests, "completed": r.completed,
        "throughput (req/s)": r.throughput_rps, "TTFT p95 (ms)": _ms(r.ttft_p95), "TPOT p95 (ms)": _ms(r.tpot_p95),
        "KV usage peak (%)": _pct(r.kv_usage_peak), "prefix hit rate (%)": _pct(r.prefix_hit_rate),
        "preemptions": r.preemptions} for r in rows])


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
    for key, name in (("input_len", "prompt tokens"), ("output_len", "output tokens")):
        q = profile.get(key) or {}
        if q:
            rows.append({"per request": name, **{k: q.get(k) for k in ("p50", "p95", "p99", "max", "mean")}})
    return pd.DataFrame(rows)


def _ms(seconds):
    return None if seconds is None else seconds * 1000


def _round(value, digits):
    return None if value is None else round(value, digits)


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
        st.dataframe(runs_frame(shown), hide_index=True, key="runs_table",
                     column_config={"throughput (req/s)": st.column_config.NumberColumn(format="%.2f"),
                                    "TTFT p95 (ms)": st.column_config.NumberColumn(format="%.1f"),
                                    "TPOT p95 (ms)": st.column_config.NumberColumn(format="%.1f"),
                                    "KV usage peak (%)": st.column_config.NumberColumn(format="%.1f"),
                                    "prefix hit rate (%)": st.column_config.NumberColumn(format="%.1f")})
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
    cols[1].metric("Throughput (req/s)", fmt.number(_round(s.get("throughput_rps"), 2)))
    cols[2].metric("Output (tok/s)", fmt.count(s.get("output_tok_s")))
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
    st.dataframe(latency_frame(s), hide_index=True, key="run_latency")
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
    cols[2].metric("Span", f"{profile['duration_s']:.1f} s" if profile.get("duration_s") is not None else fmt.MISSING)
    cols[3].metric("Ideal prefix hit rate", fmt.pct(profile.get("ideal_prefix_hit_rate")))
    frame = profile_frame(profile)
    if not frame.empty:
        st.dataframe(frame, hide_index=True, key="run_profile")
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
        st.json(result.config)


if __name__ == "__main__":
    render()
