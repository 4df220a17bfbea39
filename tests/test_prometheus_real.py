"""The observability stack against the real Prometheus server on loopback.

One Prometheus (tests/promserver.py: the project's prometheus.yml pointed at the test's servers,
alerts.yml as its rules, 1 s scrapes and evaluations) scrapes kvengine servers:
- the dashboard's Job and Model variables offer the server's job and model, and every PromQL query
  of every panel in dashboards/grafana/kvtune.json returns data in the panel's unit, against
  kvengine under load (against a real vLLM under load: tests/test_vllm_real.py, on that module's
  shared server, with these helpers);
- the fault-card alerts go pending or firing on a KV pool that is too small for its load, and stay
  inactive on a roomy one;
- kvtune.scrape.prometheus_api.read_range rebuilds, from Prometheus, the RunResult that a live
  scrape of the server gives.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from kvtune.targets.watch import result_from_scrape
from kvtune.scrape import ScrapeError, Scraper
from kvtune.scrape.prometheus_api import read_range
from promserver import PromServer, prometheus_binary, rules_copy, running_prometheus, wait_for
import grafana
from grafana import dashboard, panel_queries
from serverproc import ServerProcess, free_port, scrape

pytestmark = pytest.mark.slow

SIM = ("--executor", "sim", "--preset", "llama-3-8b", "--device", "h100-80gb")
ENGINE_MODEL = "llama-3-8b"  # the preset's served name
# 96 blocks of 16 tokens: a few hundred-token contexts fill it; prompts of 64 tokens get in, grow
# to 464 as they decode and preempt each other while arrivals outpace what the pool serves.
TIGHT_POOL = ("--num-gpu-blocks-override", "96", "--block-size", "16", "--max-model-len", "1024")
STEP_S = 1.0  # the test Prometheus' scrape and evaluation interval
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval at a 1 s scrape: max($__interval + 1 s, 4 × 1 s)
ACTIVE = ("pending", "firing")
# The test copy of alerts.yml holds each alert for 1 s instead of 2 to 30 minutes; the
# expressions (their [5m] and [10m] windows included) are the project's, unchanged.
TEST_FOR = "1s"

# Panels that may have no data, and why: (panel title, query refId) -> reason.
ALERT_PANELS = {
    ("Fault-card alert state", "A"): "ALERTS has series only while an alert is pending or firing",
    ("Active fault-card alerts", "A"): "ALERTS has series only while an alert is pending or firing",
}


# ----------------------------------------------------------------------------------------------
# Load: an open loop of token-id prompts over loopback, bounded in count and in time.

def prompt_ids(i: int, length: int, shared: int) -> list[int]:
    """`shared` tokens common to every request (prefix-cache hits), then tokens of request i's own."""
    return [500 + k for k in range(shared)] + [1000 + (i * 7919 + k * 131) % 28000 for k in range(length - shared)]


@dataclass
class Load:
    """Requests sent at `rate` per second, `count` at most, for `max_s` at most; `stop()` ends it early."""
    url: str
    model: str
    count: int
    rate: float
    prompt_len: int
    max_tokens: int
    shared: int = 0
    max_s: float = 60.0
    statuses: list = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.max_s + 30)

    def wait(self) -> list:
        self._thread.join(self.max_s + 30)
        assert not self._thread.is_alive(), f"the load on {self.url} did not end"
        return self.statuses

    async def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        limits = httpx.Limits(max_connections=self.count)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.max_s + 10, limits=limits) as client:
            tasks = []
            t0 = time.monotonic()
            for i in range(self.count):
                if self._stop.is_set() or time.monotonic() > deadline:
                    break
                await asyncio.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
                tasks.append(asyncio.create_task(self._one(client, i)))
            while tasks and not self._stop.is_set() and time.monotonic() < deadline:
                _, pending = await asyncio.wait(tasks, timeout=0.2)
                tasks = list(pending)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {"model": self.model, "prompt": prompt_ids(i, self.prompt_len, self.shared),
                "max_tokens": self.max_tokens, "ignore_eos": True}
        try:
            self.statuses.append((await client.post("/v1/completions", json=body)).status_code)
        except httpx.HTTPError as err:
            self.statuses.append(type(err).__name__)


