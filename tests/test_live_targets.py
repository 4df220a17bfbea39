"""Live runs: Locust replay + /metrics scrape against real servers on 127.0.0.1."""
import http.server
import json
import subprocess
import sys
import threading

import pytest

from kvengine.config import EngineConfig, device_preset, model_preset
from kvtune.diagnose import Thresholds
from kvtune.diagnose.facts import gather
from kvtune.diagnose.render import pool_overview
from kvtune.store import Store
from kvtune.search.validity import measured_on
from kvtune.targets import (EngineTarget, LiveOptions, SglangTarget, TargetRunError, TargetStartError,
                            UrlTarget, VllmTarget)
from kvtune.workload import TraceRequest, Workload, synthesize, SynthSpec, parse_dist, write_workload
from serverproc import ServerProcess, free_port
from kvtune_cli import kvtune_main

pytestmark = pytest.mark.slow


def small_workload(n=40, rate=20.0, seed=3) -> Workload:
    return synthesize(SynthSpec(num_requests=n, rate=rate, input_len=parse_dist("100-300"),
                                output_len=parse_dist("8-24"), system_prompts=1, system_prompt_len=128,
                                seed=seed))


@pytest.mark.serial  # compares the clients' TTFT with the server's: a starved Locust client adds its own wait
def test_kvtune_run_engine_sim_end_to_end(tmp_path, capsys):
    """Client samples, the server's counters and the store agree on what was sent."""
    trace = tmp_path / "t.jsonl"
    workload = small_workload()
    write_workload(workload, str(trace))
    db = f"sqlite:///{tmp_path}/runs.db"
    code = kvtune_main("run", "--target", "engine", "--executor", "sim", "--preset", "llama-3-8b", "--device",
                       "l4-24gb", "--workload", trace, "--users", "64", "--max-num-seqs", "32", "--db", db, "--json")
    p = capsys.readouterr()
    assert code == 0, p.err + p.out
    s = json.loads(p.out.strip().splitlines()[-1])
    n = len(workload)
    assert s["completed"] == n and s["failed"] == 0
    sent_prompt = sum(r.input_length for r in workload.requests)
    sent_output = sum(r.output_length for r in workload.requests)
    assert s["server_prompt_tokens"] == sent_prompt
    assert s["server_generation_tokens"] == sent_output
    assert s["server_ttft_count"] == n and s["server_e2e_count"] == n
    assert s["prefix_hit_rate"] == pytest.approx(s["ideal_prefix_hit_rate"], abs=0.02)
    assert "server p50 p95 p99" in p.out and "ttft" in p.out
    stored = Store(db).load_run(s["run_id"])
    assert len(stored.requests) == n and sum(r.output_tokens for r in stored.requests) == sent_output
    assert stored.target == "engine" and stored.config["max_num_seqs"] == 32
    # What the UI draws while a run goes on: each scrape streamed to kvtune_samples, in the series'
    # convention (counters as increases), so the streamed increases add up to the server's totals.
    samples = Store(db).load_samples(s["run_id"])
    names = {x.name for x in samples}
    assert {"kv_usage", "num_running", "prompt_tokens", "generation_tokens"} <= names
    assert sum(x.value for x in samples if x.name == "prompt_tokens") == sent_prompt
    assert sum(x.value for x in samples if x.name == "generation_tokens") == sent_output
    # On an L4 the TTFTs are long enough that the client's own overhead hides in bucket resolution.
    assert not any(d.startswith("ttft") for d in s["disagreements"]), s["disagreements"]


@pytest.fixture(scope="module")
def url_server():
    """A sim server the URL-target tests replay against: the distributed replay's, then the one the
    dead-server test kills. `url_server()` gives it, or a new one where it has ended."""
    started: list[ServerProcess] = []

    def get() -> ServerProcess:
        if not started or started[-1].proc.poll() is not None:
            started.append(ServerProcess("--executor", "sim", "--preset", "llama-3-8b", "--device", "h100-80gb"))
        return started[-1]
    yield get
    for server in started:
        server.stop()


