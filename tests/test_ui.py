"""`kvtune ui`: every page through Streamlit's AppTest, on a database seeded by real runs and a real search,
and on an empty one; the Live page against a real bundled engine."""
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import optuna
import pandas as pd
import pytest
from kvengine.config import EngineConfig, device_preset, model_preset
from kvtune_cli import kvtune_main
from serverproc import ServerProcess, free_port
from streamlit.components.v2 import manifest_scanner
from streamlit.testing.v1 import AppTest

import kvtune.ui
from kvtune.diagnose import diagnose
from kvtune.plan import plan_capacity
from kvtune.report import fmt
from kvtune.search import (
    Objective,
    Stage1,
    load_space,
    open_storage,
    open_study,
    parse_slo,
    ranked_trials,
)
from kvtune.report.sections import comparison_rows
from kvtune.search.report_data import load_report_data
from kvtune.search.stage2 import LiveConfig, default_params, run_stage2
from kvtune.store import Store
from kvtune.targets import LiveOptions, SimTarget, UrlTarget
from kvtune.ui import charts
from kvtune.cli.ui import add_ui_command, streamlit_command
from kvtune.ui.planner import parse_contexts
from kvtune.ui.search import pareto_front
from kvtune.workload import IntDist, SynthSpec, synthesize, write_workload

APP = str(Path(kvtune.ui.__file__).with_name("app.py"))
PRESET, DEVICE = "llama-3-8b", "h100-80gb"
SEARCH_TRIALS = 12  # PED-ANOVA's parameter importance needs at least 10
# A study whose default fails: llama-3.1-8b's KV cache for max_model_len 46,000 needs 5.62 GiB, more than an L4
# leaves it at the default gpu_memory_utilization 0.92 (5.28 GiB); fp8 or 0.95 fit.
TIGHT_STUDY, TIGHT_TRIALS = "tight", 8
TIGHT_FLAGS = ("--preset", "llama-3.1-8b", "--device", "l4-24gb", "--max-model-len", "46000",
               "--space", "gpu_memory_utilization=0.85:0.95:0.01", "--space", "kv_cache_dtype=auto,fp8",
               "--space", "max_num_seqs=16:256:log", "--space", "block_size=16,32")
PAGES = {"runs.py": "Runs", "search.py": "Search", "diagnoses.py": "Diagnoses", "planner.py": "Planner",
         "live.py": "Live"}
# What no page may show: a raw missing value, or a float nobody rounded (0.8600000000000001, 665.2367).
RAW_MISSING = re.compile(r"\b(None|nan|NaN)\b")
UNROUNDED = re.compile(r"\d\.\d{5,}")


# ---------------------------------------------------------------- the seeded database

def workload(n=80, rate=30.0, seed=1):
    """Shared system prompts (so the prefix cache shows) at a rate that queues on a small pool."""
    return synthesize(SynthSpec(num_requests=n, rate=rate, input_len=IntDist.uniform(200, 1200),
                                output_len=IntDist.uniform(32, 128), system_prompts=2, system_prompt_len=1024,
                                seed=seed))


@dataclass
class Seeded:
    db: str
    runs: dict  # label -> run id
    server_url: str | None


