"""The store: every run, trial, request latency, live sample and diagnosis, in one database.

SQLAlchemy 2 models over any URL: `sqlite:///kvtune.db` in the working directory
by default, PostgreSQL (`postgresql://…`, psycopg 3) for many workers. The UI and
the reports read from here only. Optuna's RDB storage may share the same URL, so
every table of ours is prefixed `kvtune_` (Optuna owns `studies`, `trials`, …).

A run's per-step series are stored one row per series name (a sim run has ~300k
steps: one row per sample would be millions); live scrape samples, which the UI
polls while a run is in progress, are stored in long form (t, name, value).

A run is stored in one of two details (`save_run(..., detail=)`):

- "full": everything, as the run produced it: every request's record (its ITLs
  included) and every series at full resolution. Live runs, and the few stage-1
  runs a report plots and diagnoses, are stored so.
- "summary": the run row (summary, config, workload profile, status) and its
  series downsampled to at most SUMMARY_POINTS points by `downsample_series`;
  no per-request rows. A search's other stage-1 trials are stored so (on the
  demo's workload about 20 kB a run instead of 1.9 MB). `load_run` gives a
  valid RunResult with no requests.

`slim_runs` turns full runs into summary ones in place (a stage-1 trial that left
the best few).

A trial has one record: a stage-1 trial's is its Optuna trial (values, constraints,
its run id and observed figures in the user attrs); a stage-2 candidate's (its
repeats merged: score, SLO verdicts, reason) is its `kvtune_trials` row.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, ClassVar, NamedTuple, Self

import numpy as np
from sqlalchemy import (
    JSON,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    delete,
    event,
    insert,
    inspect,
    select,
    update,
)
from sqlalchemy import text as sql_text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    IntegrityError,
    NoSuchModuleError,
    ProgrammingError,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.types import DateTime

from .results import RequestRecord, RunResult
from .dburl import DB_ENV, DEFAULT_DB_URL  # noqa: F401 - part of the store's face

RUN_STATUSES = ("ok", "failed", "running")  # a run a signal stopped is 'failed', "interrupted by SIGTERM"
TRIAL_STAGES = ("sim", "live")
DETAILS = ("full", "summary")
SUMMARY_POINTS = 200  # points per series of a run stored in summary
# Series that count events per sample (a sim step's tokens, a scrape interval's counter
# increase: kvtune.scrape.log.SERIES_COUNTERS): downsampled by their sum. Any other
# series but time and duration is a gauge (usage, running, waiting): by its peak.
COUNTER_SERIES = frozenset({
    "num_preemptions", "prefix_queries", "prefix_hits", "num_tokens", "generation_tokens", "num_seqs",
    "context_tokens", "prompt_tokens", "requests_finished", "kvengine_evictions"})
_SIGNIFICANT = 6  # digits a summary run's float series keep


class StoreError(RuntimeError):
    """The database cannot be used: a bad URL, a missing driver, a refused connection."""


class RunNotFoundError(StoreError):
    """No run with that id."""


# ---------------------------------------------------------------- URLs

def resolve_db_url(cli_value: str | None = None) -> str:
    """The `--db` flag, else $KVTUNE_DB, else `sqlite:///kvtune.db`; checked, relative sqlite paths made absolute.

    Absolute, so that worker processes started elsewhere (and Optuna) open the same file.
    """
    raw = cli_value or os.environ.get(DB_ENV) or DEFAULT_DB_URL
    url = _parse_url(raw)
    if _is_sqlite_file(url) and not os.path.isabs(url.database):
        url = url.set(database=os.path.abspath(url.database))
    return url.render_as_string(hide_password=False)


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def _parse_url(raw: str) -> URL:
    try:
        url = make_url(raw)
    except (ArgumentError, ValueError):
        hint = f" (did you mean sqlite:///{raw}?)" if "://" not in raw else ""
        raise StoreError(f"not a database URL: {mask_url(raw)!r}{hint}") from None
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        raise StoreError(f"unknown database driver {url.drivername!r} in {mask_url(raw)!r}; "
                         "use sqlite:///FILE or postgresql://USER:PASS@HOST:PORT/DB") from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        hint = ""
        if url.get_backend_name() == "postgresql":
            hint = ' (plain postgresql:// uses psycopg 3: pip install "psycopg[binary]")'
        raise StoreError(f"database driver for {mask_url(raw)!r} is not installed: {err}{hint}") from None
    return url


def _is_sqlite_file(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") \
        and not url.database.startswith("file:")


def missing_database(db_url: str) -> str | None:
    """The path of a SQLite file `db_url` names that does not exist (opening it would create
    an empty database, which a command that only reads must not), else None."""
    url = make_url(db_url)
    return url.database if _is_sqlite_file(url) and not os.path.exists(url.database) else None


# ---------------------------------------------------------------- JSON that survives NaN

# Strict JSON (PostgreSQL's json type) has no NaN or Infinity, and summaries hold NaN
# (a rate over a zero duration); tag non-finite floats so every backend reads back the same.
_FLOAT_TAG = "$float"


def _json_dumps(value) -> str:
    try:
        return json.dumps(value, allow_nan=False, default=_plain)
    except ValueError:
        return json.dumps(_tag_nonfinite(value), allow_nan=False, default=_plain)


def _json_loads(text: str):
    return json.loads(text, object_hook=_untag_nonfinite)


def _plain(obj):
    if hasattr(obj, "tolist"):  # numpy scalars and arrays
        return obj.tolist()
    raise TypeError(f"cannot store {type(obj).__name__} as JSON")


def _tag_nonfinite(value):
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_TAG: repr(value).replace("inf", "Infinity").replace("nan", "NaN")}
    if isinstance(value, dict):
        return {k: _tag_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tag_nonfinite(v) for v in value]
    return value


def _untag_nonfinite(obj: dict):
    if len(obj) == 1 and _FLOAT_TAG in obj:
        return float(obj[_FLOAT_TAG])
    return obj


# ---------------------------------------------------------------- models

class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict] = {dict: JSON, list: JSON, float: Double, datetime: DateTime(timezone=True)}


def _utcnow() -> datetime:
    return datetime.now(UTC)


class DbRun(Base):
    __tablename__ = "kvtune_runs"
    __table_args__ = (
        CheckConstraint("status IN ('ok', 'failed', 'running')", name="kvtune_runs_status"),
        Index("ix_kvtune_runs_study_trial", "study", "trial_number"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=_utcnow)
    target: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(200))
    device: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    config: Mapped[dict] = mapped_column(default=dict)
    workload: Mapped[dict] = mapped_column(default=dict)
    summary: Mapped[dict] = mapped_column(default=dict)
    duration_s: Mapped[float | None]
    wall_s: Mapped[float | None]
    label: Mapped[str | None] = mapped_column(String(200))
    notes: Mapped[str | None] = mapped_column(Text)
    study: Mapped[str | None] = mapped_column(String(200))
    trial_number: Mapped[int | None]


class DbRequest(Base):
    __tablename__ = "kvtune_requests"
    __table_args__ = (Index("ix_kvtune_requests_run", "run_id", "position"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("kvtune_runs.id", ondelete="CASCADE"))
    position: Mapped[int]  # the order of RunResult.requests
    request_id: Mapped[str] = mapped_column(String(200))
    arrival_s: Mapped[float]
    prompt_tokens: Mapped[int]
    output_tokens: Mapped[int]
    cached_tokens: Mapped[int]
    ttft_s: Mapped[float | None]
    tpot_s: Mapped[float | None]
    e2e_s: Mapped[float | None]
    queue_s: Mapped[float | None]
    itl_s: Mapped[list]
    num_preemptions: Mapped[int]
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(Text)


class DbSeries(Base):
    __tablename__ = "kvtune_series"
    __table_args__ = (UniqueConstraint("run_id", "name", name="uq_kvtune_series_run_name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("kvtune_runs.id", ondelete="CASCADE"))
    position: Mapped[int]  # the order of RunResult.series
    name: Mapped[str] = mapped_column(String(200))
    values: Mapped[list]


class DbSample(Base):
    __tablename__ = "kvtune_samples"
    __table_args__ = (Index("ix_kvtune_samples_run_t", "run_id", "t"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("kvtune_runs.id", ondelete="CASCADE"))
    t: Mapped[float]
    name: Mapped[str] = mapped_column(String(200))
    value: Mapped[float | None]  # NULL is NaN (SQLite turns NaN into NULL anyway)


class DbTrial(Base):
    __tablename__ = "kvtune_trials"
    __table_args__ = (
        UniqueConstraint("study", "stage", "number", name="uq_kvtune_trials_study_stage_number"),
        Index("ix_kvtune_trials_study_number", "study", "number"),
        CheckConstraint("stage IN ('sim', 'live')", name="kvtune_trials_stage"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=_utcnow)
    study: Mapped[str] = mapped_column(String(200))
    number: Mapped[int]
    stage: Mapped[str] = mapped_column(String(8))
    run_id: Mapped[int | None] = mapped_column(
        ForeignKey("kvtune_runs.id", ondelete="SET NULL"), index=True)
    params: Mapped[dict]
    values: Mapped[list | None] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16))
    constraints: Mapped[dict | None] = mapped_column(JSON)
    reason: Mapped[str | None] = mapped_column(Text)


class DbDiagnosis(Base):
    __tablename__ = "kvtune_diagnoses"
    __table_args__ = (Index("ix_kvtune_diagnoses_run", "run_id", "position"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("kvtune_runs.id", ondelete="CASCADE"))
    position: Mapped[int]
    fault_id: Mapped[str] = mapped_column(String(32))
    severity: Mapped[str] = mapped_column(String(16))
    symptom: Mapped[str] = mapped_column(Text)
    evidence: Mapped[list]  # [{metric, window, value, threshold}, ...]
    cause: Mapped[str] = mapped_column(Text)
    fix: Mapped[str] = mapped_column(Text)
    trials: Mapped[list | None] = mapped_column(JSON)  # the fixes tried in the simulator (diagnose.FixTrial)


class DbProfile(Base):
    """A named cost profile (`kvtune calibrate`): fitted coefficients and what they hold for."""
    __tablename__ = "kvtune_profiles"
    id: Mapped[int] = mapped_column(primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=_utcnow)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    data: Mapped[dict]


# ---------------------------------------------------------------- returned rows

@dataclasses.dataclass
class RunSummaryRow:
    id: int
    created_at: datetime
    target: str
    model: str
    device: str
    status: str
    error: str | None
    label: str | None
    study: str | None
    trial_number: int | None
    duration_s: float | None
    requests: int | None
    completed: int | None
    throughput_rps: float | None
    output_tok_s: float | None
    ttft_p95: float | None
    tpot_p95: float | None
    e2e_p95: float | None
    prefix_hit_rate: float | None
    kv_usage_peak: float | None
    preemptions: int | None


class Sample(NamedTuple):
    """One scraped value; add_samples takes these or plain (t, name, value) tuples."""
    t: float
    name: str
    value: float


@dataclasses.dataclass
class TrialRow:
    id: int
    study: str
    number: int
    stage: str
    state: str
    params: dict
    values: list | None
    constraints: dict | None
    reason: str | None
    run_id: int | None
    created_at: datetime


@dataclasses.dataclass
class DiagnosisRow:
    fault_id: str
    severity: str
    symptom: str
    evidence: list
    cause: str
    fix: str
    trials: list = dataclasses.field(default_factory=list)


# The summary figures every run row carries as columns: what a list of runs, the ranking's
# means over repeats and the report's tables read without loading a run's records.
SUMMARY_FIGURES = ("requests", "completed", "throughput_rps", "output_tok_s", "ttft_p95", "tpot_p95",
                   "e2e_p95", "prefix_hit_rate", "kv_usage_peak", "preemptions")
_REQUEST_FIELDS = [f.name for f in dataclasses.fields(RequestRecord)]


# ---------------------------------------------------------------- the store

class Store:
    """One database: open it with a URL (see resolve_db_url); the schema is created on first use.

    One Store per process: engines must not cross a fork.
    """

    def __init__(self, url: str):
        self.url = _parse_url(url).render_as_string(hide_password=False)
        self.display_url = mask_url(self.url)
        self._engine = self._create_engine(make_url(self.url))
        # On SQLite a writer takes the write lock at BEGIN, so concurrent writers wait
        # for each other (busy timeout) instead of failing with "database is locked".
        self._write_engine = self._engine.execution_options(kvtune_write=True)
        self._write = sessionmaker(self._write_engine, expire_on_commit=False)
        self._read = sessionmaker(self._engine, expire_on_commit=False)
        self._create_schema()

    def __repr__(self) -> str:
        return f"Store({self.display_url!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._engine.dispose()

    # ------------------------------------------------------------ runs

    def start_run(self, target: str, model: str, device: str, config: dict | None = None,
                  workload: dict | None = None, label: str | None = None, notes: str | None = None,
                  study: str | None = None, trial: int | None = None) -> int:
        """A run in progress (status 'running'), so live samples can attach to it; finish with save_run(run_id=)."""
        with self._write.begin() as session:
            run = DbRun(target=target, model=model, device=device, status="running",
                        config=config or {}, workload=workload or {}, summary={},
                        label=label, notes=notes, study=study, trial_number=trial)
            session.add(run)
            session.flush()
            return run.id

    def save_run(self, result: RunResult, status: str = "ok", error: str | None = None,
                 study: str | None = None, trial: int | None = None, label: str | None = None,
                 notes: str | None = None, run_id: int | None = None, detail: str = "full") -> int:
        """Store a RunResult in one transaction; with run_id, complete that started run (or
        replace a stored run's figures, requests and series).

        detail "full" keeps every request and every series point; "summary" keeps the run row
        and its series downsampled (downsample_series), no requests (see the module's doc)."""
        _check_status(status)
        if detail not in DETAILS:
            raise ValueError(f"run detail must be one of {DETAILS}, not {detail!r}")
        fields = {"target": result.target, "model": result.model, "device": result.device,
                  "status": status, "error": error, "config": result.config, "workload": result.workload,
                  "summary": result.summary, "duration_s": result.duration_s, "wall_s": result.wall_s}
        extras = {"study": study, "trial_number": trial, "label": label, "notes": notes}
        requests, series = result.requests, result.series
        if detail == "summary":
            series = downsample_series(series, finished_at=_finish_times(result.requests))
            requests = []
        with self._write.begin() as session:
            if run_id is None:
                run = DbRun(**fields, **extras)
                session.add(run)
                session.flush()
                run_id = run.id
            else:  # a started run, or a stored one whose requests and series this replaces
                self._require_run(session, run_id)
                extras = {k: v for k, v in extras.items() if v is not None}
                session.execute(update(DbRun).where(DbRun.id == run_id).values(**fields, **extras))
                for table in (DbRequest, DbSeries):
                    session.execute(delete(table).where(table.run_id == run_id))
            if requests:
                session.execute(insert(DbRequest), [
                    {"run_id": run_id, "position": i, **_request_row(r)} for i, r in enumerate(requests)])
            _insert_series(session, run_id, series)
        return run_id

    def full_runs(self, run_ids: Iterable[int]) -> set[int]:
        """Those of these runs that still hold per-request records (stored in full)."""
        ids = sorted(set(run_ids))
        found: set[int] = set()
        with self._read.begin() as session:
            for chunk in _chunks(ids):
                found.update(session.scalars(select(DbRequest.run_id).where(DbRequest.run_id.in_(chunk))
                                             .distinct()))
        return found

    def slim_runs(self, run_ids: Iterable[int]) -> list[int]:
        """Store these runs in summary from now on: drop their request rows, downsample their series.

        Runs already in summary (no request rows) are left alone; returns the ids slimmed.
        Each run is one transaction, so a reader sees it whole before or after."""
        slimmed = []
        for run_id in sorted(self.full_runs(run_ids)):
            with self._write.begin() as session:
                finished = session.execute(select(DbRequest.arrival_s, DbRequest.e2e_s, DbRequest.ttft_s,
                                                  DbRequest.error).where(DbRequest.run_id == run_id)).all()
                if not finished:  # another process slimmed it meanwhile
                    continue
                series = dict(session.execute(select(DbSeries.name, DbSeries.values)
                                              .where(DbSeries.run_id == run_id).order_by(DbSeries.position)).all())
                ends = [a + e for a, e, ttft, err in finished if err is None and ttft is not None and e is not None]
                session.execute(delete(DbRequest).where(DbRequest.run_id == run_id))
                session.execute(delete(DbSeries).where(DbSeries.run_id == run_id))
                _insert_series(session, run_id, downsample_series(series, finished_at=ends))
            slimmed.append(run_id)
        return slimmed

    def mark_run(self, run_id: int, status: str, error: str | None = None) -> None:
        _check_status(status)
        with self._write.begin() as session:
            self._require_run(session, run_id)
            session.execute(update(DbRun).where(DbRun.id == run_id).values(status=status, error=error))

    def load_run(self, run_id: int) -> RunResult:
        with self._read.begin() as session:
            run = self._require_run(session, run_id)
            requests = session.scalars(
                select(DbRequest).where(DbRequest.run_id == run_id).order_by(DbRequest.position)).all()
            series = session.execute(
                select(DbSeries.name, DbSeries.values).where(DbSeries.run_id == run_id)
                .order_by(DbSeries.position)).all()
        return RunResult(
            target=run.target, model=run.model, device=run.device, config=run.config,
            workload=run.workload, requests=[_request_record(r) for r in requests],
            series={name: values for name, values in series},
            duration_s=run.duration_s if run.duration_s is not None else 0.0,
            wall_s=run.wall_s if run.wall_s is not None else 0.0, summary=run.summary)

    def get_run(self, run_id: int) -> RunSummaryRow:
        with self._read.begin() as session:
            row = session.execute(_summary_select().where(DbRun.id == run_id)).one_or_none()
        if row is None:
            raise RunNotFoundError(f"no run {run_id} in {self.display_url}")
        return _summary_row(row)

    def list_runs(self, limit: int = 50, target: str | None = None, status: str | None = None,
                  study: str | None = None) -> list[RunSummaryRow]:
        """Newest first."""
        query = _summary_select().order_by(DbRun.id.desc()).limit(limit)
        if target is not None:
            query = query.where(DbRun.target == target)
        if status is not None:
            query = query.where(DbRun.status == status)
        if study is not None:
            query = query.where(DbRun.study == study)
        with self._read.begin() as session:
            return [_summary_row(row) for row in session.execute(query)]

    def delete_run(self, run_id: int) -> bool:
        """Remove a run and everything attached to it; trials that pointed at it keep their row."""
        with self._write.begin() as session:
            for table in (DbRequest, DbSeries, DbSample, DbDiagnosis):
                session.execute(delete(table).where(table.run_id == run_id))
            session.execute(update(DbTrial).where(DbTrial.run_id == run_id).values(run_id=None))
            return session.execute(delete(DbRun).where(DbRun.id == run_id)).rowcount > 0

    # ------------------------------------------------------------ live samples

    def add_samples(self, run_id: int, rows: Iterable[tuple[float, str, float]]) -> int:
        """Bulk insert (t, name, value) rows; returns how many."""
        values = [{"run_id": run_id, "t": float(t), "name": name, "value": _nan_to_null(value)}
                  for t, name, value in rows]
        if values:
            with self._write.begin() as session:
                session.execute(insert(DbSample), values)
        return len(values)

    def load_samples(self, run_id: int, since_t: float | None = None) -> list[Sample]:
        """Samples in time order; with since_t, only those strictly after it (for polling)."""
        query = select(DbSample.t, DbSample.name, DbSample.value).where(DbSample.run_id == run_id)
        if since_t is not None:
            query = query.where(DbSample.t > since_t)
        with self._read.begin() as session:
            rows = session.execute(query.order_by(DbSample.t, DbSample.id)).all()
        return [Sample(t, name, math.nan if value is None else value) for t, name, value in rows]

    # ------------------------------------------------------------ trials

    def save_trial(self, study: str, number: int, stage: str, state: str, params: dict,
                   values: list[float] | None = None, constraints: dict[str, float] | None = None,
                   reason: str | None = None, run_id: int | None = None) -> int:
        """Insert or update the trial (study, stage, number); returns its row id."""
        if stage not in TRIAL_STAGES:
            raise ValueError(f"trial stage must be one of {TRIAL_STAGES}, not {stage!r}")
        fields = {"state": state, "params": params, "values": None if values is None else list(values),
                      "constraints": constraints, "reason": reason, "run_id": run_id}
        key = (DbTrial.study == study, DbTrial.stage == stage, DbTrial.number == number)
        with self._write.begin() as session:
            trial_id = session.scalar(select(DbTrial.id).where(*key))
            if trial_id is not None:
                session.execute(update(DbTrial).where(DbTrial.id == trial_id).values(**fields))
                return trial_id
            trial = DbTrial(study=study, number=number, stage=stage, **fields)
            session.add(trial)
            session.flush()
            return trial.id

    def list_trials(self, study: str, stage: str | None = None) -> list[TrialRow]:
        query = select(DbTrial).where(DbTrial.study == study).order_by(DbTrial.stage.desc(), DbTrial.number)
        if stage is not None:
            query = query.where(DbTrial.stage == stage)
        with self._read.begin() as session:
            return [TrialRow(t.id, t.study, t.number, t.stage, t.state, t.params, t.values, t.constraints,
                             t.reason, t.run_id, _as_utc(t.created_at))
                    for t in session.scalars(query)]

    # ------------------------------------------------------------ diagnoses

    def save_diagnoses(self, run_id: int, diagnoses: Iterable[dict | Any]) -> None:
        """Replace the run's diagnoses (re-diagnosing a run is idempotent).

        Each is a dict or dataclass with fault_id (or id), severity, symptom, evidence, cause (or root_cause), fix.
        """
        rows = [{"run_id": run_id, "position": i, **_diagnosis_fields(d)} for i, d in enumerate(diagnoses)]
        with self._write.begin() as session:
            self._require_run(session, run_id)
            session.execute(delete(DbDiagnosis).where(DbDiagnosis.run_id == run_id))
            if rows:
                session.execute(insert(DbDiagnosis), rows)

    def load_diagnoses(self, run_id: int) -> list[DiagnosisRow]:
        query = select(DbDiagnosis).where(DbDiagnosis.run_id == run_id).order_by(DbDiagnosis.position)
        with self._read.begin() as session:
            return [DiagnosisRow(d.fault_id, d.severity, d.symptom, d.evidence, d.cause, d.fix, d.trials or [])
                    for d in session.scalars(query)]

    # ------------------------------------------------------------ cost profiles

    def save_profile(self, name: str, data: dict) -> None:
        """Store a named cost profile, replacing one of the same name."""
        with self._write.begin() as session:
            session.execute(delete(DbProfile).where(DbProfile.name == name))
            session.add(DbProfile(name=name, data=data))

    def load_profile(self, name: str) -> dict | None:
        with self._read.begin() as session:
            return session.scalar(select(DbProfile.data).where(DbProfile.name == name))

    def list_profiles(self) -> list[str]:
        with self._read.begin() as session:
            return list(session.scalars(select(DbProfile.name).order_by(DbProfile.name)))

    # ------------------------------------------------------------ plumbing

    def _require_run(self, session: Session, run_id: int) -> DbRun:
        run = session.get(DbRun, run_id)
        if run is None:
            raise RunNotFoundError(f"no run {run_id} in {self.display_url}")
        return run

    def _create_engine(self, url: URL) -> Engine:
        options: dict = {"json_serializer": _json_dumps, "json_deserializer": _json_loads}
        backend = url.get_backend_name()
        if backend == "sqlite":
            if _is_sqlite_file(url):
                folder = os.path.dirname(os.path.abspath(url.database))
                if not os.path.isdir(folder):
                    raise StoreError(f"cannot open database {self.display_url}: "
                                     f"directory {folder} does not exist")
            options["connect_args"] = {"timeout": 60}  # seconds a writer waits for the lock
        elif backend == "postgresql":
            options["pool_pre_ping"] = True
            if "connect_timeout" not in url.query:
                options["connect_args"] = {"connect_timeout": 10}
        engine = create_engine(url, **options)
        if backend == "sqlite":
            _configure_sqlite(engine)
        return engine

    def _create_schema(self) -> None:
        # Two processes may create the schema at once; on PostgreSQL the loser of that race
        # fails on a duplicate table, and a second pass finds the tables there.
        for attempt in (1, 2):
            try:
                Base.metadata.create_all(self._write_engine)
                _add_new_columns(self._write_engine)
                return
            except DBAPIError as err:
                lost_race = attempt == 1 and isinstance(err, (IntegrityError, ProgrammingError))
                if not lost_race:
                    self._engine.dispose()
                    raise StoreError(f"cannot open database {self.display_url}: {_cause(err)}") from None


# Columns added after a table was first made: an older database gets them, empty, when opened.
NEW_COLUMNS = {"kvtune_diagnoses": {"trials": "JSON"}}


def _add_new_columns(engine: Engine) -> None:
    inspector = inspect(engine)
    for table, columns in NEW_COLUMNS.items():
        have = {c["name"] for c in inspector.get_columns(table)}
        with engine.begin() as conn:
            for name, kind in columns.items():
                if name not in have:
                    conn.execute(sql_text(f"ALTER TABLE {table} ADD COLUMN {name} {kind}"))


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer, nor it them
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def on_begin(conn):
        # A deferred transaction that reads and then writes cannot wait for the lock:
        # SQLite fails it at once. Writers take the lock up front and wait their turn.
        write = conn.get_execution_options().get("kvtune_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _cause(err: DBAPIError) -> str:
    return " ".join(str(err.orig).split())


def _check_status(status: str) -> None:
    if status not in RUN_STATUSES:
        raise ValueError(f"run status must be one of {RUN_STATUSES}, not {status!r}")


def _as_utc(moment: datetime) -> datetime:
    # SQLite keeps no time zone: what comes back naive was written as UTC.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _nan_to_null(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


def _request_row(record: RequestRecord) -> dict:
    row = {name: getattr(record, name) for name in _REQUEST_FIELDS}
    row["itl_s"] = list(record.itl_s)
    return row


def _request_record(row: DbRequest) -> RequestRecord:
    return RequestRecord(**{name: getattr(row, name) for name in _REQUEST_FIELDS})


def _finish_times(records: list[RequestRecord]) -> list[float]:
    """When each completed request finished, on the run's clock (that of its series' time)."""
    return [r.arrival_s + r.e2e_s for r in records if r.ok and r.e2e_s is not None]


def _insert_series(session: Session, run_id: int, series: dict[str, list]) -> None:
    if series:
        session.execute(insert(DbSeries), [
            {"run_id": run_id, "position": i, "name": name, "values": list(values)}
            for i, (name, values) in enumerate(series.items())])


def _chunks(ids: list[int], size: int = 500):
    for i in range(0, len(ids), size):
        yield ids[i:i + size]


# ---------------------------------------------------------------- downsampling

def downsample_series(series: dict[str, list], points: int = SUMMARY_POINTS,
                      finished_at: list[float] | None = None) -> dict[str, list]:
    """A run's series in at most `points` samples, each one time bucket of the run.

    The run's span (first to last `time`) is cut into `points` equal windows and the
    samples in each are merged into one; empty windows (a sim run's idle gaps) give none;
    series of at most `points` samples keep every sample. A merged sample's `time` is its last sample's (a sample's time is its end), its
    `duration` the sum of theirs (the time they cover); a counter (COUNTER_SERIES: events
    per sample) is their sum, so totals, the prefix hit rate and the preemptions so far
    are exact; a gauge (KV usage, running, waiting, any other series) is their peak, as
    the report's and the UI's charts bin it, so the peaks they draw survive. Time-weighted
    means of gauges become upper bounds. Missing values (None, NaN) are skipped; a window
    with none stays None. Floats keep 6 significant digits.

    With `finished_at` (the completed requests' finish times) and no `requests_finished`
    series yet, one is added, as a live server's scrape has: requests finished per sample,
    so a summary run still says how many requests its series cover (the diagnosis reads it
    when there are no request records).

    Series not aligned with `time` are kept as they are when short, else thinned evenly."""
    times = series.get("time") or []
    n = len(times)
    out: dict[str, list] = {}
    if n == 0:
        return {name: _thin(values, points) for name, values in series.items()}
    t = _floats(times)
    finite = np.isfinite(t)
    lo, hi = (float(t[finite].min()), float(t[finite].max())) if finite.any() else (0.0, 0.0)
    t = np.where(finite, t, lo)
    width = (hi - lo) / points
    if n <= points:  # short enough: each sample stays one (so downsampling a summary run changes nothing)
        bucket = np.arange(n)
    elif width > 0:
        bucket = np.minimum(((t - lo) / width).astype(int), points - 1)
    else:
        bucket = np.zeros(n, int)
    used = np.unique(bucket)  # sorted: the buckets in time order
    slot = np.searchsorted(used, bucket)  # each sample's merged sample
    m = len(used)
    for name, values in series.items():
        if name == "time":
            merged = _merge(t, slot, m, "max")
        elif len(values) != n:
            out[name] = _thin(values, points)
            continue
        else:
            kind = "sum" if name == "duration" or name in COUNTER_SERIES else "max"
            merged = _merge(_floats(values), slot, m, kind)
        out[name] = _compact(merged, all(isinstance(v, int) or v is None for v in values))
    if finished_at and "requests_finished" not in series:
        ends = np.asarray(out["time"], dtype=float)
        at = np.clip(np.searchsorted(ends, np.asarray(finished_at, dtype=float) - 1e-9), 0, m - 1)
        out["requests_finished"] = [int(c) for c in np.bincount(at, minlength=m)]
    return out


def _floats(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _merge(values: np.ndarray, slot: np.ndarray, m: int, kind: str) -> np.ndarray:
    present = ~np.isnan(values)
    counts = np.bincount(slot[present], minlength=m)
    if kind == "sum":
        merged = np.bincount(slot[present], values[present], minlength=m)
    else:
        merged = np.full(m, -np.inf)
        np.maximum.at(merged, slot[present], values[present])
    return np.where(counts > 0, merged, np.nan)


def _compact(values: np.ndarray, ints: bool) -> list:
    if ints:
        return [None if math.isnan(v) else int(v) for v in values.tolist()]
    return [None if math.isnan(v) else float(f"{v:.{_SIGNIFICANT}g}") for v in values.tolist()]


def _thin(values: list, points: int) -> list:
    if len(values) <= points:
        return list(values)
    return [values[int(i)] for i in np.linspace(0, len(values) - 1, points)]


def _summary_select():
    return select(DbRun.id, DbRun.created_at, DbRun.target, DbRun.model, DbRun.device, DbRun.status,
                  DbRun.error, DbRun.label, DbRun.study, DbRun.trial_number, DbRun.duration_s, DbRun.summary)


def _summary_row(row) -> RunSummaryRow:
    summary = row.summary or {}
    return RunSummaryRow(
        id=row.id, created_at=_as_utc(row.created_at), target=row.target, model=row.model,
        device=row.device, status=row.status, error=row.error, label=row.label, study=row.study,
        trial_number=row.trial_number, duration_s=row.duration_s,
        **{name: summary.get(name) for name in SUMMARY_FIGURES})


def _diagnosis_fields(diagnosis) -> dict:
    d = dataclasses.asdict(diagnosis) if dataclasses.is_dataclass(diagnosis) else dict(diagnosis)
    fields = {
        "fault_id": d.get("fault_id", d.get("id")),
        "severity": d.get("severity"),
        "symptom": d.get("symptom"),
        "evidence": list(d.get("evidence") or []),
        "cause": d.get("cause", d.get("root_cause")),
        "fix": d.get("fix"),
    }
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(f"diagnosis {fields['fault_id'] or d!r} lacks {', '.join(missing)}")
    return fields | {"trials": list(d.get("trials") or [])}
