"""One live run: replay the workload with Locust while scraping /metrics, then join
what the clients saw and what the server said into a RunResult."""
from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from kvengine.config import EngineConfig

from ..httpclient import HTTP_ERRORS, http_get
from ..loadgen import run_load
from ..results import RequestRecord, RunResult, config_dict, engine_config, summarize
from ..scrape import ScrapeError, ScrapeLog, Scraper, config_from_info
from ..workload import Workload, workload_stats, write_workload
from . import hostcpu
from .base import TargetRunError

SERVER_HISTOGRAMS = ("ttft", "tpot", "itl", "e2e", "queue")


@dataclass
class LiveOptions:
    users: int = 256  # most requests in flight from the load generator at once
    workers: int = 0  # > 0: a Locust master and this many workers on loopback
    scrape_interval_s: float = 1.0
    drain_timeout_s: float = 300.0  # after the last arrival, how long requests may take to finish
    model_name: str | None = None  # None: GET /v1/models
    device: str = "unknown"
    disagree_margin: float = 0.25  # client vs server p95 gap (relative) worth a warning
    watch_interval_s: float = 1.0  # how often the replay checks that the server is still there
    # Each scrape's samples while the run goes on (the store's kvtune_samples, for the UI's running run).
    on_samples: Callable[[list[tuple[float, str, float]]], None] | None = field(default=None, compare=False)


# What the requests library called a ConnectionError: refused, reset, no answer at all, a proxy that failed.
CONNECTION_ERRORS = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ProxyError)


def raise_for_status(resp: httpx.Response) -> httpx.Response:
    """httpx's raise_for_status, with the one-line message requests gave:
    '503 Server Error: Service Unavailable for url: http://...'."""
    if resp.status_code >= 400:
        side = "Client" if resp.status_code < 500 else "Server"
        raise httpx.HTTPStatusError(f"{resp.status_code} {side} Error: {resp.reason_phrase} for url: {resp.url}",
                                    request=resp.request, response=resp)
    return resp


def served_model(url: str) -> str:
    try:
        resp = raise_for_status(http_get(url + "/v1/models", timeout=10))
        return resp.json()["data"][0]["id"]
    except CONNECTION_ERRORS as err:
        raise TargetRunError(f"cannot connect to {url}: is a server listening there? ({err})") from None
    except (*HTTP_ERRORS, KeyError, IndexError, ValueError) as err:
        raise TargetRunError(f"{url}/v1/models did not name a model: {err}") from None


