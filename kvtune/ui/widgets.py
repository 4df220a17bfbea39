"""Pieces more than one page shows: the first screen of an empty database, run labels, diagnosis cards."""
from __future__ import annotations

import importlib.resources
import os
import shlex

import pandas as pd
import streamlit as st

from ..diagnose import SEVERITIES, Diagnosis
from ..diagnose.render import show
from ..report.context import SERVER_NAMES
from ..store import RunSummaryRow
from . import tables
from .data import Database

SEVERITY_BADGES = {"critical": ("red", "Critical"), "warning": ("orange", "Warning"), "info": ("blue", "Info")}
UNKNOWN = "unknown"  # a run's device when nobody said (`kvtune run --target URL` without --device)


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


def known(value: str | None) -> str | None:
    """None (shown as the report's dash) for what the run record says nobody knew."""
    return None if value in (None, "", UNKNOWN) else value


def run_name(row: RunSummaryRow) -> str:
    return row.label or (f"{row.study} trial {row.trial_number}" if row.study else target_name(row.target))


def target_name(target: str) -> str:
    """The report's name of what ran a run: 'running server' for a URL's, 'vLLM'; the target's own otherwise."""
    return SERVER_NAMES.get(target, target)


def _url_as_model(row: RunSummaryRow) -> str | None:
    """The URL a URL's run holds as its model until the served model's name replaces it (while it runs,
    and when it failed); None once named."""
    return row.model if row.target == "url" and row.model.startswith(("http://", "https://")) else None


def server_of(row: RunSummaryRow) -> str:
    """What ran the run: 'running server at http://…' for a URL's (the URL kept in its config, else the
    one it holds as its model), the target's name otherwise."""
    url = (row.server_url or _url_as_model(row)) if row.target == "url" else None
    return f"{target_name(row.target)} at {url}" if url else target_name(row.target)


def model_on(row: RunSummaryRow) -> str:
    """'llama-3-8b on h100-80gb' ('llama-3-8b' where nobody gave the device); '' for a URL's run that
    never named its model (running, or failed)."""
    if _url_as_model(row):
        return ""
    device = known(row.device)
    return f"{row.model} on {device}" if device else row.model


def run_where(row: RunSummaryRow, with_target: bool = True) -> str:
    """What ran the run, in the record's words: 'sim, llama-3-8b on h100-80gb', 'running server at
    http://…, llama-3-8b'; without the target, the model on its device ('at http://…' where a URL's run
    named no model)."""
    if not with_target:
        return model_on(row) or f"at {row.model}"
    return ", ".join(p for p in [server_of(row), model_on(row)] if p)


def run_label(row: RunSummaryRow) -> str:
    when = row.created_at.strftime("%Y-%m-%d %H:%M")
    status = "" if row.status == "ok" else f" [{row.status}]"
    named = bool(row.label or row.study)  # else the server is its name
    head, where = (run_name(row), run_where(row)) if named else (server_of(row), model_on(row))
    return f"#{row.id} {head} ({', '.join(p for p in (where, when) if p)}){status}"


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
                    tables.table(evidence_frame(d))
                st.markdown(f"**Cause:** {d.cause}")
                st.markdown(f"**Fix:** {d.fix}")
                if d.tried:
                    tables.table(pd.DataFrame([{"change tried in the simulator": t.change, "verdict": t.verdict,
                                                "what it did": t.note} for t in d.tried]))


def evidence_frame(d: Diagnosis) -> pd.DataFrame:
    return pd.DataFrame([{"metric": e.metric, "window": e.window, "value": show(e.value), "threshold": e.threshold}
                         for e in d.evidence], columns=["metric", "window", "value", "threshold"])