def idle(url: str) -> bool:
    m = scrape(url)
    return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


def host_of(url: str) -> str:
    return url.removeprefix("http://")


def wait_for_scrape_after(prom: PromServer, instance: str, t: float, timeout_s: float = 10.0) -> float:
    """Until Prometheus holds a scrape of `instance` taken after `t`; returns its time."""
    def latest():
        result = prom.query(f'timestamp(vllm:num_requests_running{{instance="{instance}"}})')
        return max((float(r["value"][1]) for r in result if float(r["value"][1]) > t), default=None)

    return prom.wait_until(latest, timeout_s, f"a scrape of {instance} after {t:.1f}")


# ----------------------------------------------------------------------------------------------
# The dashboard's queries, as Grafana sends them.

def grafana_to_promql(expr: str, job: str, model: str, range_s: float) -> str:
    """The dashboard's query as Grafana sends it to the test Prometheus (1 s scrapes)."""
    return grafana.grafana_to_promql(expr, job, model, range_s, STEP_S, RATE_INTERVAL)


def variable_values(prom: PromServer, board: dict, name: str, job: str) -> set[str]:
    """What the dashboard's `label_values(...)` variable `name` offers, with $job at `job`."""
    var = next(v for v in board["templating"]["list"] if v["name"] == name)
    selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]).groups()
    return set(prom.api(f"label/{label}/values", **{"match[]": selector.replace("$job", job)}))


def finite_values(result: list[dict]) -> list[float]:
    points = [v for r in result for v in ([r["value"]] if "value" in r else r["values"])]
    return [float(v) for _, v in points if math.isfinite(float(v))]


def unit_problem(panel: dict, values: list[float]) -> str | None:
    """What is wrong with `values` for the panel's declared unit and bounds, or None."""
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit")
    low, high = min(values), max(values)
    if low < 0:
        return f"a negative value {low:g}: every panel here is a count, a rate, a duration or a share"
    if unit == "percentunit" and high > 1:
        return f"unit percentunit (a fraction 0-1) but a value {high:g}"
    if unit == "percent" and high > 100:
        return f"unit percent (0-100) but a value {high:g}"
    if defaults.get("max") is not None and high > defaults["max"]:
        return f"a value {high:g} above the panel's max {defaults['max']}"
    return None


def panel_problems(prom: PromServer, board: dict, job: str, model: str, start: float, end: float,
                   may_be_empty: dict) -> list[str]:
    """Every query of `board` over [start, end]: what came back empty or out of its unit."""
    problems = []
    for panel, target in panel_queries(board):
        key = (panel["title"], target["refId"])
        expr = grafana_to_promql(target["expr"], job, model, end - start)
        if target.get("instant"):
            result = prom.query(expr, at=end)  # a stat or table panel: one value at the range's end
        else:
            result = prom.query_range(expr, start, end, STEP_S)
        values = finite_values(result)  # the query ran: prom.* asserts Prometheus' status success
        if not values and key not in may_be_empty:
            problems.append(f"{key}: no data for {expr}")
        elif values and (problem := unit_problem(panel, values)):
            problems.append(f"{key}: {problem} ({expr})")
    return problems


# ----------------------------------------------------------------------------------------------
# Servers: the engines, one Prometheus.

