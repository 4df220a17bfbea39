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
from ..dburl import DB_ENV, DEFAULT_DB_URL
from ..results import SUMMARY_FIGURES
from .database import DETAILS, Store
from .downsample import COUNTER_SERIES, SUMMARY_POINTS, downsample_series
from .errors import RunNotFoundError, StoreError
from .rows import DiagnosisRow, RunSummaryRow, Sample, TrialRow
from .schema import RUN_STATUSES, TRIAL_STAGES
from .urls import mask_url, missing_database, resolve_db_url

__all__ = ["COUNTER_SERIES", "DB_ENV", "DEFAULT_DB_URL", "DETAILS", "RUN_STATUSES", "SUMMARY_FIGURES", "SUMMARY_POINTS",
           "TRIAL_STAGES", "DiagnosisRow", "RunNotFoundError", "RunSummaryRow", "Sample", "Store", "StoreError",
           "TrialRow", "downsample_series", "mask_url", "missing_database", "resolve_db_url"]
