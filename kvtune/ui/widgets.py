"""Pieces more than one page shows: the first screen of an empty database, run labels, diagnosis cards."""
from __future__ import annotations

import importlib.resources
import os
import shlex

import pandas as pd
import streamlit as st

from ..diagnose import SEVERITIES, Diagnosis
from ..diagnose.render import show
from ..store import RunSummaryRow
from .data import Database

SEVERITY_BADGES = {"critical": ("red", "Critical"), "warning": ("orange", "Warning"), "info": ("blue", "Info")}


def demo_trace() -> str:
    """The sample trace shipped with kvtune, as short a path as the working directory allows."""
    path = str(importlib.resources.files("kvtune") / "data" / "demo_traces.jsonl")
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def fill_commands(db: Database) -> str:
    trace, url = shlex.quote(demo_trace()), shlex.quote(db.display_url)
    return (f"# one run of the sample trace on the simulator (a few seconds)\n"
            f"kvtune run --workload {trace} --db {url}\n\n"
            f"# a search over the KV-cache knobs, stage 1 only (about a minute)\n"
            f"kvtune search --workload {trace} --slo ttft_p95=500ms --target none --trials 50 --db {url}\n\n"
            f"# diagnose a stored run (its id is printed by kvtune run)\n"
            f"kvtune diagnose --run 1 --db {url}")


def require_data(db: Database, what: str = "runs or studies") -> bool:
    """Show why there is nothing to show, and return False; True when the database has something."""
    if db.error is not None:
        st.error(f"Cannot read the database: {db.error}")
        st.caption("Start the UI with `kvtune ui --db URL` (or set $KVTUNE_DB) to read another database.")
        return False
    if db.empty:
        empty_screen(db, what)
        return False
    return True


def empty_screen(db: Database, what: str = "runs or studies") -> None:
    st.info(f"Nothing stored yet in `{db.display_url}`: no {what}. Fill it with the commands below, "
            "then reload this page.", icon=":material/inbox:")
    st.code(fill_commands(db), language="bash")
    st.caption("The UI only reads the database: runs and searches are started from the command line. "
               "The Planner and Live pages work without any stored data.")


def run_label(row: RunSummaryRow) -> str:
    name = row.label or (f"{row.study} trial {row.trial_number}" if row.study else row.target)
    when = row.created_at.strftime("%Y-%m-%d %H:%M")
    status = "" if row.status == "ok" else f" [{row.status}]"
    return f"#{row.id} {name} ({row.target}, {row.model} on {row.device}, {when}){status}"


def diagnosis_cards(diagnoses: list[Diagnosis], key: str, headings: bool = False) -> None:
    """One bordered card per diagnosis, critical first: symptom, evidence table, cause and fix."""
    if not diagnoses:
        st.success("No faults found: none of the rules F1–F8 fired.")
        return
    counts = ", ".join(f"{sum(d.severity == s for d in diagnoses)} {s}" for s in SEVERITIES)
    st.caption(f"{len(diagnoses)} finding{'s' * (len(diagnoses) != 1)}: {counts}")
    for severity in SEVERITIES:
        found = [d for d in diagnoses if d.severity == severity]
        if found and headings:
            st.subheader(f"{SEVERITY_BADGES[severity][1]} ({len(found)})")
        for i, d in enumerate(found):
            colour, label = SEVERITY_BADGES.get(severity, ("gray", severity))
            with st.container(border=True, key=f"{key}-{severity}-{i}"):
                st.markdown(f":{colour}-badge[{label}] **{d.id}**: {d.symptom}")
                if d.evidence:
                    st.dataframe(evidence_frame(d), hide_index=True)
                st.markdown(f"**Cause:** {d.cause}")
                st.markdown(f"**Fix:** {d.fix}")
                if d.tried:
                    st.dataframe(pd.DataFrame([{"change tried in the simulator": t.change, "verdict": t.verdict,
                                                "what it did": t.note} for t in d.tried]), hide_index=True)


def evidence_frame(d: Diagnosis) -> pd.DataFrame:
    return pd.DataFrame([{"metric": e.metric, "window": e.window, "value": show(e.value), "threshold": e.threshold}
                         for e in d.evidence], columns=["metric", "window", "value", "threshold"])
