"""`kvtune diagnose`: a stored run end to end (diagnoses stored back), a failed run, a live server
watched over its /metrics, and the exit codes on bad input."""
import json
import signal
import subprocess
import sys
import time

import pytest
from serverproc import ServerProcess, free_port
from test_diagnose import failed_start, healthy_run, preemption_run

from kvengine.config import EngineConfig
from kvtune.store import Store
from kvtune.workload import IntDist, SynthSpec, synthesize, write_workload
from kvtune_cli import kvtune_main


def kvtune_diagnose(*argv) -> int:
    return kvtune_main("diagnose", *argv)


def last_json(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def db(tmp_path):
    return f"sqlite:///{tmp_path / 'runs.db'}"


def test_a_stored_run_is_diagnosed_and_its_diagnoses_stored(db, capsys):
    store = Store(db)
    run_id = store.save_run(preemption_run())
    assert kvtune_diagnose("--run", str(run_id), "--db", db, "--json") == 0
    out = capsys.readouterr().out
    assert out.index("CRITICAL  F6") < out.index("INFO")
    assert "KV pool      6,400 tokens = 400 blocks of 16" in out
    assert "contiguous   reserving max_model_len (2,048)" in out
    report = json.loads(out.strip().splitlines()[-1])
    ids = [d["id"] for d in report["diagnoses"]]
    assert report["run_id"] == run_id and "F6" in ids
    f6 = next(d for d in report["diagnoses"] if d["id"] == "F6")
    assert {"metric", "window", "value", "threshold"} <= set(f6["evidence"][0])
    stored = store.load_diagnoses(run_id)
    assert [d.fault_id for d in stored] == ids
    assert stored[ids.index("F6")].fix == f6["fix"]


def test_a_healthy_run_exits_0_with_no_diagnoses(db, capsys):
    run_id = Store(db).save_run(healthy_run())
    assert kvtune_diagnose("--run", str(run_id), "--db", db, "--json") == 0
    assert last_json(capsys)["diagnoses"] == []


def test_a_failed_start_is_diagnosed_from_its_error_and_config(db, capsys):
    result, error = failed_start(EngineConfig(gpu_memory_utilization=0.15))
    store = Store(db)
    run_id = store.start_run("sim", result.model, result.device, config=result.config)
    store.mark_run(run_id, "failed", error)
    assert kvtune_diagnose("--run", str(run_id), "--db", db, "--json") == 0
    [f5] = last_json(capsys)["diagnoses"]
    assert f5["id"] == "F5" and "--gpu-memory-utilization 0.15 → " in f5["fix"]
    assert store.load_diagnoses(run_id)[0].fault_id == "F5"


def test_an_unknown_run_id_exits_2(db, capsys):
    Store(db)
    assert kvtune_diagnose("--run", "4242", "--db", db) == 2
    assert "no run 4242" in capsys.readouterr().err


def test_an_unreachable_url_exits_2(capsys):
    assert kvtune_diagnose("--url", f"http://127.0.0.1:{free_port()}", "--duration", "1") == 2
    assert "cannot watch" in capsys.readouterr().err


def test_a_bad_threshold_exits_2(db, capsys):
    run_id = Store(db).save_run(healthy_run())
    assert kvtune_diagnose("--run", str(run_id), "--db", db, "--threshold", "no_such=1") == 2
    assert "NAME=VALUE" in capsys.readouterr().err


def test_thresholds_from_the_command_line_change_the_verdict(db, capsys):
    run_id = Store(db).save_run(preemption_run())
    assert kvtune_diagnose("--run", str(run_id), "--db", db, "--json", "--threshold", "min_preemptions=100000") == 0
    assert "F6" not in [d["id"] for d in last_json(capsys)["diagnoses"]]


def test_nvml_samples_line_up_with_the_scrapes():
    from kvtune.targets.watch import gpu_series_at_scrapes
    from kvtune.gpu import GpuLog, GpuSample
    from kvtune.scrape import ScrapeLog, Snapshot

    log = ScrapeLog([Snapshot(t=100.0 + i) for i in range(4)])
    gpu = GpuLog("1 GPU", [GpuSample(0, "H100", used, 80 << 30, util, None, t)
                           for t, used, util in ((100.5, 10 << 30, 50.0), (101.5, 20 << 30, 90.0))])
    series = gpu_series_at_scrapes(gpu, log)
    assert series["gpu_utilization"] == [None, 50.0, 90.0, 90.0]  # the latest sample at or before each scrape
    assert series["gpu_memory_used"] == [None, 10 << 30, 20 << 30, 20 << 30]
    assert series["gpu_memory_total"][-1] == 80 << 30


@pytest.mark.slow
def test_a_run_and_a_watch_of_the_same_traffic_find_the_same_faults(tmp_path, capsys):
    """Issue #39: `kvtune run` said no faults while `diagnose --url` on the same server said F6, on
    a usage peak sampled at 89.7 % in one and 94.9 % in the other. Here `kvtune diagnose --url` is
    started before `kvtune run` replays a trace against the same server and stopped (Ctrl-C) after
    it; the watch's idle minutes around the traffic, its other scrape phase and its missing client
    records must not change which faults it finds. The watch is a process of its own (it gets the
    Ctrl-C); the run and the rediagnosis of the stored watch run the same command line in this one."""
    trace = tmp_path / "trace.jsonl"
    write_workload(synthesize(SynthSpec(num_requests=120, rate=20, input_len=IntDist.fixed(150),
                                        output_len=IntDist.fixed(64), seed=3)), trace)
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    server = ServerProcess("--executor", "sim", "--preset", "llama-3-8b", "--device", "h100-80gb",
                           "--num-gpu-blocks-override", "100", "--max-model-len", "1024")
    watcher = subprocess.Popen([sys.executable, "-m", "kvtune", "diagnose", "--url", server.url, "--duration", "120",
                                "--interval", "0.5", "--db", db, "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)  # the watch sees the server idle first
        code = kvtune_main("run", "--target", server.url, "--workload", trace, "--db", db,
                           "--scrape-interval", "0.25", "--json")
        run = capsys.readouterr()
        assert code == 0, run.err
        time.sleep(2)
        watcher.send_signal(signal.SIGINT)
        out, err = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
        server.stop()
    assert watcher.returncode == 0, err
    ran = set(json.loads(run.out.strip().splitlines()[-1])["faults"])
    watched = json.loads(out.strip().splitlines()[-1])
    assert "F6" in ran, run.out
    assert {d["id"] for d in watched["diagnoses"]} == ran, (run.out, out)
    # From the server's metrics alone: the pool from its vllm:cache_config_info, preemptions from its
    # counter, the share preempted from its histogram (its clients' records, all 0, are never evidence)
    assert "the server's vllm:cache_config_info" in out
    f6 = next(d for d in watched["diagnoses"] if d["id"] == "F6")
    assert next(e for e in f6["evidence"] if e["metric"] == "vllm:num_preemptions_total")["value"] >= 5
    shares = [e for e in f6["evidence"] if e["metric"].startswith("requests preempted at least once")]
    assert all(e["value"] > 0 and "vllm:request_num_preemptions" in e["metric"] for e in shares), shares
    # The arrivals need more running than a 100-block pool holds: no max_num_seqs cap (it would
    # starve them, issue #24) but more pool, through the knob that sizes it here (the override)
    assert f6["fix"].startswith("`--num-gpu-blocks-override 100 → "), f6["fix"]
    stored = Store(db).get_run(watched["run_id"])  # the watch is a run the UI lists
    assert stored.target == "watch"
    assert {d.fault_id for d in Store(db).load_diagnoses(watched["run_id"])} == ran
    assert kvtune_diagnose("--run", str(watched["run_id"]), "--db", db, "--json") == 0
    assert {d["id"] for d in last_json(capsys)["diagnoses"]} == ran
