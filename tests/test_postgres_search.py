"""Scaling out the search: two `kvtune search` processes on one study in a real PostgreSQL.

What docs/ops.md tells operators to do across hosts (every worker points --db at the same
PostgreSQL and passes the same --study): here two processes on loopback against a throwaway
server (Debian's PostgreSQL, started by tests/pgserver.py). The study ends with exactly the
trials asked for, no trial number twice, each measured trial stored once in the run store, and
both processes did part of the work.
"""
from __future__ import annotations

import re
import subprocess
import sys

import optuna
import pytest
from pgserver import PostgresUnavailable, fresh_database, postgres_server

from kvtune.store import Store
from kvtune.workload import TraceRequest, Workload, write_workload

TRIALS = 16


@pytest.fixture(scope="module")
def postgres():
    try:
        with postgres_server() as url:
            yield url
    except PostgresUnavailable as err:
        pytest.skip(f"no throwaway PostgreSQL here: {err}")


def busy_workload(n=200, rate=20.0) -> Workload:
    """Long prompts at a rate an L4 cannot keep up with: the KV knobs change the outcome."""
    return Workload([TraceRequest(i / rate, 1500 + (i * 37) % 500, 60) for i in range(n)])


@pytest.mark.slow
def test_two_search_workers_share_one_study_in_postgres(postgres, tmp_path):
    url = fresh_database(postgres, "search_shared")
    trace = tmp_path / "t.jsonl"
    write_workload(busy_workload(), str(trace))
    args = [sys.executable, "-m", "kvtune", "search", "--workload", str(trace), "--trials", str(TRIALS),
            "--target", "none", "--db", url, "--study", "shared", "--no-report", "--device", "l4-24gb",
            "--max-model-len", "4096"]
    # Both start at once, as `docker compose up --scale search=2` starts them: the schema race included.
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]

    study = optuna.load_study(study_name="shared", storage=url)
    numbers = [t.number for t in study.trials]
    assert len(numbers) == len(set(numbers))
    counted = [t for t in study.trials if t.state.is_finished() and not t.user_attrs.get("surplus")]
    assert len(counted) == TRIALS  # the trials add up: neither process ran its own 16
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in counted), \
        [(t.number, t.user_attrs.get("fail_reason")) for t in counted if t.state.name != "COMPLETE"]

    # Each process says which trials it ran (one line per trial when there are fewer than 20):
    # together they are every counted trial, none run by both, and both took part.
    ran = [{int(n) for n in re.findall(r"^\s*trial (\d+): (?:ok|infeasible)", out, re.MULTILINE)} for out, _ in outs]
    assert ran[0] and ran[1], "one process ran no trial"
    assert not ran[0] & ran[1]
    assert ran[0] | ran[1] == {t.number for t in counted}

    # The run store: one run per measured trial (a repeated config reuses its twin's run), all on this study.
    measured = {t.number for t in counted if "duplicate_of" not in t.user_attrs}
    runs = Store(url).list_runs(study="shared", limit=1000)
    assert sorted(r.trial_number for r in runs) == sorted(measured)
    assert {t.user_attrs["run_id"] for t in counted if t.number in measured} == {r.id for r in runs}
    assert not Store(url).list_trials("shared")  # a stage-1 trial's one record is its Optuna trial