def test_distributed_locust_loses_and_duplicates_nothing(url_server):
    workload = small_workload(n=50, rate=40.0)
    url = url_server().url
    result = UrlTarget(url + "/", LiveOptions(users=16, workers=2, drain_timeout_s=60)).run(None, workload)
    assert result.config["server_url"] == url  # which server it measured, kept with the run
    version = result.config["server_version"]
    assert measured_on(result.target, result.device, result.config) == f"the running server at {url} (version {version})"
    ids = [r.request_id for r in result.requests]
    assert ids == [str(i) for i in range(50)]
    assert result.summary["completed"] == 50
    assert result.summary["server_e2e_count"] == 50
    assert result.config["block_size"] == 16 and result.config["num_gpu_blocks"] > 0  # from cache_config_info


def test_vllm_and_sglang_command_lines():
    cfg = EngineConfig(block_size=32, gpu_memory_utilization=0.9, max_num_seqs=128, max_num_batched_tokens=4096,
                       kv_cache_dtype="fp8", enable_prefix_caching=False, max_model_len=8192)
    vllm = VllmTarget(model="meta-llama/Meta-Llama-3-8B-Instruct", vllm_command="/opt/venv/bin/vllm")
    assert vllm.command(cfg, 8100) == [
        "/opt/venv/bin/vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct", "--host", "127.0.0.1",
        "--port", "8100", "--served-model-name", "kvtune-target", "--block-size", "32",
        "--gpu-memory-utilization", "0.9", "--kv-cache-dtype", "fp8", "--max-num-seqs", "128",
        "--max-num-batched-tokens", "4096", "--max-model-len", "8192", "--no-enable-prefix-caching"]
    sglang = SglangTarget(model="Qwen/Qwen2.5-7B-Instruct", python="/opt/sg/bin/python")
    assert sglang.command(cfg, 30000) == [
        "/opt/sg/bin/python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-7B-Instruct",
        "--host", "127.0.0.1", "--port", "30000", "--served-model-name", "kvtune-target", "--page-size", "32",
        "--mem-fraction-static", "0.9", "--kv-cache-dtype", "fp8_e4m3", "--max-running-requests", "128",
        "--chunked-prefill-size", "4096", "--context-length", "8192", "--disable-radix-cache"]
    with pytest.raises(TargetStartError, match="int8"):
        vllm.command(EngineConfig(kv_cache_dtype="int8"), 8100)


def test_a_pool_fixed_by_server_args_is_the_one_stage_1_simulates_and_utilisation_is_not_searched():
    from kvtune.search.space import SearchSpace
    engine = EngineTarget(executor="torch", extra_args="--kv-cache-memory-bytes 4MiB --max-num-batched-tokens 512")
    assert engine.command(EngineConfig(), 8000)[-4:] == ["--kv-cache-memory-bytes", "4MiB",
                                                         "--max-num-batched-tokens", "512"]
    rules = engine.rules
    assert rules.pool_knob == "--kv-cache-memory-bytes" and not rules.utilization_sizes_pool
    assert rules.sim_config(EngineConfig()).kv_cache_memory_bytes == 4 * 2**20
    space, notes = SearchSpace.default(()).for_target(rules)
    assert "gpu_memory_utilization" not in space.names
    assert [n for n in notes if "gpu_memory_utilization" in n and "--kv-cache-memory-bytes" in n], notes
    vllm = VllmTarget(model="m", vllm_command="/opt/venv/bin/vllm", extra_args="--num-gpu-blocks-override=64")
    assert vllm.rules.sim_config(EngineConfig()).num_gpu_blocks_override == 64
    assert VllmTarget(model="m", vllm_command="/opt/venv/bin/vllm").rules.sim_config(EngineConfig()) == EngineConfig()


def test_engine_that_cannot_start_is_a_failed_run(tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/runs.db"
    trace = tmp_path / "t.jsonl"
    write_workload(small_workload(n=5), str(trace))
    # llama-3-8b cannot fit an L4 at half its memory: the server exits at start-up.
    code = kvtune_main("run", "--target", "engine", "--executor", "sim", "--preset", "llama-3-8b", "--device",
                       "l4-24gb", "--gpu-memory-utilization", "0.5", "--workload", trace, "--db", db)
    err = capsys.readouterr().err
    assert code == 1 and "cannot start" in err and "do not fit" in err, err
    (run,) = Store(db).list_runs()
    assert run.status == "failed" and "do not fit" in run.error


def test_refused_url_gives_a_clear_error(tmp_path):
    with pytest.raises(TargetRunError, match=r"cannot connect to http://127.0.0.1:\d+"):
        UrlTarget(f"http://127.0.0.1:{free_port()}").run(None, small_workload(n=3))


class _Failing(http.server.BaseHTTPRequestHandler):
    """A server that names a model and then answers every completion with 500."""

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "broken"}]})
        elif self.path == "/health":
            self._send(200, {})
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send(500, {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}})

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_server_answering_500s_fails_the_run():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(TargetRunError, match="all 5 requests failed; the first: HTTP 500"):
            UrlTarget(url, LiveOptions(users=4, drain_timeout_s=20)).run(None, small_workload(n=5))
    finally:
        httpd.shutdown()


