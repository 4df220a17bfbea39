"""Diagnoses page: the fault rules' findings for a run, as cards by severity with evidence and fix."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from kvtune.diagnose import SEVERITIES
from kvtune.store import RunSummaryRow
from kvtune.ui import data, tables, widgets

OVERVIEW_RUNS = 50  # the newest runs counted in the overview table


def overview_frame(url: str, rows: list[RunSummaryRow]) -> pd.DataFrame:
    """Stored findings per run, by severity: which runs to look at first."""
    out = []
    for row in rows[:OVERVIEW_RUNS]:
        stored = data.stored_diagnoses(url, row.id)
        out.append({"run": row.id, "label": widgets.run_name(row), "target": row.target,
                    **{s: sum(d.severity == s for d in stored) for s in SEVERITIES},
                    "stored faults": " ".join(d.fault_id for d in stored) or None})
    return pd.DataFrame(out)


def worst_first(url: str, rows: list[RunSummaryRow]) -> list[RunSummaryRow]:
    """Runs with stored critical findings first, then warnings, then the rest; newest first within each."""
    def rank(row):
        stored = data.stored_diagnoses(url, row.id)
        for i, severity in enumerate(SEVERITIES):
            if any(d.severity == severity for d in stored):
                return i
        return len(SEVERITIES)
    return sorted(rows[:OVERVIEW_RUNS], key=lambda r: (rank(r), -r.id)) + rows[OVERVIEW_RUNS:]


def render() -> None:
    st.title("Diagnoses")
    db = data.database()
    if not widgets.require_data(db, "runs"):
        return
    rows = data.runs_list(db.url) if db.has_runs else []
    rows = [r for r in rows if r.study is None] or rows
    if not rows:
        st.info("No runs stored yet, so nothing to diagnose. Store one:")
        st.code(widgets.fill_commands(db), language="bash")
        return
    with st.expander(f"Stored findings of the newest {min(len(rows), OVERVIEW_RUNS)} runs"):
        tables.table(overview_frame(db.url, rows), key="diagnoses_overview")
    ordered = worst_first(db.url, rows)
    by_id = {r.id: r for r in ordered}
    run_id = st.selectbox("Run", list(by_id), format_func=lambda i: widgets.run_label(by_id[i]),
                          key="diagnoses_run")
    if run_id is None:
        return
    row = by_id[run_id]
    diagnoses, stored = data.run_diagnoses(db.url, row)
    if row.status == "running":
        st.info("This run is still in progress: it is diagnosed once it is stored whole.")
        return
    if not stored and diagnoses:
        st.caption(f"Worked out now by the fault rules, not stored (`kvtune diagnose --run {row.id}` stores them).")
    # No findings: the store keeps findings only, so a run diagnosed with none (`kvtune run` and `kvtune
    # diagnose --run` diagnose what they store) reads like one never diagnosed; worked out now, none fire.
    widgets.diagnosis_cards(diagnoses, key=f"diag{row.id}", headings=True)


if __name__ == "__main__":
    render()
