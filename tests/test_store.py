"""The store: exact round trips on real SQLite files (and a throwaway PostgreSQL where one is installed)."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest
from kvengine.config import EngineConfig, device_preset, model_preset
from sqlalchemy import create_engine, inspect

from kvtune.results import RunResult
from kvtune.store import (
    DEFAULT_DB_URL,
    RunNotFoundError,
    Sample,
    Store,
    StoreError,
    mask_url,
    resolve_db_url,
)
from kvtune.targets import SimTarget
from kvtune.workload import TraceRequest, Workload

import pgserver
from serverproc import free_port

MODEL, DEVICE = model_preset("llama-3-8b"), device_preset("h100-80gb")
OPTUNA_TABLES = {"studies", "study_directions", "study_user_attributes", "study_system_attributes", "trials",
                 "trial_params", "trial_values", "trial_user_attributes", "trial_system_attributes",
                 "trial_intermediate_values", "trial_heartbeats", "version_info", "alembic_version"}


def sim_run(config=None) -> RunResult:
    requests = [TraceRequest(0.0, 300, 5), TraceRequest(0.1, 400, 1, hash_ids=(1, 2)),
                TraceRequest(0.2, 300, 3, hash_ids=(1, 2)), TraceRequest(0.3, 9000, 4)]  # the last is rejected
    return SimTarget(MODEL, DEVICE).run(config or EngineConfig(max_model_len=8192), Workload(requests))


def as_json(result: RunResult) -> str:
    # Compares NaN equal to NaN, and 1 unequal to 1.0: exactness as text.
    return json.dumps(result.to_dict())


# ---------------------------------------------------------------- backends

@pytest.fixture(scope="module")
def postgres_server():
    """A throwaway PostgreSQL cluster on 127.0.0.1 (tests/pgserver.py); yields its base URL."""
    try:
        with pgserver.postgres_server() as base_url:
            yield base_url
    except pgserver.PostgresUnavailable as err:
        pytest.skip(str(err))


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'kvtune.db'}"
    else:
        server = request.getfixturevalue("postgres_server")
        url = pgserver.fresh_database(server, f"t_{abs(hash(request.node.name)) % 10**9}")
    with Store(url) as s:
        yield s


# ---------------------------------------------------------------- runs

def test_run_round_trip_is_exact(store):
    result = sim_run()
    result.summary["nan_figure"] = float("nan")  # e.g. a rate over a zero duration
    result.summary["inf_figure"] = float("-inf")
    result.workload["numpy"] = [1, 2.5]
    assert result.requests[3].finish_reason == "rejected" and result.requests[3].error

    run_id = store.save_run(result)
    back = store.load_run(run_id)

    assert as_json(back) == as_json(result)
    assert list(back.series) == list(result.series)
    assert [r.request_id for r in back.requests] == [r.request_id for r in result.requests]
    assert math.isnan(back.summary["nan_figure"]) and back.summary["inf_figure"] == float("-inf")
    assert isinstance(back.series["num_running"][0], int) and isinstance(back.series["time"][0], float)


def test_run_without_requests_or_series(store):
    empty = RunResult("url", "m", "d", {}, {}, [], {}, 0.0)
    assert as_json(store.load_run(store.save_run(empty))) == as_json(empty)
    # a running server's run names it in every list of runs (read out of its config by the database)
    of_url = RunResult("url", "m", "d", {"server_url": "http://10.0.0.5:8000"}, {}, [], {}, 0.0)
    url_id = store.save_run(of_url)
    assert {r.id: r.server_url for r in store.list_runs()} == {url_id: "http://10.0.0.5:8000", url_id - 1: None}


def test_failed_run_keeps_its_reason(store):
    bad = RunResult("sim", MODEL.name, DEVICE.name, {"gpu_memory_utilization": 0.5}, {}, [], {}, 0.0)
    reason, exited = "no room for KV blocks at gpu_memory_utilization=0.5", "server exited with code 1"
    failed_id = store.save_run(bad, status="failed", error=reason)
    started_id = store.start_run("engine", MODEL.name, DEVICE.name, config={"block_size": 16})
    store.mark_run(started_id, "failed", exited)

    assert store.get_run(failed_id).error == reason
    assert store.load_run(failed_id).config == {"gpu_memory_utilization": 0.5}
    rows = store.list_runs(status="failed")
    assert {(r.id, r.error) for r in rows} == {(failed_id, reason), (started_id, exited)}


def test_bad_status_is_refused(store):
    with pytest.raises(ValueError, match="status"):
        store.save_run(sim_run(), status="great")


def test_list_runs_newest_first_with_filters(store):
    result = sim_run()
    ids = [store.save_run(result) for _ in range(3)]
    other = dataclasses.replace(result, target="engine")
    engine_id = store.save_run(other, study="s1", trial=7, label="baseline")
    running_id = store.start_run("sim", MODEL.name, DEVICE.name)

    rows = store.list_runs()
    assert [r.id for r in rows] == [running_id, engine_id, *reversed(ids)]
    assert [r.id for r in store.list_runs(limit=2)] == [running_id, engine_id]
    assert [r.id for r in store.list_runs(target="engine")] == [engine_id]
    assert [r.id for r in store.list_runs(status="running")] == [running_id]
    assert [r.id for r in store.list_runs(study="s1")] == [engine_id]

    row = store.get_run(engine_id)
    assert (row.study, row.trial_number, row.label, row.status) == ("s1", 7, "baseline", "ok")
    assert row.completed == result.summary["completed"] and row.ttft_p95 == result.summary["ttft_p95"]
    assert row.created_at.tzinfo is not None and abs(time.time() - row.created_at.timestamp()) < 60


def test_started_run_is_completed_by_save_run(store):
    run_id = store.start_run("sim", MODEL.name, DEVICE.name, study="s", trial=3)
    store.add_samples(run_id, [(0.5, "kv_usage", 0.25)])
    assert store.get_run(run_id).status == "running"

    result = sim_run()
    assert store.save_run(result, run_id=run_id) == run_id
    row = store.get_run(run_id)
    assert (row.status, row.study, row.trial_number) == ("ok", "s", 3)
    assert as_json(store.load_run(run_id)) == as_json(result)
    assert store.load_samples(run_id) == [Sample(0.5, "kv_usage", 0.25)]


def test_delete_run_removes_what_hangs_on_it(store):
    run_id = store.save_run(sim_run())
    keep_id = store.save_run(sim_run())
    store.add_samples(run_id, [(1.0, "x", 1.0)])
    store.save_diagnoses(run_id, [diagnosis("F1")])
    store.save_trial("s", 0, "sim", "COMPLETE", {"block_size": 16}, [1.0], run_id=run_id)

    assert store.delete_run(run_id) is True
    assert store.delete_run(run_id) is False
    with pytest.raises(RunNotFoundError, match=f"no run {run_id}"):
        store.load_run(run_id)
    assert store.load_samples(run_id) == [] and store.load_diagnoses(run_id) == []
    assert store.list_trials("s")[0].run_id is None
    assert len(store.load_run(keep_id).requests) == 4


def test_unknown_run_id(store):
    for call in (store.load_run, store.get_run, lambda i: store.mark_run(i, "ok")):
        with pytest.raises(RunNotFoundError):
            call(12345)


# ---------------------------------------------------------------- samples

def test_samples_bulk_insert_and_since(store):
    run_id = store.start_run("engine", MODEL.name, DEVICE.name)
    rows = [(t * 0.5, name, float(t)) for t in range(2000) for name in ("kv_usage", "num_running")]
    assert store.add_samples(run_id, rows) == 4000
    assert store.add_samples(run_id, []) == 0

    everything = store.load_samples(run_id)
    assert len(everything) == 4000 and everything[0] == Sample(0.0, "kv_usage", 0.0)
    assert [s.t for s in everything] == sorted(s.t for s in everything)

    tail = store.load_samples(run_id, since_t=989.0)  # strictly after: polling never repeats a sample
    assert [(s.t, s.name) for s in tail[:2]] == [(989.5, "kv_usage"), (989.5, "num_running")]
    assert len(tail) == 2 * 21

    store.add_samples(run_id, [Sample(1000.0, "kv_usage", float("nan"))])
    (last,) = store.load_samples(run_id, since_t=999.5)
    assert last.t == 1000.0 and math.isnan(last.value)


# ---------------------------------------------------------------- trials

def test_trials_are_upserted_and_listed(store):
    run_id = store.save_run(sim_run())
    params = {"block_size": 32, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "fp8"}
    first = store.save_trial("study-a", 0, "sim", "RUNNING", params)
    again = store.save_trial("study-a", 0, "sim", "COMPLETE", params, values=[812.5, 0.25],
                             constraints={"ttft_slo": -0.1}, run_id=run_id)
    store.save_trial("study-a", 1, "sim", "FAIL", {"block_size": 256}, reason="TargetStartError: OOM")
    store.save_trial("study-a", 0, "live", "COMPLETE", params, values=[790.0, 0.3])
    store.save_trial("study-b", 0, "sim", "COMPLETE", {}, values=[1.0])

    assert again == first
    trials = store.list_trials("study-a")
    assert [(t.stage, t.number, t.state) for t in trials] == [
        ("sim", 0, "COMPLETE"), ("sim", 1, "FAIL"), ("live", 0, "COMPLETE")]
    done = trials[0]
    assert (done.params, done.values, done.constraints, done.run_id) == (
        params, [812.5, 0.25], {"ttft_slo": -0.1}, run_id)
    assert trials[1].reason == "TargetStartError: OOM" and trials[1].values is None
    assert [t.number for t in store.list_trials("study-a", stage="live")] == [0]
    with pytest.raises(ValueError, match="stage"):
        store.save_trial("study-a", 2, "staging", "COMPLETE", {})


# ---------------------------------------------------------------- diagnoses

def diagnosis(fault_id, **changes):
    d = {"fault_id": fault_id, "severity": "high", "symptom": "preemptions under load",
         "evidence": [{"metric": "vllm:num_preemptions_total", "window": "60s", "value": 42.0, "threshold": 0}],
         "cause": "KV cache too small for max_num_seqs", "fix": "--max-num-seqs 128"}
    return d | changes


@dataclasses.dataclass
class RuleOutput:  # what a diagnose.py rule might return
    id: str
    severity: str
    symptom: str
    evidence: list
    root_cause: str
    fix: str


def test_diagnoses_round_trip_and_replace(store):
    run_id = store.save_run(sim_run())
    store.save_diagnoses(run_id, [diagnosis("F1"), diagnosis("F3", severity="low")])
    rows = store.load_diagnoses(run_id)
    assert [(d.fault_id, d.severity) for d in rows] == [("F1", "high"), ("F3", "low")]
    assert rows[0].evidence == diagnosis("F1")["evidence"] and rows[0].fix == "--max-num-seqs 128"

    store.save_diagnoses(run_id, [RuleOutput("F2", "medium", "s", [], "c", "f")])
    assert [(d.fault_id, d.cause) for d in store.load_diagnoses(run_id)] == [("F2", "c")]

    with pytest.raises(ValueError, match="lacks fix"):
        store.save_diagnoses(run_id, [diagnosis("F4", fix=None)])
    assert len(store.load_diagnoses(run_id)) == 1  # the failed save changed nothing


# ---------------------------------------------------------------- schema

def test_tables_are_prefixed_and_schema_creation_is_idempotent(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    with Store(url) as first:
        run_id = first.save_run(sim_run())
    with Store(url) as second:  # an existing schema is left as it is
        assert len(second.load_run(run_id).requests) == 4
    tables = set(inspect(create_engine(url)).get_table_names())
    assert tables == {"kvtune_runs", "kvtune_requests", "kvtune_series", "kvtune_samples",
                      "kvtune_trials", "kvtune_diagnoses", "kvtune_profiles"}
    assert not tables & OPTUNA_TABLES


# ---------------------------------------------------------------- URLs

def test_resolve_db_url_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVTUNE_DB", raising=False)
    assert resolve_db_url(None) == f"sqlite:///{tmp_path / 'kvtune.db'}"
    assert DEFAULT_DB_URL == "sqlite:///kvtune.db"

    monkeypatch.setenv("KVTUNE_DB", "sqlite:///from_env.db")
    assert resolve_db_url(None) == f"sqlite:///{tmp_path / 'from_env.db'}"
    assert resolve_db_url("sqlite:////abs/flag.db") == "sqlite:////abs/flag.db"
    assert resolve_db_url("postgresql://u:pw@db:5432/kvtune") == "postgresql://u:pw@db:5432/kvtune"

    monkeypatch.setenv("KVTUNE_DB", "")  # set but empty counts as unset
    assert resolve_db_url(None).endswith("/kvtune.db")


def test_default_db_lands_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVTUNE_DB", raising=False)
    with Store(resolve_db_url(None)) as store:
        store.save_run(sim_run())
    assert (tmp_path / "kvtune.db").is_file()


@pytest.mark.parametrize("url, message", [
    ("kvtune.db", "not a database URL: 'kvtune.db' (did you mean sqlite:///kvtune.db?)"),
    ("mysqlx://u:secret@h/db", "unknown database driver 'mysqlx' in 'mysqlx://u:***@h/db'"),
    ("postgresql://u:secret@h:port/db", "not a database URL: 'postgresql://u:***@h:port/db'"),
    ("postgresql+psycopg2://u:secret@h/db", "driver for 'postgresql+psycopg2://u:***@h/db' is not installed"),
    ("sqlite:////no/such/dir/k.db", "cannot open database sqlite:////no/such/dir/k.db: directory /no/such/dir"),
])
def test_bad_urls_give_clear_errors(url, message):
    with pytest.raises(StoreError) as err:
        Store(url)
    assert message in str(err.value) and "secret" not in str(err.value)


def test_refused_postgres_connection_is_a_clear_error():
    pytest.importorskip("psycopg", reason="psycopg (the postgresql:// driver) not installed")
    url = f"postgresql://kv:secret@127.0.0.1:{free_port()}/kvtune"
    with pytest.raises(StoreError) as err:
        Store(url)
    text = str(err.value)
    assert text.startswith(f"cannot open database {mask_url(url)}: ") and "refused" in text.lower()
    assert "secret" not in text and "***" in text


def test_a_file_that_is_not_a_database(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("not sqlite " * 100)
    with pytest.raises(StoreError, match="cannot open database .*notes.db: .*not a database"):
        Store(f"sqlite:///{path}")


# ---------------------------------------------------------------- concurrency

WRITER = textwrap.dedent("""
    import sys, time
    from kvtune.results import RequestRecord, RunResult
    from kvtune.store import Store
    url, worker, start_at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    time.sleep(max(0.0, start_at - time.time()))
    store = Store(url)  # every worker may be the one to create the schema
    requests = [RequestRecord(str(i), i * 0.1, 100, 10, 0, 0.01, 0.002, 0.03, 0.0, [0.002] * 9) for i in range(50)]
    result = RunResult("sim", "m", "d", {"worker": worker}, {}, requests, {"time": [0.1] * 500}, 5.0)
    for i in range(25):
        run_id = store.start_run("sim", "m", "d")
        store.add_samples(run_id, [(i + k / 10, "kv_usage", 0.5) for k in range(50)])
        store.save_run(result, run_id=run_id, study="race", trial=worker * 100 + i)
        store.save_trial("race", worker * 100 + i, "sim", "COMPLETE", {"w": worker}, [1.0], run_id=run_id)
    print("done", worker)
""")


def test_processes_share_one_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    start_at = time.time() + 1.5  # past every worker's imports, so they really overlap
    env = dict(os.environ, OMP_NUM_THREADS="1")
    workers = [subprocess.Popen([sys.executable, "-c", WRITER, url, str(w), str(start_at)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(3)]
    outputs = [w.communicate(timeout=120) for w in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0, err[-2000:]
        assert "database is locked" not in err
    with Store(url) as store:
        runs = store.list_runs(limit=1000, study="race")
        assert len(runs) == 75 and {r.status for r in runs} == {"ok"}
        assert len(store.list_trials("race")) == 75
        assert all(len(store.load_samples(r.id)) == 50 for r in runs[:5])
        assert len(store.load_run(runs[0].id).requests) == 50