def _engine_server_pids() -> set[int]:
    """The kvengine servers this test process started (not another test worker's)."""
    import psutil
    found = set()
    for kid in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(kid.cmdline())
        except psutil.Error:  # it ended meanwhile
            continue
        if "kvengine serve --host 127.0.0.1 --port" in cmd:
            found.add(kid.pid)
    return found


def test_the_checked_server_serves_the_next_run_of_its_config_and_no_other():
    """A search checks its target with the default, then runs the default first: one start, not two.
    A run of another config stops the checked server before its own starts (two never share a device),
    and stops the server it started; the knobs left to the server are stored as it resolved them."""
    target = EngineTarget(LiveOptions(users=8, drain_timeout_s=30), executor="sim", preset="llama-3-8b",
                          device="h100-80gb")
    workload = Workload([TraceRequest(0.1 * i, 50, 4) for i in range(6)])
    snapshots: list[set] = []

    def run_watched(config):
        done = threading.Event()

        def watch():
            while not done.wait(0.05):
                snapshots.append(_engine_server_pids() - before)
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            return target.run(config, workload)
        finally:
            done.set()
            watcher.join()

    before = _engine_server_pids()
    target.check(EngineConfig())
    (checked,) = _engine_server_pids() - before
    result = run_watched(EngineConfig())
    assert result.summary["completed"] == 6
    assert set().union(*snapshots) == {checked}, "the run started a server of its own"
    assert _engine_server_pids() <= before  # and stopped the one it took
    # The knobs left to the server are stored as it resolved them (a fix never reads "current"),
    # and the pool overview can compare with a contiguous reservation at max_model_len.
    resolved = EngineConfig().resolve(model_preset("llama-3-8b"), device_preset("h100-80gb"))
    assert result.config["max_num_seqs"] == resolved.max_num_seqs
    assert result.config["max_num_batched_tokens"] == resolved.max_num_batched_tokens
    assert result.config["max_model_len"] == resolved.max_model_len == 8192
    lines = pool_overview(gather(result, Thresholds()))
    assert any(line.startswith("contiguous   reserving max_model_len (8,192)") for line in lines)

    target.check(EngineConfig())
    (checked,) = _engine_server_pids() - before
    snapshots.clear()
    assert run_watched(EngineConfig(max_num_seqs=64)).summary["completed"] == 6
    # a server of its own, stopped at the run's end
    assert len(set().union(*snapshots) - {checked}) == 1
    assert _engine_server_pids() <= before, "a kvengine server outlived its run"
    assert all(len(pids) <= 1 for pids in snapshots), "the checked server outlived the start of another"
    target.check(EngineConfig())
    target.close()  # a search that never runs its default stops the server all the same
    assert _engine_server_pids() <= before


def test_kvtune_run_engine_torch_end_to_end(tmp_path, capsys):
    """The real tiny model on the CPU behind kvengine serve: counts agree across clients, server and store."""
    trace = tmp_path / "t.jsonl"
    workload = Workload([TraceRequest(i * 0.1, 40 + 2 * i, 8, hash_ids=(1, 100 + i)) for i in range(12)],
                        hash_block_size=32)
    write_workload(workload, str(trace))
    db = f"sqlite:///{tmp_path}/runs.db"
    # block size 32 (the CPU default is 128, as vLLM's CPU build): the prompts share one 32-token block
    code = kvtune_main("run", "--target", "engine", "--executor", "torch", "--workload", trace, "--users", "16",
                       "--device-memory", "1GiB", "--max-model-len", "1024", "--block-size", "32", "--db", db,
                       "--json")
    p = capsys.readouterr()
    assert code == 0, p.err + p.out
    s = json.loads(p.out.strip().splitlines()[-1])
    assert s["completed"] == 12 and s["server_generation_tokens"] == 12 * 8
    assert s["server_prompt_tokens"] == sum(r.input_length for r in workload.requests)
    assert s["server_prefix_hits"] > 0  # the shared first hash block is served from the cache
    stored = Store(db).load_run(s["run_id"])
    assert stored.model == "tiny" and stored.device == "cpu" and len(stored.requests) == 12