@pytest.fixture(scope="module")
def engines():
    """`roomy`: kvengine's default pool, for light load; `replay`: the tight pool for a bounded burst."""
    prometheus_binary()  # without Prometheus every test here skips, saying why, before anything starts
    servers = {}
    try:
        servers["roomy"] = ServerProcess(*SIM)
        servers["replay"] = ServerProcess(*SIM, *TIGHT_POOL)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def prom(engines, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prometheus")
    targets = {"engine": [host_of(s.url) for s in engines.values()]}
    with running_prometheus(workdir, targets, rules_copy(workdir / "alerts.yml", for_=TEST_FOR)) as server:
        server.wait_for_scrapes(jobs=("engine",))
        yield server


# ----------------------------------------------------------------------------------------------
# 1. The dashboard against kvengine.

@pytest.fixture(scope="module")
def engine_window(prom, engines):
    """A light load with a shared system prompt on the roomy engine: (start, end) of what Prometheus saw."""
    url = engines["roomy"].url
    start = time.time()
    statuses = Load(url, ENGINE_MODEL, count=40, rate=8.0, prompt_len=320, max_tokens=48, shared=256,
                    max_s=30).start().wait()
    assert statuses == [200] * 40, statuses
    wait_for(lambda: idle(url), 10, "the roomy engine to drain")
    end = wait_for_scrape_after(prom, host_of(url), time.time()) + STEP_S
    return start - 2 * STEP_S, end


def test_every_dashboard_panel_shows_kvengine_under_load(prom, engine_window):
    start, end = engine_window
    board = dashboard()
    assert "engine" in variable_values(prom, board, "job", "engine")
    assert variable_values(prom, board, "model_name", "engine") == {ENGINE_MODEL}
    problems = panel_problems(prom, board, "engine", ENGINE_MODEL, start, end, ALERT_PANELS)
    assert not problems, "\n".join(problems)


def test_the_panel_check_fails_on_a_wrong_name_or_unit(prom, engine_window):
    """The check above can fail: vLLM's removed usage name, and a usage panel in percent shown as a
    fraction, are both caught on the same data."""
    start, end = engine_window
    board = dashboard()
    for panel, target in panel_queries(board):
        if panel["title"] == "KV Cache Usage":
            target["expr"] = target["expr"].replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
        if panel["title"] == "Prefix Cache Hit Rate":
            target["expr"] = f"100 * ({target['expr']})"
    problems = panel_problems(prom, board, "engine", ENGINE_MODEL, start, end, ALERT_PANELS)
    assert [p.split(":")[0] for p in problems] == ["('KV Cache Usage', 'A')", "('Prefix Cache Hit Rate', 'A')"], \
        problems


# ----------------------------------------------------------------------------------------------
# 2. The fault-card alerts on real runs.

def alerts_of(prom: PromServer, instance: str) -> dict[str, str]:
    return {a["labels"]["alertname"]: a["state"] for a in prom.alerts()
            if a["labels"].get("instance") == instance and a["state"] in ACTIVE}


# The pool-capacity faults a pool too small for its load shows: F1, F6, F8.
CAPACITY_ALERTS = {"KVCacheHeadOfLineBlocking", "KVPreemptionsSustained", "KVDemandOverPool"}
HOLD_S = 6.0  # how long they must stay firing while the pressure goes on


# serial: the roomy engine must answer each 1 s scrape in time, or a late /metrics reads as the server down
@pytest.mark.serial
def test_alerts_fire_on_a_tight_pool_and_stay_inactive_on_a_roomy_one(prom, engines):
    roomy = host_of(engines["roomy"].url)
    tight_server = ServerProcess(*SIM, *TIGHT_POOL)
    tight = host_of(tight_server.url)
    # 64-token prompts growing to 464 tokens in 96 blocks, arriving faster than the pool serves them.
    # F1's rule wants the queue still rising: the pressure must outlast every wait below (up to 66 s
    # on a loaded host), so its bounds are wide and `stop()` ends it when the checks are done.
    pressure = Load(tight_server.url, ENGINE_MODEL, count=1800, rate=10.0, prompt_len=64, max_tokens=400, max_s=180)
    light = Load(engines["roomy"].url, ENGINE_MODEL, count=240, rate=4.0, prompt_len=320, max_tokens=32,
                 shared=256, max_s=60)
    try:
        pressure.start()
        light.start()
        # Scraped from the moment its pool is full, so the rules' [5m] windows see only the pressure.
        wait_for(lambda: (m := scrape(tight_server.url))["vllm:kv_cache_usage_perc"] >= 0.9
                 and m["vllm:num_requests_waiting"] >= 5, 15, "the tight pool to fill")
        # The roomy engine is judged once its cache is warm: its first prompts all miss, a transient
        # that KVPrefixCacheLowHitRate's real `for: 30m` absorbs and the test's 1 s does not.
        prom.wait_until(lambda: prom.query(f'kvtune:prefix_cache_hit_rate:5m{{instance="{roomy}"}} >= 0.2'),
                        15, "the roomy engine's prefix cache to warm up")
        watched_from = time.time() + 2 * STEP_S  # a pending alert of the cold start is gone by then
        prom.set_targets(prom.targets | {"engine": [*prom.targets["engine"], tight]})
        prom.wait_until(lambda: CAPACITY_ALERTS <= {n for n, s in alerts_of(prom, tight).items() if s == "firing"},
                        30, f"{sorted(CAPACITY_ALERTS)} firing on the tight pool",
                        context=lambda: f"active there: {alerts_of(prom, tight)}")
        assert_still_firing(prom, tight, HOLD_S)
        panels = alert_panels(prom, watched_from, time.time())
        watched_to = time.time()
    finally:
        pressure.stop()
        light.stop()
        tight_server.stop()
    # Stopped, the tight engine is a vLLM-style target that went down: F5's alert.
    prom.wait_until(lambda: alerts_of(prom, tight).get("VLLMServerDown") == "firing", 15,
                    "VLLMServerDown firing for the stopped engine")
    prom.set_targets(prom.targets | {"engine": [t for t in prom.targets["engine"] if t != tight]})
    # The dashboard's alert row shows them (its label matchers fit what the rules write).
    assert CAPACITY_ALERTS <= panels["Active fault-card alerts"], panels
    assert CAPACITY_ALERTS <= panels["Fault-card alert state"], panels
    assert panels["Fault-card alerts firing"] >= len(CAPACITY_ALERTS), panels
    # The roomy engine under its light load: no alert was pending or firing at any evaluation.
    history = prom.query_range(f'ALERTS{{instance="{roomy}"}}', watched_from, watched_to, STEP_S)
    assert history == [], [r["metric"] for r in history]
    assert light.statuses and set(light.statuses) == {200}, light.statuses
    # Every rule evaluated without an error (a bad match or label shows up here, not as silence).
    broken = [(r["name"], r.get("lastError")) for g in prom.api("rules")["groups"] for r in g["rules"]
              if r["health"] != "ok"]
    assert not broken, broken


def assert_still_firing(prom: PromServer, instance: str, hold_s: float) -> None:
    """Sustained pressure, sustained alerts: the capacity alerts keep firing while it goes on."""
    until = time.monotonic() + hold_s
    while time.monotonic() < until:
        firing = {name for name, state in alerts_of(prom, instance).items() if state == "firing"}
        assert CAPACITY_ALERTS <= firing, f"{sorted(CAPACITY_ALERTS - firing)} stopped firing under the same load"
        time.sleep(STEP_S / 2)


def alert_panels(prom: PromServer, start: float, end: float) -> dict:
    """What the dashboard's alert panels show for the engine's model: alert names, or the count."""
    shown = {}
    for panel, target in panel_queries(dashboard()):
        if "ALERTS" in target["expr"]:
            expr = grafana_to_promql(target["expr"], "engine", ENGINE_MODEL, end - start)
            result = prom.query(expr, at=end)
            names = {r["metric"].get("alertname") for r in result}
            shown[panel["title"]] = float(result[0]["value"][1]) if names == {None} else names
    return shown


# ----------------------------------------------------------------------------------------------
# 3. read_range: a RunResult from Prometheus, as from a live scrape.

@pytest.fixture(scope="module")
def replay_burst(prom, engines):
    """A 40-request burst on the tight engine, scraped by kvtune itself as well: (start, end) of the
    range, /metrics before and after, and kvtune's own scrape log."""
    url = engines["replay"].url
    instance = host_of(url)
    before = scrape(url)
    live = Scraper(url, interval_s=STEP_S).start()  # kvtune's own scrape of the same run
    start = time.time()
    burst = Load(url, ENGINE_MODEL, count=40, rate=40.0, prompt_len=64, max_tokens=120, shared=48, max_s=40)
    try:
        statuses = burst.start().wait()
        wait_for(lambda: idle(url), 20, "the burst to drain")
        end = wait_for_scrape_after(prom, instance, time.time()) + STEP_S
        wait_for(lambda: time.time() >= end, 5, "the range's end")
    finally:
        live_log = live.stop()
    assert statuses == [200] * 40, statuses
    return start, end, before, scrape(url), live_log


def test_read_range_rebuilds_the_run_a_live_scrape_records(prom, engines, replay_burst):
    url = engines["replay"].url
    instance = host_of(url)
    start, end, before, after, live_log = replay_burst

    log = read_range(prom.url, f'{{instance="{instance}"}}', start, end, STEP_S)
    result, seen_live = result_from_scrape(log, url), result_from_scrape(live_log, url)

    def delta(name: str) -> float:
        return sum(v for k, v in after.items() if k.partition("{")[0] == name) - \
            sum(v for k, v in before.items() if k.partition("{")[0] == name)

    s = result.summary
    assert s["server_preemptions"] == delta("vllm:num_preemptions_total") > 0
    assert s["server_prefix_hits"] == delta("vllm:prefix_cache_hits_total") > 0
    assert s["server_prefix_queries"] == delta("vllm:prefix_cache_queries_total")
    assert sum(result.series["requests_finished"]) == delta("vllm:request_success_total") == 40
    assert s["server_e2e_count"] == delta("vllm:e2e_request_latency_seconds_count") == 40
    # Both logs start before the burst and end after it drained: every figure from the server's
    # counters and histograms (quantiles included) and the workload it saw come out the same.
    assert s == seen_live.summary
    assert s["server_ttft_p95"] is not None or s.get("server_ttft_p95_above") is not None
    assert result.workload == seen_live.workload and result.workload["requests"] == 40
    # The usage peak: the samples Prometheus holds, and what kvtune's live scrape saw within the
    # largest change the gauge made in one scrape interval.
    peak = max(result.series["kv_usage"])
    raw = prom.query(f'max_over_time(vllm:kv_cache_usage_perc{{instance="{instance}"}}[{math.ceil(end - start)}s])',
                     at=end)
    assert peak == pytest.approx(float(raw[0]["value"][1]))
    live_usage = seen_live.series["kv_usage"]
    one_step = max(abs(b - a) for a, b in zip(live_usage, live_usage[1:]))
    assert peak > 0.5 and abs(peak - max(live_usage)) <= one_step
    assert result.config == seen_live.config and result.config["num_gpu_blocks"] == 96
    assert result.model == seen_live.model == ENGINE_MODEL
    assert len(log) >= (end - start) / STEP_S - 1


def test_diagnose_reads_a_servers_history_from_prometheus(prom, engines, replay_burst):
    """`kvtune diagnose --url --prometheus`: the burst's preemptions, from Prometheus alone."""
    url = engines["replay"].url
    start, end, before, after, _ = replay_burst
    lifetime = sum(v for k, v in after.items() if k.startswith("vllm:num_preemptions_total"))
    span = math.ceil(time.time() - start) + 1  # from before the burst to now
    out = subprocess.run([sys.executable, "-m", "kvtune", "diagnose", "--url", url, "--prometheus", prom.url,
                          "--duration", str(span), "--interval", str(STEP_S), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["prometheus"] == prom.url
    # The range's edges fall between scrapes (its start is a second before the burst's), so the count
    # is the burst's within a scrape or so: more than none, no more than the server's lifetime total.
    line = next(x for x in report["overview"] if x.startswith("preemptions  "))
    seen = int(line.split()[1].rstrip(";").replace(",", ""))
    assert 0 < seen <= lifetime, (line, lifetime)
    assert {"F6", "F1"} & {d["id"] for d in report["diagnoses"]}
    assert f"over its last {span} s in Prometheus at {prom.url}" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "kvtune", "diagnose", "--url", "http://127.0.0.1:9",
                              "--prometheus", prom.url, "--duration", "30"], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "127.0.0.1:9" in missing.stderr


def test_the_live_page_reads_a_servers_history_from_prometheus(prom, engines, replay_burst, monkeypatch, tmp_path):
    from test_ui import check_page, open_app, text  # the dashboard's own test helpers

    url = engines["replay"].url
    span = max(10, math.ceil(time.time() - replay_burst[0]) + 1)  # the page asks for 10 s at least
    at = open_app(f"sqlite:///{tmp_path}/none.db", monkeypatch, "live.py")
    at.text_input(key="live_url").input(url)
    at.text_input(key="live_prometheus").input(prom.url)
    at.number_input(key="live_last").set_value(span).run()
    at.button(key="live_start").click().run()
    check_page(at, "Live")
    shown = text(at)
    assert f"Read {url} in Prometheus at {prom.url}, its last {span} s:" in shown
    assert int(at.metric[4].value.replace(",", "")) > 0  # the burst's preemptions, from Prometheus alone
    assert "F6" in shown or "F1" in shown


def test_read_range_splits_a_range_longer_than_one_query_may_return(prom, engines):
    """12,001 steps of 1 ms: more than the 11,000 points Prometheus returns per series and query."""
    instance = host_of(engines["roomy"].url)
    raw = prom.query(f'vllm:num_requests_running{{instance="{instance}"}}[1h]')
    first_sample = float(raw[0]["values"][0][0])
    prom.wait_until(lambda: time.time() > first_sample + 12.5, 15, "12 s of the roomy engine's series")
    end = time.time()
    log = read_range(prom.url, f'{{instance="{instance}", __name__="vllm:num_requests_running"}}',
                     end - 12, end, 0.001)
    times = [s.t for s in log.snapshots]
    assert len(times) == 12_001
    assert all(b - a == pytest.approx(0.001, abs=1e-6) for a, b in zip(times, times[1:]))  # no gap, no overlap
    assert all("running" in s.gauges for s in log.snapshots)


def test_read_range_says_what_went_wrong(prom, engines):
    end = time.time()
    start = end - 60
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ScrapeError, match=f"cannot reach Prometheus at {closed}"):
        read_range(closed, '{job="engine"}', start, end, STEP_S)
    with pytest.raises(ScrapeError, match=f'no vllm:.* series match {{job="nowhere"}} on Prometheus at {prom.url}'):
        read_range(prom.url, '{job="nowhere"}', start, end, STEP_S)
    with pytest.raises(ScrapeError, match=f"Prometheus at {prom.url} refused query_range"):
        read_range(prom.url, '{job=~"("}', start, end, STEP_S)
    with pytest.raises(ScrapeError, match=r'matches [2-9] servers .* add an instance="\.\.\." matcher'):
        read_range(prom.url, '{job="engine"}', start, end, STEP_S)
    with pytest.raises(ValueError, match="label matcher"):
        read_range(prom.url, 'vllm:num_requests_running{job="engine"}', start, end, STEP_S)