def seed_database(folder: Path, server_url: str | None = None) -> Seeded:
    """Sim runs (one healthy, whose diagnosis found nothing, one on a starved KV pool), a `kvtune run` of a URL
    nobody serves (failed), a live run on a real server when given (its device not given, as `kvtune run
    --target URL` records it), a real `kvtune search` (stage 1 only), one whose default and some trials fail,
    and a study with a stage 2, the sim target standing in for the live one."""
    db = f"sqlite:///{folder}/ui.db"
    trace = folder / "trace.jsonl"
    write_workload(workload(), str(trace))
    sim = SimTarget(model_preset(PRESET), device_preset(DEVICE))
    runs = {}
    with Store(db) as store:
        for label, config in (("sim default", EngineConfig()),
                              ("sim tight pool", EngineConfig(num_gpu_blocks_override=400, max_model_len=4096))):
            result = sim.run(config, workload())
            runs[label] = store.save_run(result, label=label)
            store.save_diagnoses(runs[label], diagnose(result))
    nobody = f"http://127.0.0.1:{free_port()}"
    assert kvtune_main("run", "--workload", trace, "--target", nobody, "--db", db) == 1
    with Store(db) as store:
        runs["url nobody serves"] = max(r.id for r in store.list_runs())
        if server_url is not None:
            live = UrlTarget(server_url, LiveOptions(users=64, scrape_interval_s=0.5, drain_timeout_s=30)).run(
                None, workload(30, 20.0, seed=2))
            runs["live engine"] = store.save_run(live, label="live engine")
            store.save_diagnoses(runs["live engine"], diagnose(live))
    search = subprocess.run(
        [sys.executable, "-m", "kvtune", "search", "--workload", str(trace), "--trials", str(SEARCH_TRIALS),
         "--target", "none", "--db", db, "--study", "s", "--no-report", "--slo", "ttft_p95=500ms"],
        check=False, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert search.returncode == 0, search.stderr + search.stdout
    assert kvtune_main("search", "--workload", trace, "--trials", TIGHT_TRIALS, "--target", "none", "--db", db,
                       "--study", TIGHT_STUDY, "--no-report", "--slo", "ttft_p95=500ms", *TIGHT_FLAGS) == 0
    staged_study(db, str(trace))
    return Seeded(db, runs, server_url)


def staged_study(db: str, trace: str) -> None:
    """What `kvtune search` does with a live target, through its own functions, the sim target playing live."""
    slos = (parse_slo("ttft_p95=500ms"),)
    objective = Objective("goodput", slos)
    space = load_space(None, ["block_size=16,32", "kv_cache_dtype=auto,fp8", "max_num_seqs=4:64:log",
                              "gpu_memory_utilization=0.85:0.95:0.05"])
    base = EngineConfig(max_model_len=4096)
    attrs = {"workload": trace, "preset": PRESET, "device": DEVICE, "slos": [str(s) for s in slos],
             "space": {k.name: "" for k in space.knobs}, "latency": "ttft_p95"}
    study = open_study(open_storage(db), "staged", objective, "tpe", 0, attrs)
    sim = SimTarget(model_preset(PRESET), device_preset(DEVICE))
    with Store(db) as store:
        Stage1(study, space, base, objective, sim.run, workload(), store, 6).optimize()
        candidates = [LiveConfig(f"trial {t.number}", t.number, dict(t.params))
                      for t in ranked_trials(study, objective)[:2]]
        dflt = default_params(space, base.resolve(model_preset(PRESET), device_preset(DEVICE)))
        run_stage2(sim.run, candidates + [LiveConfig("default", -1, dflt)], space, base, workload(), objective,
                   store, "staged")


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--executor", "sim", "--preset", PRESET, "--device", DEVICE)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def seeded(ui_database):
    return ui_database  # tests/conftest.py: seeded once for this module and test_ui_browser.py


# ---------------------------------------------------------------- helpers

# Each AppTest scans every installed distribution's metadata for Streamlit components (a second of
# CPU each; a server does it once at its start): the installed packages do not change while the
# suite runs, so one scan serves every AppTest here.
if not hasattr(manifest_scanner.scan_component_manifests, "cache_info"):
    manifest_scanner.scan_component_manifests = functools.cache(manifest_scanner.scan_component_manifests)


def open_app(db: str, monkeypatch, page: str | None = None) -> AppTest:
    monkeypatch.setenv("KVTUNE_DB", db)
    at = AppTest.from_file(APP, default_timeout=60).run()
    if page is not None:
        at.switch_page(page).run()
    return at


def check_page(at: AppTest, title: str) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert [t.value for t in at.title] == [title]
    check_readable(at)


def check_readable(at: AppTest) -> None:
    """What the page says reads like the report: no raw None or nan, no unrounded float, in its text, its
    metrics and its tables; a table's missing value drawn as the report's dash."""
    words = text(at) + "\n" + "\n".join(f"{m.label}: {m.value}" for m in at.metric)
    assert not RAW_MISSING.search(words), RAW_MISSING.search(words)
    assert not UNROUNDED.search(words), UNROUNDED.search(words)
    for table in at.dataframe:
        assert table.proto.placeholder == fmt.MISSING
        frame = table.value
        for column in frame.columns:
            cells = [repr(v) if isinstance(v, float) else str(v) for v in frame[column].dropna()]
            assert not [c for c in cells if UNROUNDED.search(c)], (column, cells)
            assert not [c for c in cells if RAW_MISSING.search(c)], (column, cells)


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def frames(at: AppTest) -> list[pd.DataFrame]:
    return [d.value for d in at.dataframe]


def frame_with(at: AppTest, *columns: str) -> pd.DataFrame:
    found = [f for f in frames(at) if set(columns) <= set(f.columns)]
    assert found, f"no table with columns {columns}: {[list(f.columns) for f in frames(at)]}"
    return found[0]


def text(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption] + [c.value for c in at.code]
    parts += [x.value for x in (*at.info, *at.success, *at.warning)] + [s.value for s in at.subheader]
    return "\n".join(str(p) for p in parts)


def charts_shown(at: AppTest) -> int:
    """The matplotlib figures on the page: charts.show sends each as an image, and the pages show no other."""
    return len(at.image)


# ---------------------------------------------------------------- Runs

def test_runs_page_shows_each_run(seeded, monkeypatch):
    at = open_app(seeded.db, monkeypatch)
    check_page(at, "Runs")
    table = frame_with(at, "run", "name", "target", "TTFT p95 (ms)")
    assert list(table["run"]) == sorted(seeded.runs.values(), reverse=True)  # search trials hidden
    box = at.selectbox(key="run")
    labels = dict(zip(table["run"], box.options))
    # A URL's runs, which record no device: named for what ran them and its URL, never "on unknown".
    assert labels[seeded.runs["live engine"]].startswith(
        f"#{seeded.runs['live engine']} live engine (running server at {seeded.server_url}, llama-3-8b, ")
    assert "http://127.0.0.1:" in labels[seeded.runs["url nobody serves"]]
    assert not [o for o in box.options if "unknown" in o]
    assert table.set_index("run").loc[seeded.runs["live engine"], "model on device"] == "llama-3-8b"

    latency = frame_with(at, "latency", "clients p95", "server p95").set_index("latency")
    for name in ("TTFT", "TPOT", "ITL", "end-to-end"):  # the live run: clients and server side by side
        assert latency.loc[name, "clients p95"].endswith(" ms")
        # a value, or a bucket's bound ("< 10 ms"), never missing
        assert latency.loc[name, "server p95"] != fmt.MISSING
    profile = frame_with(at, "per request", "p50 (tokens)", "p99 (tokens)").set_index("per request")
    assert list(profile.index) == ["prompt", "output"]
    assert charts_shown(at) == 2  # the KV cache over time, the workload's lengths
    assert [m.label for m in at.metric][:6] == ["Requests completed", "Throughput", "Output", "KV usage peak",
                                                "Prefix hit rate", "Preemptions"]
    for label, unit in (("Throughput", "req/s"), ("Output", "tok/s"), ("KV usage peak", "%"), ("Rate", "req/s"),
                        ("Span", "s")):  # each figure with its unit
        assert re.fullmatch(rf"[\d,]+(\.\d+)? {re.escape(unit)}", metric(at, label)), (label, metric(at, label))

    box.select(seeded.runs["sim tight pool"]).run()
    check_page(at, "Runs")
    latency = frame_with(at, "latency", "clients p95", "server p95").set_index("latency")
    ttft_ms = float(latency.loc["TTFT", "clients p95"].removesuffix(" ms").replace(",", ""))
    assert ttft_ms > 1000 and (latency["server p95"] == fmt.MISSING).all()
    assert "no server histograms" in text(at)
    body = text(at)
    for fault in ("**F1**", "**F6**", "**F8**"):
        assert fault in body
    assert frame_with(at, "metric", "window", "value", "threshold").shape[0] >= 1
    assert at.metric[5].value != "0"  # preemptions

    at.toggle(key="runs_trials").set_value(True).run()
    check_page(at, "Runs")
    with Store(seeded.db) as store:
        assert len(at.selectbox(key="run").options) == len(store.list_runs())  # + the studies' runs


def test_a_failed_url_run_reads_as_failed(seeded, monkeypatch):
    at = open_app(seeded.db, monkeypatch)
    at.selectbox(key="run").select(seeded.runs["url nobody serves"]).run()
    check_page(at, "Runs")
    assert "Connection refused" in at.warning[0].value  # the run's error, whole
    assert {metric(at, label) for label in ("Throughput", "Output", "KV usage peak")} == {fmt.MISSING}


def test_runs_in_progress_and_failed(monkeypatch, tmp_path):
    db = f"sqlite:///{tmp_path}/partial.db"
    with Store(db) as store:
        running = store.start_run("engine", PRESET, DEVICE, label="in progress")
        store.add_samples(running, [(100.0 + t, name, value) for t in range(5)
                                    for name, value in (("kv_usage", 0.1 * t), ("num_running", t),
                                                        ("num_waiting", 0))])
        failed = store.start_run("engine", PRESET, DEVICE, config={"gpu_memory_utilization": 0.99},
                                 label="too big")
        store.mark_run(failed, "failed", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    at = open_app(db, monkeypatch)
    check_page(at, "Runs")
    assert at.selectbox(key="run").value == failed
    assert at.warning[0].value.startswith("This run failed: torch.OutOfMemoryError")
    assert "**F5**" in text(at)  # diagnosed now from its error, not stored
    at.selectbox(key="run").select(running).run()
    check_page(at, "Runs")
    assert at.info[0].value.startswith("This run is still in progress")
    assert charts_shown(at) == 1  # its live samples over time
    at.switch_page("diagnoses.py").run()
    check_page(at, "Diagnoses")


# ---------------------------------------------------------------- Search

def test_search_page_shows_a_stage1_study(seeded, monkeypatch):
    at = open_app(seeded.db, monkeypatch, "search.py")
    check_page(at, "Search")
    assert at.selectbox(key="study").options == ["s", "staged", TIGHT_STUDY]
    studies = frame_with(at, "study", "objective", "trials")
    assert list(studies["trials"]) == [SEARCH_TRIALS, 6, TIGHT_TRIALS]

    trials = frame_with(at, "stage", "trial", "result", "block_size", "TTFT p95 (ms)")
    assert len(trials) == SEARCH_TRIALS and list(trials["trial"]) == list(range(SEARCH_TRIALS))
    assert set(trials["stage"]) == {"sim"}
    assert all(r.startswith(("✔", "✖", "⚠")) for r in trials["result"])
    meets = trials["result"].str.startswith("✔")
    assert meets.any()
    assert (trials.loc[meets, "TTFT p95 (ms)"].dropna() <= 500).all()
    assert (trials.loc[trials["result"].str.startswith("✖"), "TTFT p95 (ms)"].dropna() > 500).all()

    assert charts_shown(at) == 3  # history, Pareto front, importance
    assert "PED-ANOVA" in text(at)
    assert [s.value for s in at.subheader] == [
        "Trials", "Optimisation history", "Pareto front", "Parameter importance",
        "Best configs and their launch commands", "Stage 1 (simulator) vs stage 2 (live runs)"]
    commands = "\n".join(c.value for c in at.code)
    assert "vllm serve" in commands and "kvengine serve" in commands and "--block-size" in commands
    assert "Stage 2 did not run" in text(at)
    configs = frame_with(at, "config", "block_size", "kv_cache_dtype")
    stages = frame_with(at, "config", "stage", "goodput (req/s)", "TTFT p95 (ms)", "meets SLOs")
    assert list(configs["config"]) == list(stages["config"]) and configs["config"].iloc[-1] == "the default"
    assert set(stages["stage"]) == {"sim"} and set(stages["meets SLOs"]) <= {"yes", "no"}
    assert at.success and at.success[0].value.startswith("Verdict (on the simulator only")


def test_search_page_compares_stage1_with_stage2(seeded, monkeypatch):
    at = open_app(seeded.db, monkeypatch, "search.py")
    at.selectbox(key="study").select("staged").run()
    check_page(at, "Search")
    trials = frame_with(at, "stage", "trial", "result")
    assert list(trials["stage"]).count("live") == 9 and list(trials["stage"]).count("sim") == 6  # 3 configs x 3 runs
    stages = frame_with(at, "config", "stage", "goodput (req/s)", "meets SLOs", "runs (ok/all)")
    live = stages[stages["stage"] == "live"]
    assert len(stages) == 2 * 3 and len(live) == 3 and live["goodput (req/s)"].notna().all()
    assert set(live["meets SLOs"]) <= {"yes", "no"} and set(live["runs (ok/all)"]) == {"3/3"}
    assert live["goodput, 95 % interval (req/s)"].notna().all()
    # each live config's test against the default: the report's section-2 rows (one p for one comparison)
    header, rows = comparison_rows(load_report_data(seeded.db, "staged").verdict)
    tests = frame_with(at, *header[:-1])
    assert len(rows) == 2 and tests.values.tolist() == [row[:-1] for row in rows]
    assert all(f"{row[0]}: {row[-1]}" in text(at) for row in rows if row[-1])  # the test's words, under it
    assert header[3] == "beats the default" and "none" not in set(tests["flags changed"])  # the reference: no row
    assert "Stage 2 did not run" not in text(at)
    assert "Parameter importance needs at least 10 completed trials" in text(at)  # 6 trials: a note, no chart
    assert charts_shown(at) == 2


def test_search_page_says_why_trials_and_the_default_failed(seeded, monkeypatch):
    """A failed trial's figures are missing (the report's dash), not None, and its whole reason is on the page;
    the default that failed on the simulator reads failed, with why, not 'not run'."""
    at = open_app(seeded.db, monkeypatch, "search.py")
    at.selectbox(key="study").select(TIGHT_STUDY).run()
    check_page(at, "Search")
    trials = frame_with(at, "trial", "result", "goodput (req/s)", "TTFT p95 (ms)")
    failed = trials[trials["result"].str.startswith("⚠")]
    assert len(failed) >= 1 and failed[["goodput (req/s)", "TTFT p95 (ms)"]].isna().all().all()
    study = optuna.load_study(study_name=TIGHT_STUDY, storage=seeded.db)
    tried = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert set(failed["trial"]) == {t.number for t in tried}
    shown = " ".join(m.value for m in at.markdown).replace("`", "")
    for t in tried:  # whole, however long: not what a table cell's width leaves of it
        assert " ".join(t.user_attrs["fail_reason"].replace("`", "").split()) in shown

    assert study.user_attrs["default_params"] in [t.params for t in tried]  # the default ran, and failed
    stages = frame_with(at, "config", "stage", "goodput (req/s)", "meets SLOs").set_index("config")
    assert stages.loc["the default", "meets SLOs"] == "failed"
    assert pd.isna(stages.loc["the default", "goodput (req/s)"])


def test_pareto_front_keeps_the_undominated():
    class T:
        def __init__(self, number):
            self.number = number
    points = [(T(0), 10.0, 0.5), (T(1), 12.0, 0.6), (T(2), 9.0, 0.7), (T(3), 12.0, 0.4), (T(4), 5.0, 0.1)]
    assert pareto_front(points) == [3, 4]


# ---------------------------------------------------------------- Diagnoses

def test_diagnoses_page_cards_by_severity(seeded, monkeypatch):
    at = open_app(seeded.db, monkeypatch, "diagnoses.py")
    check_page(at, "Diagnoses")
    box = at.selectbox(key="diagnoses_run")
    assert box.value == seeded.runs["sim tight pool"]  # the run with critical findings comes first
    overview = frame_with(at, "run", "critical", "warning", "info", "stored faults").set_index("run")
    assert overview.loc[seeded.runs["sim tight pool"], "stored faults"] == "F1 F6 F8"
    assert overview.loc[seeded.runs["sim tight pool"], "critical"] == 3
    assert [s.value for s in at.subheader] == ["Critical (3)"]
    cards = [m.value for m in at.markdown if m.value.startswith(":red-badge[Critical]")]
    assert [c.split("**")[1] for c in cards] == ["F1", "F6", "F8"]
    evidence = [f for f in frames(at) if list(f.columns) == ["metric", "window", "value", "threshold"]]
    assert len(evidence) == 3 and all(len(f) >= 1 for f in evidence)
    assert "vllm:num_requests_waiting" in set(evidence[0]["metric"])
    fixes = [m.value for m in at.markdown if m.value.startswith("**Fix:**")]
    assert len(fixes) == 3 and all("→" in f for f in fixes)

    # `kvtune diagnose` ran and found nothing (the store keeps no row for that): no faults, and no hint to
    # store what is already stored.
    box.select(seeded.runs["sim default"]).run()
    check_page(at, "Diagnoses")
    assert at.success[0].value.startswith("No faults found")
    assert "kvtune diagnose --run" not in text(at)
    assert pd.isna(overview.loc[seeded.runs["sim default"], "stored faults"])


def test_a_study_run_stored_without_diagnoses_is_judged_by_its_studys_slos(seeded, tmp_path):
    """The dashboard works out the diagnoses of a run stored without any (an older database, a stage-1
    trial the report does not show) with its study's SLOs (here TTFT p95 <= 500 ms), not the rules'
    default limit (1 s); `kvtune diagnose --run` does the same, and says so."""
    from kvtune.search.slo import SLO
    from kvtune.search.study import study_slos
    from kvtune.ui import data

    db = f"sqlite:///{tmp_path}/copy.db"
    shutil.copy(seeded.db.removeprefix("sqlite:///"), db.removeprefix("sqlite:///"))
    assert study_slos(db, "s") == [SLO("ttft", 95, 0.5)]
    assert study_slos(db, "no such study") == []
    with Store(db) as store:
        tight = store.load_run(seeded.runs["sim tight pool"])
        run_id = store.save_run(tight, label="a trial of study s", study="s", trial=999)
        row = store.get_run(run_id)
    diagnoses, stored = data.run_diagnoses(db, row)
    assert not stored
    slo_limits = {e.threshold for d in diagnoses for e in d.evidence if "(SLO)" in e.threshold}
    assert slo_limits and all("> 0.5 s" in t for t in slo_limits), slo_limits

    p = subprocess.run([sys.executable, "-m", "kvtune", "diagnose", "--run", str(run_id), "--db", db,
                        "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "of study 's', judged by its SLOs (ttft_p95 <= 500 ms)" in p.stdout
    found = json.loads(p.stdout.strip().splitlines()[-1])["diagnoses"]
    limits = {e["threshold"] for d in found for e in d["evidence"] if "(SLO)" in e["threshold"]}
    assert limits and all("> 0.5 s" in t for t in limits), limits


def test_study_slos_of_a_database_without_studies_creates_nothing(tmp_path):
    from kvtune.search.study import study_slos
    db = f"sqlite:///{tmp_path}/runs.db"
    Store(db).close()
    assert study_slos(db, "s") == []
    import sqlalchemy
    assert "studies" not in sqlalchemy.inspect(sqlalchemy.create_engine(db)).get_table_names()


# ---------------------------------------------------------------- Planner

def test_planner_matches_the_capacity_plan(monkeypatch, tmp_path):
    at = open_app(f"sqlite:///{tmp_path}/none.db", monkeypatch, "planner.py")
    check_page(at, "Planner")
    expected = plan_capacity(model_preset(PRESET), device_preset(DEVICE),
                             EngineConfig(gpu_memory_utilization=0.92), [1024, 4096, 8192])
    table = frame_with(at, "", "auto (bfloat16)", "fp8").set_index("")
    assert table.loc["tokens that fit", "auto (bfloat16)"] == fmt.count(expected.primary.pool_tokens)
    assert table.loc["tokens that fit", "fp8"] == fmt.count(expected.by_dtype[1].pool_tokens)
    contiguous = [i for i in table.index if "contiguous" in i]
    assert contiguous == ["requests at once, contiguous: max_model_len (8,192) reserved each"]
    assert table.loc[contiguous[0], "auto (bfloat16)"] == fmt.count(expected.primary.contiguous_requests)
    assert charts_shown(at) == 1

    at.selectbox(key="plan_model").select("custom").run()
    at.number_input(key="plan_layers").set_value(80).run()
    at.selectbox(key="plan_kv_dtype").select("fp8").run()
    at.text_input(key="plan_contexts").input("2k, 32k").run()
    check_page(at, "Planner")
    table = frame_with(at, "", "fp8").set_index("")
    assert list(table.columns) == ["fp8"]
    assert "requests at once, paged: 32,768 tokens each" in table.index
    assert "requests at once, contiguous: max_model_len (32,768) reserved each" in table.index

    at.text_input(key="plan_contexts").input("lots").run()
    assert not at.exception and "'lots' is not a context length" in at.error[0].value

    at.text_input(key="plan_contexts").input("4096").run()
    at.selectbox(key="plan_device").select("l4-24gb").run()
    at.selectbox(key="plan_model").select("llama-3-70b").run()
    assert not at.exception and at.warning[0].value.startswith("Does not fit")


def test_parse_contexts():
    assert parse_contexts("1024, 4k 8192") == [1024, 4096, 8192]
    assert parse_contexts("") == []
    with pytest.raises(ValueError, match="'-3'"):
        parse_contexts("-3")


# ---------------------------------------------------------------- Live

def test_live_page_scrapes_a_real_server(server, monkeypatch, tmp_path):
    at = open_app(f"sqlite:///{tmp_path}/none.db", monkeypatch, "live.py")
    check_page(at, "Live")
    assert "press Start" in at.info[0].value
    at.text_input(key="live_url").input(server.url)
    at.button(key="live_start").click().run()
    check_page(at, "Live")
    assert f"Watching {server.url}/metrics: 1 scrapes." in text(at)
    assert [m.label for m in at.metric] == ["Running", "Waiting", "KV usage", "Prefix hit rate", "Preemptions"]
    assert at.metric[0].value == "0" and at.metric[2].value == "0.0 %"
    assert charts_shown(at) == 1
    assert frame_with(at, "latency", "server p95").shape[0] == 5
    assert "insufficient data" in text(at)  # one scrape: the diagnosis says it cannot judge yet

    at.button(key="live_start").click().run()  # a new watch; its first scrape
    at.button(key="live_stop").click().run()
    check_page(at, "Live")
    assert f"Stopped watching {server.url}/metrics: 1 scrapes." in text(at)


def test_live_page_reports_an_unreachable_server(monkeypatch, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    at = open_app(f"sqlite:///{tmp_path}/none.db", monkeypatch, "live.py")
    at.text_input(key="live_url").input(f"http://127.0.0.1:{port}")
    at.button(key="live_start").click().run()
    assert not at.exception and not at.error
    assert "connection refused" in at.warning[0].value
    at.text_input(key="live_url").input("localhost:8000")
    at.button(key="live_start").click().run()
    assert not at.exception and "expected a server URL" in at.error[0].value


# ---------------------------------------------------------------- empty and unreadable databases

@pytest.mark.parametrize("page", list(PAGES))
def test_empty_database_says_what_to_run(page, monkeypatch, tmp_path):
    path = tmp_path / "empty.db"
    at = open_app(f"sqlite:///{path}", monkeypatch, page)
    check_page(at, PAGES[page])
    if page in ("runs.py", "search.py", "diagnoses.py"):
        assert at.info[0].value.startswith(f"Nothing stored yet in `sqlite:///{path}`")
        commands = at.code[0].value
        assert "kvtune run --workload" in commands and "kvtune search --workload" in commands
        assert f"--db sqlite:///{path}" in commands
    assert not path.exists()  # the UI reads only: it did not create the database


def test_database_with_empty_tables(monkeypatch, tmp_path):
    db = f"sqlite:///{tmp_path}/tables.db"
    Store(db).close()
    open_storage(db)
    for page, title in PAGES.items():
        at = open_app(db, monkeypatch, page)
        check_page(at, title)


def test_unreadable_database_is_an_error_message(monkeypatch):
    at = open_app("nosuchdriver://x/y", monkeypatch)
    assert not at.exception
    assert at.title[0].value == "Runs" and at.error[0].value.startswith("Cannot read the database")


# ---------------------------------------------------------------- pieces

def test_binned_series_for_sim_and_scrapes():
    series = {"time": [0.0, 0.5, 1.0, 1.5, 2.0], "kv_usage": [0.1, 0.5, None, 0.9, 0.2],
              "num_running": [1, 2, 3, 4, 5], "num_waiting": [0, 0, 1, 0, 0],
              "num_preemptions": [0, 1, 0, 2, 0], "prefix_queries": [10, 0, 10, 10, 0],
              "prefix_hits": [5, 0, 0, 4, 0]}
    binned = charts.binned(series, max_points=2)
    assert list(binned["kv_usage"]) == [0.5, 0.9]
    assert list(binned["num_waiting"]) == [0, 1]
    assert list(binned["preemptions_total"]) == [1, 3]
    assert list(binned["hit_rate"]) == [0.5, 0.3]  # so far: 5 of 10, then 9 of 30
    assert len(charts.binned({"time": []})["time"]) == 0 and charts.timeline({"time": []}) is None


def test_ui_command_runs_streamlit_on_loopback(capsys):
    import argparse
    parser = argparse.ArgumentParser()
    add_ui_command(parser.add_subparsers())
    args = parser.parse_args(["ui", "--port", "8611", "--db", "sqlite:///x.db"])
    assert args.port == 8611 and args.db == "sqlite:///x.db"
    command = streamlit_command(8611)
    assert command[1:5] == ["-m", "streamlit", "run", APP]
    for flag, value in (("--server.address", "127.0.0.1"), ("--server.port", "8611"),
                        ("--server.headless", "true"), ("--browser.gatherUsageStats", "false")):
        assert command[command.index(flag) + 1] == value
    with pytest.raises(SystemExit):
        parser.parse_args(["ui", "--port", "70000"])
    with socket.socket() as s:  # a port in use: a clear message, no server
        s.bind(("127.0.0.1", 0))
        s.listen()
        args = parser.parse_args(["ui", "--port", str(s.getsockname()[1])])
        assert args.func(args) == 2
    assert "is in use" in capsys.readouterr().err
