"""What the UI reads: the run store and the Optuna studies beside it. Nothing here writes.

Streamlit reruns a page's script on every click, so each read is cached: short
lives for what a running search or run still changes, longer ones for a run's
series, which never change once stored.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import optuna
import sqlalchemy
import streamlit as st
from sqlalchemy.engine import make_url

from ..diagnose import Diagnosis
from ..search.report_data import ReportData, load_report_data
from ..report.diagnoses import stored_or_worked_out
from ..report.importance import Importance, param_importance
from ..report.words import value_label
from ..results import RunResult
from ..search.slo import SLO
from ..search.study import OPTUNA_STUDIES_TABLE, study_slos
from ..store import (
    DB_ENV,
    DiagnosisRow,
    RunNotFoundError,
    RunSummaryRow,
    Store,
    StoreError,
    mask_url,
    resolve_db_url,
)

RUNS_TABLE = "kvtune_runs"
FRESH_S = 5  # what a running search or run may still change
RUN_LIMIT = 2000


@dataclass
class Database:
    url: str | None
    display_url: str
    error: str | None = None  # why it cannot be read
    has_runs: bool = False
    studies: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.error is None and not self.has_runs and not self.studies


@dataclass
class StudyRow:
    name: str
    objective: str
    trials: int
    preset: str | None
    device: str | None
    workload: str | None
    slos: list[str]
    started: object


@dataclass
class StudyView:
    report: ReportData
    importance: Importance
    base_config: dict  # the config the study's runs used, before each trial's knobs


def database_url() -> str:
    """--db of `kvtune ui` arrives as $KVTUNE_DB (kept out of argv: a password would show in ps)."""
    return resolve_db_url(None)


def database() -> Database:
    """The database `kvtune ui` was given, and what it holds."""
    try:
        url = database_url()
    except StoreError as err:
        return Database(None, mask_url(os.environ.get(DB_ENV, "?")), error=str(err))
    return inspect_database(url)


@st.cache_data(ttl=FRESH_S, show_spinner=False)
def inspect_database(url: str) -> Database:
    """Found without creating anything in it: a missing SQLite file stays missing."""
    shown = mask_url(url)
    parsed = make_url(url)
    path = parsed.database
    if parsed.get_backend_name() == "sqlite" and path and path != ":memory:" and not path.startswith("file:") \
            and not os.path.exists(path):
        return Database(url, shown)
    try:
        tables = _tables(url)
        has_runs = RUNS_TABLE in tables and bool(runs_list(url, 1))
        names = study_names(url) if OPTUNA_STUDIES_TABLE in tables else []
    except (StoreError, sqlalchemy.exc.SQLAlchemyError) as err:
        return Database(url, shown, error=f"cannot read {shown}: {_first_line(err)}")
    return Database(url, shown, has_runs=has_runs, studies=names)


def _tables(url: str) -> set[str]:
    engine = sqlalchemy.create_engine(url)
    try:
        return set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _first_line(err: Exception) -> str:
    return str(getattr(err, "orig", None) or err).strip().splitlines()[0]


# ---------------------------------------------------------------- runs

@st.cache_resource(show_spinner=False)
def store(url: str) -> Store:
    """One per URL for the server's life: SQLAlchemy's pool serves every session's thread."""
    return Store(url)


@st.cache_data(ttl=FRESH_S, show_spinner=False)
def runs_list(url: str, limit: int = RUN_LIMIT) -> list[RunSummaryRow]:
    return store(url).list_runs(limit=limit)


@st.cache_resource(ttl=600, max_entries=16, show_spinner="Reading the run…")
def run_result(url: str, run_id: int, status: str) -> RunResult | None:
    """The whole run; `status` is part of the key so a run that finishes is read again."""
    try:
        return store(url).load_run(run_id)
    except RunNotFoundError:
        return None


@st.cache_data(ttl=FRESH_S, show_spinner=False)
def sample_series(url: str, run_id: int) -> dict[str, list]:
    """A run in progress: its live samples (long form) as series in the RunResult convention."""
    samples = store(url).load_samples(run_id)
    if not samples:
        return {}
    times = sorted({s.t for s in samples})
    index = {t: i for i, t in enumerate(times)}
    series: dict[str, list] = {"time": [t - times[0] for t in times]}
    for s in samples:
        series.setdefault(s.name, [None] * len(times))[index[s.t]] = s.value
    return series


@st.cache_data(ttl=FRESH_S, show_spinner=False)
def stored_diagnoses(url: str, run_id: int) -> list[DiagnosisRow]:
    return store(url).load_diagnoses(run_id)


def run_diagnoses(url: str, row: RunSummaryRow) -> tuple[list[Diagnosis], bool]:
    """The run's stored diagnoses, else worked out now with its study's SLOs (and not stored); and
    whether they were stored."""
    stored = stored_diagnoses(url, row.id)
    if stored:
        return stored_or_worked_out(stored, None, []), True
    result = run_result(url, row.id, row.status)
    if result is None or row.status == "running":
        return [], False
    slos = run_study_slos(url, row.study) if row.study else []
    return stored_or_worked_out([], result, slos, error=row.error if row.status == "failed" else None), False


@st.cache_data(ttl=FRESH_S, show_spinner=False)
def run_study_slos(url: str, study: str) -> list[SLO]:
    return study_slos(url, study)


# ---------------------------------------------------------------- studies

@st.cache_resource(show_spinner=False)
def _storage(url: str) -> optuna.storages.RDBStorage:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, skip_table_creation=True)


@st.cache_data(ttl=FRESH_S, show_spinner=False)
def study_names(url: str) -> list[str]:
    return sorted(optuna.get_all_study_names(_storage(url)))


@st.cache_data(ttl=FRESH_S, show_spinner=False)
def studies(url: str) -> list[StudyRow]:
    rows = []
    for s in optuna.get_all_study_summaries(_storage(url), include_best_trial=False):
        attrs = s.user_attrs
        rows.append(StudyRow(s.study_name, attrs.get("objective", "?"), s.n_trials, attrs.get("preset"),
                             attrs.get("device"), attrs.get("workload"), list(attrs.get("slos") or []),
                             s.datetime_start))
    return sorted(rows, key=lambda r: r.name)


@st.cache_resource(ttl=30, max_entries=8, show_spinner="Reading the study…")
def study_view(url: str, name: str, n_trials: int) -> StudyView:
    """The report's reading of the study (stage 1, stage 2, verdict, importance); `n_trials` keys the cache.

    Raises ReportError for a study with no trials."""
    report = load_report_data(url, name)
    importance = param_importance(report.study, value_label(report.info))
    run = report.best_run or report.default_run
    return StudyView(report, importance, dict(run.result.config) if run else {})

