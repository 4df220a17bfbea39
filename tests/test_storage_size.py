"""What a search stores: stage-1 trials in summary, the few a report shows in full.

Real SQLite files, real simulator runs through Stage1: the bytes a trial costs,
what a summary run still holds, and that everything reading runs copes with one.
"""
import sqlite3

import numpy as np
import pytest

from kvengine.config import EngineConfig, device_preset, model_preset
from kvtune.diagnose import diagnose
from kvtune.diagnose.signals import Series
from kvtune.diagnose.sufficiency import finished_requests
from kvtune.report import write_report
from kvtune.report.plots import kv_over_time
from kvtune.results import RunResult
from kvtune.scrape.log import SERIES_COUNTERS
from kvtune.search import Objective, Stage1, load_space, open_storage, open_study, parse_slo, ranked_trials
from kvtune.search.study import KEEP_FULL
from kvtune.store import COUNTER_SERIES, SUMMARY_POINTS, Store, downsample_series
from kvtune.targets import SimTarget
from kvtune.workload import TraceRequest, Workload

TRIALS = 8


def workload() -> Workload:
    """Arrivals spread out on a fast device: many small steps (~1,400), as a real trace gives."""
    return Workload([TraceRequest(i / 6.0, 300 + (i * 37) % 400, 64) for i in range(60)])


def stored_bytes(path: str, run_ids) -> int:
    """Bytes of our rows for these runs: the run rows' JSON, every request row, every series."""
    ids = ",".join(str(i) for i in run_ids)
    con = sqlite3.connect(path)
    try:
        def one(sql):
            return con.execute(sql.format(ids=ids)).fetchone()[0] or 0
        runs = one("SELECT sum(length(summary) + length(workload) + length(config)) FROM kvtune_runs "
                   "WHERE id IN ({ids})")
        # a request row's other twelve columns: ~60 bytes as SQLite stores them
        requests = one("SELECT sum(length(itl_s) + length(request_id) + 60) FROM kvtune_requests "
                       "WHERE run_id IN ({ids})")
        series = one('SELECT sum(length("values") + length(name)) FROM kvtune_series WHERE run_id IN ({ids})')
    finally:
        con.close()
    return runs + requests + series


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("size")
    path = str(tmp / "s.db")
    db = f"sqlite:///{path}"
    space = load_space(None, ["block_size=16,32", "kv_cache_dtype=auto,fp8", "max_num_seqs=16:1024:log",
                              "gpu_memory_utilization=0.85:0.95:0.01"])
    objective = Objective("goodput", (parse_slo("ttft_p95=100ms"), parse_slo("tpot_p95=10ms")))
    model, device = model_preset("llama-3-8b"), device_preset("h100-80gb")
    default = EngineConfig(max_model_len=4096).resolve(model, device)
    dflt = {name: getattr(default, name) for name in space.names}
    study = open_study(open_storage(db), "size", objective, "random", 0,
                       {"workload": "spread", "preset": "llama-3-8b", "device": "h100-80gb",
                        "slos": [str(s) for s in objective.slos]})
    study.set_user_attr("default_params", dflt)  # as `kvtune search` does
    store = Store(db)
    stage1 = Stage1(study, space, EngineConfig(max_model_len=4096), objective, SimTarget(model, device).run,
                    workload(), store, TRIALS)
    stage1.enqueue(dflt)
    stage1.optimize()
    runs = {t.number: t.user_attrs["run_id"] for t in study.get_trials() if "run_id" in t.user_attrs}
    yield {"db": db, "path": path, "store": store, "study": study, "stage1": stage1, "runs": runs,
           "objective": objective, "default": dflt, "tmp": tmp}
    store.close()


def test_only_the_best_and_the_default_are_stored_in_full(search):
    store, runs = search["store"], search["runs"]
    assert len(set(runs.values())) >= TRIALS - 1  # a duplicate may share its twin's run
    full = store.full_runs(runs.values())
    assert full == kept_in_full(search) and len(full) <= KEEP_FULL + 1
    for number, run_id in runs.items():
        result = store.load_run(run_id)
        if run_id in full:  # what the report's plots and diagnoses read: every request
            assert len(result.requests) == 60 and all(r.itl_s for r in result.requests if r.ok)
        else:
            assert result.requests == []
            assert 0 < len(result.series["time"]) <= SUMMARY_POINTS
        assert result.summary["completed"] == 60  # the figures are the run's, whatever the detail


def test_a_summary_trial_costs_a_small_share_of_a_full_one(search):
    """The same trial before and after keep_full re-runs it in full: the bytes it costs each way."""
    store, stage1, runs, path = search["store"], search["stage1"], search["runs"], search["path"]
    slim = sorted(set(runs.values()) - store.full_runs(runs.values()))
    assert len(slim) >= 2
    before = stored_bytes(path, slim)
    summaries = {i: store.load_run(i) for i in slim}
    assert stage1.keep_full(slim) == slim
    after = stored_bytes(path, slim)
    assert after > 10 * before, (before, after)
    for run_id, summary in summaries.items():
        full = store.load_run(run_id)
        assert len(full.requests) == 60 and full.summary == summary.summary
        assert len(full.series["time"]) > 5 * SUMMARY_POINTS
        _holds_the_full_runs_totals_and_peaks(summary.series, full.series)
    assert stage1.keep_full(slim) == []  # already full: nothing re-run
    assert sorted(store.slim_runs(slim)) == slim  # and back to summary for the tests that follow
    assert stored_bytes(path, slim) == before
    assert store.slim_runs(slim) == []