def served_max_model_len(url: str) -> int | None:
    """The context limit GET /v1/models gives for the served model (vLLM and kvengine do)."""
    try:
        value = http_get(url + "/v1/models", timeout=5).json()["data"][0].get("max_model_len")
        return int(value) if value else None
    except (*HTTP_ERRORS, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def server_version(url: str) -> str | None:
    """What GET /version says (vLLM and kvengine: {"version": "0.32.0"}); None where it says nothing."""
    try:
        resp = http_get(url + "/version", timeout=5)
        return str(resp.json()["version"]) if resp.status_code < 400 else None
    except (*HTTP_ERRORS, ValueError, KeyError, TypeError):
        return None


def run_live(url: str, workload: Workload, target: str, model_label: str | None,
             config: EngineConfig | None, options: LiveOptions, check_alive=None,
             server_pid: int | None = None) -> RunResult:
    model = options.model_name or served_model(url)
    version = server_version(url)
    t0, cpu0 = time.perf_counter(), hostcpu.read(server_pid)
    with tempfile.TemporaryDirectory(prefix="kvtune-live-") as tmp:
        path = os.path.join(tmp, "workload.jsonl")
        write_workload(workload, path)
        scraper = Scraper(url, interval_s=options.scrape_interval_s, model_name=model,
                          on_samples=options.on_samples)
        try:
            scraper.start()
        except ScrapeError as err:
            raise TargetRunError(str(err)) from None
        run_time = math.ceil(workload.duration_s + options.drain_timeout_s * _waves(workload))
        try:
            load = run_load(url, path, model, options.users, run_time, options.workers,
                            watch=server_watch(url, check_alive), watch_interval_s=options.watch_interval_s,
                            max_concurrency=workload.max_concurrency)
        except BaseException:  # the server died, or a signal: no last scrape of a server that is gone
            scraper.stop(final_scrape=False)
            raise
        log = scraper.stop()
    host_busy, host_others = hostcpu.host_shares(cpu0, hostcpu.read(server_pid))
    if check_alive is not None:
        check_alive()
    _check_still_serving(url)
    records = _records(load, workload)
    failed = [r for r in records if r.error]
    if len(failed) == len(records):
        raise TargetRunError(f"all {len(records)} requests failed; the first: {failed[0].error}"
                             + (f"\nload generator log:\n{load.log[-1500:]}" if load.log.strip() else ""))
    asked = config_dict(config) if config is not None else {}
    cfg, overruled = server_config(asked, config_from_cache_info(log))
    if version:
        cfg["server_version"] = version
    if cfg.get("max_model_len") is None:
        cfg["max_model_len"] = served_max_model_len(url)  # the server's own default, as it reports it
    block_size = engine_config(cfg).block_size
    sent = [r.arrival_s for r in records if r.ttft_s is not None]
    ends = [r.arrival_s + r.e2e_s for r in records if r.e2e_s is not None]
    result = RunResult(target=target, model=model_label or model, device=options.device, config=cfg,
                       workload=workload_stats(workload, block_size=block_size), requests=records,
                       series=log.series(), duration_s=(max(ends) - min(sent)) if ends else 0.0,
                       wall_s=time.perf_counter() - t0)
    result.summary = summarize(result) | _load_figures(load) | server_figures(log)
    result.summary["disagreements"] = disagreements(result.summary, log, options.disagree_margin)
    result.summary["config_overruled"] = overruled
    result.summary["host_cpu_busy"] = host_busy
    result.summary["host_cpu_others"] = host_others  # None: the server's share is not known (url target)
    return result


def _waves(workload: Workload) -> int:
    """How many rounds a closed loop sends at most (each may take up to the drain timeout); 1 open."""
    n = workload.max_concurrency
    return math.ceil(len(workload) / n) if n else 1


# What the server reports of itself wins over what was asked of it: a run is labelled
# with the config that was measured.
SERVER_REPORTED = ("block_size", "kv_cache_dtype", "enable_prefix_caching", "num_gpu_blocks",
                   "kv_cache_memory_bytes", "kv_cache_size_tokens")


def server_config(asked: dict, reported: dict) -> tuple[dict, list[str]]:
    """The run's config (the asked one, with what the server says it uses on top) and a
    line for every asked value the server did not use."""
    cfg, overruled = dict(asked), []
    for key in SERVER_REPORTED:
        value = reported.get(key)
        if value is None:
            continue
        if asked.get(key) is not None and asked[key] != value and not _same_dtype(key, asked[key], value):
            overruled.append(f"asked {key} {asked[key]}, the server uses {value}")
        cfg[key] = value
    if cfg.get("gpu_memory_utilization") is None and reported.get("gpu_memory_utilization") is not None:
        cfg["gpu_memory_utilization"] = reported["gpu_memory_utilization"]
    return cfg, overruled


def _same_dtype(key: str, asked, used) -> bool:
    """fp8 is fp8_e4m3 on vLLM; auto may be reported as the model's dtype."""
    return key == "kv_cache_dtype" and (asked == "auto" or {asked, used} <= {"fp8", "fp8_e4m3"})


REFUSALS_DEAD = 3  # connections refused in a row (one a watch interval): the server is gone


def server_watch(url: str, check_alive=None, refusals_dead: int = REFUSALS_DEAD):
    """A check for the replay to call while it runs: raises TargetRunError once `check_alive`
    says the started server exited, or `url` refused `refusals_dead` connections in a row.
    A slow answer is no refusal (a loaded server may take its time on /health)."""
    refused = 0

    def watch() -> None:
        nonlocal refused
        if check_alive is not None:
            check_alive()
        try:
            http_get(url + "/health", timeout=httpx.Timeout(5, connect=2))
            refused = 0
        except httpx.TimeoutException:
            pass
        except CONNECTION_ERRORS:
            refused += 1
            if refused >= refusals_dead:
                raise TargetRunError(f"the server at {url} stopped answering during the run: "
                                     f"{refused} connections to it in a row were refused") from None
        except HTTP_ERRORS:
            refused = 0
    return watch


def _check_still_serving(url: str) -> None:
    try:
        raise_for_status(http_get(url + "/health", timeout=10))
    except HTTP_ERRORS as err:
        raise TargetRunError(f"the server at {url} stopped answering during the run ({err})") from None


def _records(load, workload: Workload) -> list[RequestRecord]:
    """Client samples, plus a failed record for every request the generator never finished."""
    records = {r.request_id: r for r in load.records}
    for i, req in enumerate(workload.requests):
        records.setdefault(str(i), RequestRecord(str(i), req.arrival_s, req.input_length,
                                                 finish_reason="error",
                                                 error="not completed before the run ended"))
    return [records[str(i)] for i in range(len(workload.requests))]


def _load_figures(load) -> dict:
    return {"max_lateness_s": load.max_lateness_s, "load_kept_up": load.kept_up,
            "load_cpu_warning": "CPU usage above" in load.log,
            "load_shards": len({s.get("shard", 0) for s in load.samples})}


def server_figures(log: ScrapeLog) -> dict:
    """What the server's own histograms and counters said over the run.

    A quantile whose rank falls in a histogram's first bucket (0, b] or in its +Inf bucket is no
    measurement (Prometheus would interpolate from 0, or return the last bound): its value is None
    and `server_<name>_p<q>_below` = b ("< b") or `server_<name>_p<q>_above` = the last bound ("> it")
    says what the buckets do tell. `quantile_text` in kvtune.report.fmt prints either.
    """
    out = {}
    for name in SERVER_HISTOGRAMS:
        for q in (50, 95, 99):
            key = f"server_{name}_p{q}"
            quantile = log.histogram_quantile_bound(name, q / 100)
            out[key] = quantile.value
            if quantile.below is not None:
                out[key + "_below"] = quantile.below
            if quantile.above is not None:
                out[key + "_above"] = quantile.above
        out[f"server_{name}_count"] = log.histogram_count(name)
    for name in ("prompt_tokens", "generation_tokens", "preemptions", "prefix_queries", "prefix_hits"):
        out[f"server_{name}"] = log.counter_increase(name)
    queries, hits = out["server_prefix_queries"], out["server_prefix_hits"]
    out["server_prefix_hit_rate"] = hits / queries if queries else None
    out["server_cached_prompt_tokens"] = cached_prompt_tokens(log)
    out |= preemption_figures(log)
    out["scrape_errors"] = log.errors
    return out


def cached_prompt_tokens(log: ScrapeLog) -> float | None:
    """Prompt tokens the server did not compute: vllm:prompt_tokens_by_source's local_cache_hit plus
    external_kv_transfer, else vllm:prompt_tokens_cached (the same sum) or SGLang's cached_tokens.
    Clients see cached tokens only when vLLM runs with --enable-prompt-tokens-details."""
    local = log.counter_increase("prompt_tokens_by_source:local_cache_hit")
    if local is not None:
        return local + (log.counter_increase("prompt_tokens_by_source:external_kv_transfer") or 0.0)
    return log.counter_increase("cached_prompt_tokens")


def preemption_figures(log: ScrapeLog) -> dict:
    """From vllm:request_num_preemptions (one observation per finished request): how many requests
    were preempted at least once, and the preemptions per request. Clients cannot see preemptions.

    `server_requests_preempted` is the fewest the buckets allow and `server_requests_preempted_max`
    the most; they are equal (exact) unless requests were preempted more than 5 times (see
    Histogram.nonzero). All None when the server has no such histogram.
    """
    hist = log.histogram_window("request_preemptions")
    nonzero = hist.nonzero() if hist is not None else None
    if hist is None or nonzero is None:
        return {key: None for key in ("server_request_preemptions_count", "server_requests_preempted",
                                      "server_requests_preempted_max", "server_preempted_share",
                                      "server_preemptions_per_request")}
    finished = hist.counts[-1]
    fewest, most = nonzero
    return {"server_request_preemptions_count": finished,
            "server_requests_preempted": fewest,
            "server_requests_preempted_max": most,
            "server_preempted_share": fewest / finished if finished else None,
            "server_preemptions_per_request": hist.mean()}


_GAP_CAUSE = {
    "ttft": "network, client or queueing time outside the server's clock",
    "tpot": "network, client or queueing time outside the server's clock",
    "e2e": "network, client or queueing time outside the server's clock",
    "itl": "in the streaming: the server times each token as the engine makes it, the clients as the "
           "chunks arrive (the server merges several tokens into one chunk under load, or the clients "
           "fall behind)",
}


# What a client may add on top of the server's clock before a gap counts: the HTTP round trip and
# the load generator's own parsing, which on a busy 2-core host reach tens of milliseconds at p95
# for a request (TTFT, e2e) and a few per chunk (TPOT, ITL). A relative margin alone flagged a
# 27 ms TTFT gap at a 60-80 ms bucket as a disagreement.
CLIENT_SLACK_S = {"ttft": 0.05, "e2e": 0.05, "tpot": 0.005, "itl": 0.005}


def disagreements(summary: dict, log: ScrapeLog, margin: float) -> list[str]:
    """Client-side p95s that fall outside the server histogram's bucket around its own
    p95 (widened by `margin`, and above by what a client adds, CLIENT_SLACK_S): more than
    bucket resolution and client time can explain."""
    notes = []
    for name in ("ttft", "tpot", "itl", "e2e"):
        client, hist = summary.get(f"{name}_p95"), log.histogram_window(name)
        if client is None or hist is None:
            continue
        server = hist.quantile_bound(0.95)
        if server.value is not None:
            lo, hi = bucket_around(hist.bounds, server.value)
        elif server.below is not None:
            lo, hi = 0.0, server.below
        elif server.above is not None:
            lo, hi = server.above, math.inf
        else:
            continue
        if lo * (1 - margin) <= client <= hi * (1 + margin) + CLIENT_SLACK_S[name]:
            continue
        notes.append(f"{name} p95: clients saw {client * 1000:.1f} ms, the server's histogram puts it in "
                     f"({lo * 1000:g}, {hi * 1000:g}] ms; the gap is {_GAP_CAUSE[name]}")
    return notes


def bucket_around(bounds: list[float], value: float) -> tuple[float, float]:
    """The histogram bucket (lo, hi] that holds `value`."""
    lo = 0.0
    for bound in bounds:
        if value <= bound:
            return lo, bound
        lo = bound
    return lo, math.inf


def config_from_cache_info(log: ScrapeLog) -> dict:
    """The server's config as its latest vllm:cache_config_info reports it."""
    return config_from_info(next((s.info for s in reversed(log.snapshots) if s.info), {}))
