"""The fault card's diagnoses of a run: those stored with it, else worked out now (and not stored:
a report only reads)."""
from __future__ import annotations

from dataclasses import replace

from ..diagnose import Diagnosis, Evidence, Thresholds, diagnose
from ..diagnose.facts import gather
from ..diagnose.report import pool_overview
from ..search.slo import SLO
from ..store import Store
from .data import RunView


def thresholds_for(slos: list[SLO]) -> Thresholds:
    """The rules' TTFT limit is the study's own TTFT p95 SLO where it has one."""
    th = Thresholds()
    ttft = next((s for s in slos if s.name == "ttft_p95"), None)
    return replace(th, ttft_p95_slo_s=ttft.threshold_s) if ttft else th


def run_diagnoses(db_url: str, run: RunView, slos: list[SLO]) -> list[Diagnosis]:
    with Store(db_url) as store:
        stored = store.load_diagnoses(run.run_id)
    if stored:
        return [Diagnosis(d.fault_id, d.severity, d.symptom, [_evidence(e) for e in d.evidence], d.cause, d.fix)
                for d in stored]
    return diagnose(run.result, thresholds_for(slos))


def pool_lines(run: RunView, slos: list[SLO]) -> list[str]:
    """Used and free blocks, hit rate, preemptions and the contiguous comparison, as the fault card asks."""
    return pool_overview(gather(run.result, thresholds_for(slos)))


def _evidence(e) -> Evidence:
    if isinstance(e, dict):
        return Evidence(e.get("metric", ""), e.get("window", ""), e.get("value"), str(e.get("threshold", "")))
    return Evidence(str(e), "", None, "")