@pytest.mark.slow
def test_sigterm_during_a_run_stops_the_server_kvtune_started(tmp_path):
    import os
    import signal
    import time

    import psutil
    trace = tmp_path / "t.jsonl"
    write_workload(Workload([TraceRequest(i * 0.5, 64, 400) for i in range(40)]), str(trace))  # ~20 s of load
    proc = subprocess.Popen([sys.executable, "-m", "kvtune", "run", "--target", "engine", "--executor", "sim",
                             "--preset", "llama-3-8b", "--device", "l4-24gb", "--workload", str(trace),
                             "--db", f"sqlite:///{tmp_path}/s.db"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline, servers = time.monotonic() + 60, []
    while time.monotonic() < deadline and not servers:  # the server is up once Locust runs beside it
        kids = psutil.Process(proc.pid).children(recursive=True)
        if any("locust" in " ".join(k.cmdline()) for k in kids if k.is_running()):
            servers = [k for k in kids if "kvengine" in " ".join(k.cmdline()) or "locust" in " ".join(k.cmdline())]
        time.sleep(0.2)
    assert len(servers) >= 2, "the run never started its server and load"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "stopped by signal" in err, err
    gone, alive = psutil.wait_procs(servers, timeout=20)
    assert not alive, [p.pid for p in alive]
    assert os.path.exists(tmp_path / "s.db")


def _kill_once_it_answered(find, killed: dict, timeout_s: float = 60.0) -> None:
    """SIGKILL the server `find()` gives as (url, pid) once it has finished a request more than when
    it was first seen (a shared server has answered other tests' requests)."""
    import os
    import signal
    import time

    from serverproc import scrape
    deadline, first = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        found = find()
        try:
            done = sum(v for k, v in scrape(found[0]).items() if k.startswith("vllm:request_success_total"))
        except Exception:  # not found, or not listening yet
            done = None
        first = done if first is None else first
        if done is not None and done > first:
            os.kill(found[1], signal.SIGKILL)
            killed["at"] = time.monotonic()
            return
        time.sleep(0.25)  # each scrape is a client of its own (~40 ms of CPU)


def _ended_soon_after_the_kill(run, find, options: LiveOptions, workload: Workload, match: str) -> None:
    """`run()` fails with `match` well before the replay's planned end (the last arrival: requests
    to a dead server fail at once, so Locust would end there; the drain time comes on top)."""
    import time
    killed: dict = {}
    killer = threading.Thread(target=_kill_once_it_answered, args=(find, killed), daemon=True)
    started = time.monotonic()
    killer.start()
    with pytest.raises(TargetRunError, match=match):
        run()
    ended = time.monotonic()
    killer.join()
    assert "at" in killed, "the server never answered a request"
    left_s = workload.duration_s - (killed["at"] - started)  # arrivals still to come at the kill
    assert left_s > 20 and ended - killed["at"] < left_s / 4, (ended - killed["at"], left_s)


def _slow_arrivals() -> Workload:
    return small_workload(n=30, rate=0.75)  # ~40 s of arrivals: the kill comes in the first few


def test_a_url_target_whose_server_died_fails_well_before_the_replay_ends(url_server):
    server = url_server()  # the last test to use it
    workload, options = _slow_arrivals(), LiveOptions(users=16, drain_timeout_s=10)
    _ended_soon_after_the_kill(lambda: UrlTarget(server.url, options).run(None, workload),
                               lambda: (server.url, server.proc.pid), options, workload,
                               "stopped answering during the run")


def test_a_started_server_that_died_fails_the_run_well_before_the_replay_ends():
    import psutil

    def find():
        for kid in psutil.Process().children():  # the server's leader, not its engine core
            try:
                cmd = kid.cmdline()
            except psutil.Error:  # ended meanwhile, or a zombie
                continue
            if "serve" in cmd and "kvengine" in cmd and "kvtune-target" in cmd:  # the target's, not url_server's
                return f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}", kid.pid
        return None
    workload, options = _slow_arrivals(), LiveOptions(users=16, drain_timeout_s=10)
    target = EngineTarget(options, executor="sim", preset="llama-3-8b", device="l4-24gb")
    _ended_soon_after_the_kill(lambda: target.run(EngineConfig(), workload), find, options, workload,
                               r"the server died during the run \(exit status -9\)")
