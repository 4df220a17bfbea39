"""The fault card's diagnoses of a run: those stored with it, else worked out now (and not stored:
a report only reads)."""
from __future__ import annotations

from ..diagnose import Diagnosis, diagnose
from ..diagnose.facts import gather
from ..diagnose.report import pool_overview
from ..search.slo import SLO, diagnosis_thresholds
from ..store import Store
from .data import RunView


def run_diagnoses(db_url: str, run: RunView, slos: list[SLO]) -> list[Diagnosis]:
    with Store(db_url) as store:
        stored = store.load_diagnoses(run.run_id)
    if stored:
        return [Diagnosis.from_stored(d) for d in stored]
    return diagnose(run.result, diagnosis_thresholds(slos))


def pool_lines(run: RunView, slos: list[SLO]) -> list[str]:
    """Used and free blocks, hit rate, preemptions and the contiguous comparison, as the fault card asks."""
    return pool_overview(gather(run.result, diagnosis_thresholds(slos)))
