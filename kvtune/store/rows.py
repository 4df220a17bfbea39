"""What the store's readers return: a run's summary row, a live sample, a trial, a diagnosis."""
from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import NamedTuple

from sqlalchemy import select

from ..results import SUMMARY_FIGURES
from .schema import DbRun


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
    server_url: str | None = None  # a run of a running server (`--target URL`): which one


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


def as_utc(moment: datetime) -> datetime:
    # SQLite keeps no time zone: what comes back naive was written as UTC.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def summary_select():
    return select(DbRun.id, DbRun.created_at, DbRun.target, DbRun.model, DbRun.device, DbRun.status,
                  DbRun.error, DbRun.label, DbRun.study, DbRun.trial_number, DbRun.duration_s, DbRun.summary,
                  DbRun.config["server_url"].as_string().label("server_url"))


def summary_row(row) -> RunSummaryRow:
    summary = row.summary or {}
    return RunSummaryRow(
        id=row.id, created_at=as_utc(row.created_at), target=row.target, model=row.model,
        device=row.device, status=row.status, error=row.error, label=row.label, study=row.study,
        trial_number=row.trial_number, duration_s=row.duration_s, server_url=row.server_url,
        **{name: summary.get(name) for name in SUMMARY_FIGURES})
