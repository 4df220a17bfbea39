"""The Store: one database's runs, live samples, trials, diagnoses and cost profiles (the
package's docstring says what a run keeps in each detail)."""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from typing import Any, Self

from sqlalchemy import create_engine, delete, insert, select, update
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from ..results import RequestRecord, RunResult
from .downsample import downsample_series
from .errors import RunNotFoundError, StoreError
from .jsoncodec import json_dumps, json_loads
from .rows import DiagnosisRow, RunSummaryRow, Sample, TrialRow, as_utc, summary_row, summary_select
from .schema import (
    RUN_STATUSES,
    TRIAL_STAGES,
    Base,
    DbDiagnosis,
    DbProfile,
    DbRequest,
    DbRun,
    DbSample,
    DbSeries,
    DbTrial,
    add_new_columns,
    configure_sqlite,
)
from .urls import is_sqlite_file, parse_url, mask_url

DETAILS = ("full", "summary")
_REQUEST_FIELDS = [f.name for f in dataclasses.fields(RequestRecord)]


class Store:
    """One database: open it with a URL (see resolve_db_url); the schema is created on first use.

    One Store per process: engines must not cross a fork.
    """

    def __init__(self, url: str):
        self.url = parse_url(url).render_as_string(hide_password=False)
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
            row = session.execute(summary_select().where(DbRun.id == run_id)).one_or_none()
        if row is None:
            raise RunNotFoundError(f"no run {run_id} in {self.display_url}")
        return summary_row(row)

    def list_runs(self, limit: int = 50, target: str | None = None, status: str | None = None,
                  study: str | None = None) -> list[RunSummaryRow]:
        """Newest first."""
        query = summary_select().order_by(DbRun.id.desc()).limit(limit)
        if target is not None:
            query = query.where(DbRun.target == target)
        if status is not None:
            query = query.where(DbRun.status == status)
        if study is not None:
            query = query.where(DbRun.study == study)
        with self._read.begin() as session:
            return [summary_row(row) for row in session.execute(query)]

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
                             t.reason, t.run_id, as_utc(t.created_at))
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
        options: dict = {"json_serializer": json_dumps, "json_deserializer": json_loads}
        backend = url.get_backend_name()
        if backend == "sqlite":
            if is_sqlite_file(url):
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
            configure_sqlite(engine)
        return engine

    def _create_schema(self) -> None:
        # Two processes may create the schema at once; on PostgreSQL the loser of that race
        # fails on a duplicate table, and a second pass finds the tables there.
        for attempt in (1, 2):
            try:
                Base.metadata.create_all(self._write_engine)
                add_new_columns(self._write_engine)
                return
            except DBAPIError as err:
                lost_race = attempt == 1 and isinstance(err, (IntegrityError, ProgrammingError))
                if not lost_race:
                    self._engine.dispose()
                    raise StoreError(f"cannot open database {self.display_url}: {_cause(err)}") from None


def _cause(err: DBAPIError) -> str:
    return " ".join(str(err.orig).split())


def _check_status(status: str) -> None:
    if status not in RUN_STATUSES:
        raise ValueError(f"run status must be one of {RUN_STATUSES}, not {status!r}")


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
