"""`kvtune search`: finds what is best by construction, resumes, shares a study, fails clearly."""
import json
import signal
import subprocess
import sys
import time

import optuna
import pytest

from kvengine.config import EngineConfig, device_preset, model_preset
from kvtune.search import Objective, Stage1, load_space, open_storage, open_study, parse_slo, ranked_trials
from kvtune.search.slo import SLOError, score
from kvtune.search.space import SpaceError
from kvtune.search.study import mark_started
from kvtune.store import Store
from kvtune.targets import SimTarget
from kvtune.workload import TraceRequest, Workload, write_workload
from kvtune_cli import kvtune, kvtune_main


def busy_workload(n=120, rate=40.0) -> Workload:
    """Long prompts at a rate an L4 cannot keep up with: KV room decides the goodput."""
    return Workload([TraceRequest(i / rate, 1500 + (i * 37) % 500, 60) for i in range(n)])


def test_a_known_best_config_is_found(tmp_path):
    """Only gpu_memory_utilization varies; on a memory-starved device more KV room is strictly better,
    so the top of the range wins. The search must find it without running the whole grid."""
    db = f"sqlite:///{tmp_path}/s.db"
    space = load_space(None, ["block_size=16", "kv_cache_dtype=auto", "max_num_seqs=256",
                              "gpu_memory_utilization=0.80:0.95:0.01"])
    objective = Objective("throughput", ())
    store = Store(db)
    study = open_study(open_storage(db), "known", objective, "tpe", 0, {"workload": "busy"})
    target = SimTarget(model_preset("llama-3-8b"), device_preset("l4-24gb"))
    Stage1(study, space, EngineConfig(max_model_len=4096), objective, target.run, busy_workload(), store, 16).optimize()
    best = ranked_trials(study, objective)[0]
    assert best.params["gpu_memory_utilization"] >= 0.93
    grid = [target.run(space.config(p, EngineConfig(max_model_len=4096)), busy_workload())
            for p in space.grid() if p["gpu_memory_utilization"] in (0.8, 0.88, 0.95)]
    throughputs = [score(r, []).throughput_rps for r in grid]
    assert throughputs == sorted(throughputs) and throughputs[0] < throughputs[-1]  # the construction holds


def refused(capsys, *argv) -> str:
    """`kvtune ARGV` run in this process (a refusal needs no interpreter of its own): exit 2, its stderr.
    kvtune's own refusal: one of argparse's (a mistyped command line, its usage naming every flag) raises."""
    assert kvtune_main(*argv) == 2
    return capsys.readouterr().err