def _holds_the_full_runs_totals_and_peaks(slim: dict, full: dict):
    for name, values in full.items():
        if name == "time":
            assert slim["time"][-1] == pytest.approx(values[-1], rel=1e-5)
        elif name in COUNTER_SERIES or name == "duration":
            assert sum(slim[name]) == pytest.approx(sum(values), rel=1e-5), name
        else:
            assert max(slim[name]) == pytest.approx(max(values), rel=1e-5), name


def test_a_summary_run_round_trips_and_every_reader_takes_it(search):
    store, runs = search["store"], search["runs"]
    run_id = sorted(set(runs.values()) - store.full_runs(runs.values()))[0]
    result = store.load_run(run_id)
    assert result.requests == [] and result.config["max_model_len"] == 4096 and result.workload["requests"] == 60
    again = store.save_run(result, detail="summary")  # a summary run saved again is itself
    assert store.load_run(again).series == result.series
    # the diagnosis counts the requests its series cover, as it would for a scraped server
    assert finished_requests(result, Series(result.series))[0] == 60
    assert all(d.id != "INSUFFICIENT_DATA" for d in diagnose(result))
    from kvtune.search.report_data import RunView
    assert kv_over_time([RunView("trial", "sim", run_id, result)]) is not None
    from kvtune.ui import charts
    assert charts.timeline(result.series) is not None
    assert charts.lengths([r.prompt_tokens for r in result.requests], []) is None


def test_the_report_builds_from_a_search_stored_so(search):
    md, html = write_report(search["db"], "size", str(search["tmp"] / "report"))
    assert md.stat().st_size > 0 and html.stat().st_size > 0
    assert "KV cache" in md.read_text()


def test_the_runs_a_report_shows_come_back_in_full(search):
    """Every run in summary (a search stopped early, or slimmed by another process): the report still
    builds, and keep_full puts the runs it plots and diagnoses back in full, as they were."""
    from kvtune.search.report_data import load_report_data
    store, stage1, runs, db = search["store"], search["stage1"], search["runs"], search["db"]
    store.slim_runs(runs.values())
    assert store.full_runs(runs.values()) == set()
    md, _ = write_report(db, "size", str(search["tmp"] / "slim-report"))
    assert md.stat().st_size > 0
    data = load_report_data(db, "size")
    shown = {v.run_id for v in (data.best_run, data.default_run) if v is not None}
    assert shown and all(v.result.requests == [] for v in (data.best_run, data.default_run) if v)
    assert sorted(stage1.keep_full(shown)) == sorted(shown)
    assert store.full_runs(runs.values()) == shown
    again = load_report_data(db, "size")
    assert {v.run_id for v in (again.best_run, again.default_run) if v is not None} == shown
    assert all(len(v.result.requests) == 60 for v in (again.best_run, again.default_run) if v)
    stage1.slim_dropped_runs()  # as the next trial of a resumed search would: slims, never re-runs
    assert store.full_runs(runs.values()) == shown & kept_in_full(search)


def kept_in_full(search) -> set[int]:
    study, runs = search["study"], search["runs"]
    best = [t.number for t in ranked_trials(study, search["objective"])[:KEEP_FULL]]
    default = next(t.number for t in study.get_trials() if t.params == search["default"])
    return {runs[n] for n in best + [default]}


def test_downsampling_rule():
    n = 1000
    t = np.cumsum(np.full(n, 0.01)).tolist()
    series = {
        "time": t, "duration": [0.01] * n,
        "kv_usage": [0.5 + 0.4 * np.sin(i / 50) for i in range(n)],
        "num_running": [i % 17 for i in range(n)],
        "num_waiting": [None if i % 3 else i % 5 for i in range(n)],  # a scrape that missed samples
        "prefix_queries": [16] * n, "prefix_hits": [i % 2 * 16 for i in range(n)],
        "odd": [1, 2, 3],  # not aligned with time: kept as it is
    }
    out = downsample_series(series, points=50, finished_at=[0.005, 5.0, t[-1]])
    assert all(len(v) == 50 for k, v in out.items() if k != "odd") and out["odd"] == [1, 2, 3]
    assert out["time"][-1] == pytest.approx(t[-1]) and sum(out["duration"]) == pytest.approx(10.0)
    assert sum(out["prefix_hits"]) == sum(series["prefix_hits"]) and isinstance(out["prefix_hits"][0], int)
    assert max(out["kv_usage"]) == pytest.approx(max(series["kv_usage"]), rel=1e-6)
    assert max(out["num_running"]) == 16 and all(isinstance(v, int) for v in out["num_running"])
    assert max(v for v in out["num_waiting"] if v is not None) == 4
    assert sum(out["requests_finished"]) == 3 and out["requests_finished"][0] == 1
    assert downsample_series(series, points=2000)["kv_usage"] == pytest.approx(series["kv_usage"], rel=1e-5)
    assert downsample_series({"time": [], "duration": []}) == {"time": [], "duration": []}
    assert set(SERIES_COUNTERS) <= COUNTER_SERIES  # a scrape's counters add up, never peak


def test_an_unknown_detail_is_refused(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/d.db")
    result = RunResult("sim", "tiny", "cpu", {}, {}, [], {"time": [1.0], "duration": [1.0]}, 1.0)
    with pytest.raises(ValueError, match="detail"):
        store.save_run(result, detail="some")
    assert store.list_runs() == []
    store.close()
