"""The fault card's diagnoses of a run: those stored with it, else worked out now (and not stored:
a report or the dashboard only reads)."""
from __future__ import annotations

from ..diagnose import Diagnosis, diagnose
from ..diagnose.facts import gather
from ..diagnose.render import pool_overview
from ..results import RunResult
from ..search.slo import SLO, diagnosis_thresholds
from ..store import DiagnosisRow, Store
from ..search.report_data import RunView


def stored_or_worked_out(stored: list[DiagnosisRow], result: RunResult, slos: list[SLO],
                         error: str | None = None) -> list[Diagnosis]:
    """The diagnoses stored with a run (worked out when it ran, with its study's SLOs, fixes tried),
    else the fault rules on its result now, judged by `slos` (its study's), fixes untested."""
    if stored:
        return [Diagnosis.from_stored(d) for d in stored]
    return diagnose(result, diagnosis_thresholds(slos), error=error)


def run_diagnoses(db_url: str, run: RunView, slos: list[SLO]) -> list[Diagnosis]:
    with Store(db_url) as store:
        stored = store.load_diagnoses(run.run_id)
    return stored_or_worked_out(stored, run.result, slos)


def pool_lines(run: RunView, slos: list[SLO]) -> list[str]:
    """Used and free blocks, hit rate, preemptions and the contiguous comparison, as the fault card asks."""
    return pool_overview(gather(run.result, diagnosis_thresholds(slos)))
