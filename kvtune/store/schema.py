"""The tables (every one prefixed `kvtune_`: Optuna's RDB storage may share the database) and
what opening a database sets up: SQLite's locking, columns an older database lacks."""
from __future__ import annotations

from datetime import UTC, datetime
from typing import ClassVar

from sqlalchemy import (
    JSON,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    String,
    Text,
    UniqueConstraint,
    event,
    inspect,
)
from sqlalchemy import text as sql_text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import DateTime

RUN_STATUSES = ("ok", "failed", "running")  # a run a signal stopped is 'failed', "interrupted by SIGTERM"
TRIAL_STAGES = ("sim", "live")


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


# Columns added after a table was first made: an older database gets them, empty, when opened.
NEW_COLUMNS = {"kvtune_diagnoses": {"trials": "JSON"}}


def add_new_columns(engine: Engine) -> None:
    inspector = inspect(engine)
    for table, columns in NEW_COLUMNS.items():
        have = {c["name"] for c in inspector.get_columns(table)}
        with engine.begin() as conn:
            for name, kind in columns.items():
                if name not in have:
                    conn.execute(sql_text(f"ALTER TABLE {table} ADD COLUMN {name} {kind}"))


def configure_sqlite(engine: Engine, every_transaction_writes: bool = False) -> None:
    """WAL, foreign keys, and writers that take the lock when they begin. The store says which of
    its transactions write (execution option kvtune_write); Optuna's storage does not, and its
    sessions read and then write, so `every_transaction_writes` begins each one as a writer."""
    @event.listens_for(engine, "connect")
    def on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        cursor = dbapi_conn.cursor()
        _set_wal(cursor)  # readers never block the writer, nor it them
        # In WAL mode NORMAL syncs at checkpoints, not at each commit (Optuna commits each trial attribute
        # on its own): a crash of the process loses nothing, a power cut at most the last commits, and
        # the database stays consistent either way (SQLite's "WAL mode" documentation).
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def on_begin(conn):
        # A deferred transaction that reads and then writes cannot wait for the lock:
        # SQLite fails it at once. Writers take the lock up front and wait their turn.
        write = every_transaction_writes or conn.get_execution_options().get("kvtune_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _set_wal(cursor) -> None:
    """PRAGMA journal_mode=WAL, again while another process opening a new database at the same moment
    holds the lock it needs: SQLite refuses that change at once ("database is locked") instead of
    waiting its busy timeout."""
    import sqlite3
    import time
    for attempt in range(100):
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or attempt == 99:
                raise
            time.sleep(0.05)