def test_search_cli_end_to_end_and_resume_extends(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_workload(busy_workload(60, 20.0), str(trace))
    db = f"sqlite:///{tmp_path}/s.db"
    args = ["search", "--workload", str(trace), "--slo", "ttft_p95=3s", "--device", "l4-24gb",
            "--max-model-len", "4096", "--target", "none", "--db", db, "--study", "cli", "--no-report", "--json"]
    p = kvtune(*args, "--trials", "12")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["study"] == "cli" and set(out["leader"]) == {"block_size", "gpu_memory_utilization",
                                                                 "max_num_seqs", "kv_cache_dtype"}
    assert "best_params" not in out  # one answer
    # decided by the simulator, and labelled so: no live comparison, no test level
    assert out["stage"] == "sim" and out["measured_on"] == ["the simulator (l4-24gb, virtual time)"]
    assert out["comparisons"] == [] and out["alpha"] is None and out["reference"] == "the default"
    # the equivalent advice: the recommended config among them when it is `better`, none otherwise
    assert (out["recommended"] in out["equivalent"]) if out["verdict"] == "better" else out["equivalent"] == []
    p = kvtune(*args, "--trials", "16")
    assert p.returncode == 0, p.stderr
    study = optuna.load_study(study_name="cli", storage=db)
    assert len([t for t in study.trials if t.state.is_finished()]) == 16
    assert study.trials[0].params == {"block_size": 16, "gpu_memory_utilization": 0.92, "max_num_seqs": 256,
                                      "kv_cache_dtype": "auto"}  # vLLM's default goes first
    assert "created with slos" in refused(capsys, *args[:-4], "--slo", "ttft_p95=1s", "--study", "cli",
                                          "--no-report", "--trials", "20")


def test_a_closed_loop_search_keeps_its_concurrency_and_refuses_another_on_resume(tmp_path, capsys):
    """`--max-concurrency` reaches every stage-1 run (no run has more in flight), is part of the
    study (a resume with another is refused), and has no rate for the capacity objective to scale."""
    trace = tmp_path / "t.jsonl"
    write_workload(busy_workload(40, 1000.0), str(trace))
    db = f"sqlite:///{tmp_path}/s.db"
    args = ["search", "--workload", str(trace), "--slo", "ttft_p95=3s", "--device", "l4-24gb", "--max-model-len",
            "4096", "--target", "none", "--db", db, "--study", "closed", "--no-report", "--trials", "4"]
    p = kvtune(*args, "--max-concurrency", "3")
    assert p.returncode == 0, p.stderr
    store = Store(db)
    runs = [store.load_run(r.id) for r in store.list_runs()]
    assert runs and all(max(run.series["num_running"]) + max(run.series["num_waiting"]) <= 3 for run in runs)
    assert "max_concurrency 3" in refused(capsys, *args, "--max-concurrency", "8")
    err = refused(capsys, *args[:-5], "--study", "cap", "--objective", "capacity", "--max-concurrency", "3")
    assert "--max-concurrency" in err and "capacity" in err


def test_a_baseline_is_what_every_config_changes_and_what_the_verdict_compares_with(tmp_path, capsys):
    """--baseline-args: the operator's deployment is trial 0 (the default's place), the verdict names it
    "the baseline", a resume with another baseline is refused, and a flag that is no knob is refused."""
    trace = tmp_path / "t.jsonl"
    write_workload(busy_workload(40, 2.0), str(trace))
    db = f"sqlite:///{tmp_path}/s.db"
    args = ["search", "--workload", str(trace), "--slo", "ttft_p95=3s", "--device", "l4-24gb", "--max-model-len",
            "4096", "--target", "none", "--db", db, "--study", "base", "--no-report", "--trials", "4", "--json"]
    p = kvtune(*args, "--baseline-args", "--block-size 32 --max-num-seqs 64")
    assert p.returncode == 0, p.stderr
    study = optuna.load_study(study_name="base", storage=db)
    assert study.trials[0].params["block_size"] == 32 and study.trials[0].params["max_num_seqs"] == 64
    assert study.user_attrs["baseline_args"] == "--block-size 32 --max-num-seqs 64"
    assert "the baseline" in p.stdout and "\n  baseline " in p.stdout  # the verdict and the table name it
    assert "baseline_args" in refused(capsys, *args, "--baseline-args", "--block-size 16")
    err = refused(capsys, *args[:-6], "--study", "other", "--baseline-args=--enforce-eager")  # one flag: the = form
    assert "--baseline-args: --enforce-eager is not a KV-cache or scheduler flag" in err
    # a baseline whose pool is fixed in bytes: a utilisation would change nothing, so none is searched
    p = kvtune(*args[:-6], "--study", "fixed", "--trials", "3", "--baseline-args", "--kv-cache-memory-bytes 2GiB")
    assert p.returncode == 0, p.stderr
    fixed = optuna.load_study(study_name="fixed", storage=db)
    assert fixed.trials and not any("gpu_memory_utilization" in t.params for t in fixed.trials)
    assert "gpu_memory_utilization" in refused(capsys, *args[:-6], "--study", "asked", "--space",
                                               "gpu_memory_utilization=0.8:0.9:0.05",
                                               "--baseline-args", "--kv-cache-memory-bytes 2GiB")


def test_nothing_meets_the_slos_is_said_not_crashed(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_workload(busy_workload(60, 20.0), str(trace))
    p = kvtune("search", "--workload", str(trace), "--slo", "ttft_p95=1ms", "--device", "l4-24gb",
               "--max-model-len", "4096", "--trials", "6", "--target", "none",
               "--db", f"sqlite:///{tmp_path}/s.db", "--no-report", "--json")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["feasible"] is False and result["verdict"] == "infeasible" and result["recommended"] is None
    assert result["leader"] is not None and "ttft_p95" in p.stdout  # the closest config, and the SLO it misses


def _finished(db, name):
    try:
        study = optuna.load_study(study_name=name, storage=db)
    except KeyError:
        return {}
    return {t.number: t.values for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}


@pytest.mark.slow
def test_killed_search_resumes_without_losing_finished_trials(tmp_path):
    TRIALS = 14  # killed after 5 finished: some before, more after
    trace = tmp_path / "t.jsonl"
    write_workload(busy_workload(200, 40.0), str(trace))
    db = f"sqlite:///{tmp_path}/s.db"
    args = ["search", "--workload", str(trace), "--device", "l4-24gb", "--max-model-len", "4096",
            "--objective", "throughput", "--trials", str(TRIALS), "--target", "none", "--db", db, "--study", "k",
            "--heartbeat", "1", "--no-report"]
    proc = subprocess.Popen([sys.executable, "-m", "kvtune", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(_finished(db, "k")) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = _finished(db, "k")
    assert 5 <= len(before) < TRIALS
    time.sleep(3.5)  # past the heartbeat's grace period: the killed trial is stale
    p = kvtune(*args)
    assert p.returncode == 0, p.stderr
    after = _finished(db, "k")
    assert all(after[n] == v for n, v in before.items())  # nothing finished was lost or changed
    study = optuna.load_study(study_name="k", storage=db)
    finished = [t for t in study.trials if t.state.is_finished() and not t.user_attrs.get("surplus")]
    assert len(finished) >= TRIALS


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # ask() without optimize(), on purpose
def test_a_trial_killed_before_its_first_heartbeat_is_failed_on_resume(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path}/s.db", heartbeat_s=1)  # grace period 3 s
    objective = Objective("throughput", ())
    study = open_study(storage, "z", objective, "tpe", 0, {})
    orphan = study.ask()  # RUNNING, no heartbeat thread ever ran: what a kill leaves behind
    beating = study.ask()
    time.sleep(3.2)
    mark_started(beating)  # alive: another worker's trial, its objective running
    open_study(storage, "z", objective, "tpe", 0, {})
    states = {t.number: t.state for t in optuna.load_study(study_name="z", storage=storage).trials}
    assert states == {orphan.number: optuna.trial.TrialState.FAIL,
                      beating.number: optuna.trial.TrialState.RUNNING}


def test_two_processes_share_one_sqlite_study(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_workload(busy_workload(80, 20.0), str(trace))
    db = f"sqlite:///{tmp_path}/s.db"
    Store(db)  # schema first, so the two processes do not race to create it
    args = [sys.executable, "-m", "kvtune", "search", "--workload", str(trace), "--device", "l4-24gb",
            "--max-model-len", "4096", "--objective", "throughput", "--trials", "16", "--target", "none",
            "--db", db, "--study", "shared", "--no-report"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    study = optuna.load_study(study_name="shared", storage=db)
    counted = [t for t in study.trials if t.state.is_finished() and not t.user_attrs.get("surplus")]
    assert len(counted) == 16
    numbers = [t.number for t in study.trials]
    assert len(numbers) == len(set(numbers))
    runs = Store(db).list_runs(study="shared", limit=1000)
    assert len(runs) == len({r.trial_number for r in runs})  # no trial ran twice


def test_bad_slo_space_and_objective_inputs():
    with pytest.raises(SLOError, match="--slo ttft=5"):
        parse_slo("ttft=5")
    assert parse_slo("e2e_p99=10s").threshold_s == 10.0
    with pytest.raises(SpaceError, match="block_size"):
        load_space(None, ["block_size=12,16"])
    with pytest.raises(SpaceError, match="unknown knob"):
        load_space(None, ["swap_space=4"])
    with pytest.raises(ValueError, match="capacity needs at least one --slo"):
        Objective("capacity", ())


def test_space_file(tmp_path):
    f = tmp_path / "space.yaml"
    f.write_text("block_size: [16, 32]\nmax_num_seqs: {low: 32, high: 512, log: true}\n"
                 "enable_prefix_caching: [true, false]\n")
    space = load_space(str(f), [])
    assert space.names == ("block_size", "gpu_memory_utilization", "max_num_seqs", "kv_cache_dtype",
                           "enable_prefix_caching")
    f.write_text("block_size: 16\n")
    with pytest.raises(SpaceError, match="space.yaml: block_size"):
        load_space(str(f), [])


def test_capacity_objective_bisects_the_rate():
    workload = busy_workload(80, 4.0)
    target = SimTarget(model_preset("llama-3-8b"), device_preset("l4-24gb"))
    objective = Objective("capacity", (parse_slo("ttft_p95=2s"),))
    (scale,), sc, result = objective.evaluate(target.run, EngineConfig(max_model_len=4096).resolve(
        target.model, target.device), workload)
    assert 0 < scale < objective.capacity_high and sc.feasible
    faster = objective._capacity(target.run, EngineConfig(max_model_len=4096, kv_cache_dtype="fp8"), workload)
    assert faster[0][0] >= scale  # fp8 KV holds more: at least as much rate within the SLO


def test_goodput_counts_requests_meeting_every_slo():
    target = SimTarget(model_preset("llama-3-8b"), device_preset("h100-80gb"))
    result = target.run(EngineConfig(), Workload([TraceRequest(i * 0.05, 500, 20) for i in range(20)]))
    lax = score(result, [parse_slo("ttft_p95=10s")])
    strict = score(result, [parse_slo("ttft_p95=1ms")])
    assert lax.good == 20 and lax.feasible and lax.goodput_rps == pytest.approx(lax.throughput_rps)
    assert strict.good == 0 and not strict.feasible and strict.violations["ttft_p95"] > 0
