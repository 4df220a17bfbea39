"""One live run: replay the workload with Locust while scraping /metrics, then join
what the clients saw and what the server said into a RunResult."""
from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass

import requests

from kvengine.config import EngineConfig

from ..loadgen import run_load
from ..results import RequestRecord, RunResult, summarize
from ..scrape import ScrapeError, ScrapeLog, Scraper
from ..workload import Workload, workload_stats, write_workload
from .base import TargetRunError
from .sim import config_dict

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


def served_model(url: str) -> str:
    try:
        resp = requests.get(url + "/v1/models", timeout=10)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except requests.ConnectionError as err:
        raise TargetRunError(f"cannot connect to {url}: is a server listening there? ({err})") from None
    except (requests.RequestException, KeyError, IndexError, ValueError) as err:
        raise TargetRunError(f"{url}/v1/models did not name a model: {err}") from None


def run_live(url: str, workload: Workload, target: str, model_label: str | None,
             config: EngineConfig | None, options: LiveOptions, check_alive=None) -> RunResult:
    model = options.model_name or served_model(url)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtune-live-") as tmp:
        path = os.path.join(tmp, "workload.jsonl")
        write_workload(workload, path)
        scraper = Scraper(url, interval_s=options.scrape_interval_s, model_name=model)
        try:
            scraper.start()
        except ScrapeError as err:
            raise TargetRunError(str(err)) from None
        run_time = math.ceil(workload.duration_s + options.drain_timeout_s)
        load = run_load(url, path, model, options.users, run_time, options.workers)
        log = scraper.stop()
    if check_alive is not None:
        check_alive()
    _check_still_serving(url)
    records = _records(load, workload)
    failed = [r for r in records if r.error]
    if len(failed) == len(records):
        raise TargetRunError(f"all {len(records)} requests failed; the first: {failed[0].error}"
                             + (f"\nload generator log:\n{load.log[-1500:]}" if load.log.strip() else ""))
    cfg = config_dict(config) if config is not None else {}
    for key, value in _config_from_server(log).items():  # what the server resolved (e.g. num_gpu_blocks)
        if cfg.get(key) is None:
            cfg[key] = value
    block_size = int(cfg.get("block_size") or 16)
    sent = [r.arrival_s for r in records if r.ttft_s is not None]
    ends = [r.arrival_s + r.e2e_s for r in records if r.e2e_s is not None]
    result = RunResult(target=target, model=model_label or model, device=options.device, config=cfg,
                       workload=workload_stats(workload, block_size=block_size), requests=records,
                       series=log.series(), duration_s=(max(ends) - min(sent)) if ends else 0.0,
                       wall_s=time.perf_counter() - t0)
    result.summary = summarize(result) | _load_figures(load) | server_figures(log)
    result.summary["disagreements"] = disagreements(result.summary, log, options.disagree_margin)
    return result


def _check_still_serving(url: str) -> None:
    try:
        requests.get(url + "/health", timeout=10).raise_for_status()
    except requests.RequestException as err:
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
            "load_shards": len({s.get("shard", 0) for s in load.samples})}


def server_figures(log: ScrapeLog) -> dict:
    """What the server's own histograms and counters said over the run."""
    out = {}
    for name in SERVER_HISTOGRAMS:
        for q in (50, 95, 99):
            out[f"server_{name}_p{q}"] = log.histogram_quantile(name, q / 100)
        out[f"server_{name}_count"] = log.histogram_count(name)
    for name in ("prompt_tokens", "generation_tokens", "preemptions", "prefix_queries", "prefix_hits"):
        out[f"server_{name}"] = log.counter_increase(name)
    queries, hits = out["server_prefix_queries"], out["server_prefix_hits"]
    out["server_prefix_hit_rate"] = hits / queries if queries else None
    out["scrape_errors"] = log.errors
    return out


def disagreements(summary: dict, log: ScrapeLog, margin: float) -> list[str]:
    """Client-side p95s that fall outside the server histogram's bucket around its own
    p95 (widened by `margin`): more than bucket resolution can explain."""
    notes = []
    for name in ("ttft", "tpot", "e2e"):
        client, server = summary.get(f"{name}_p95"), summary.get(f"server_{name}_p95")
        hist = log.histogram_window(name)
        if client is None or server is None or hist is None:
            continue
        lo, hi = bucket_around(hist.bounds, server)
        if lo * (1 - margin) <= client <= hi * (1 + margin):
            continue
        notes.append(f"{name} p95: clients saw {client * 1000:.1f} ms, the server's histogram puts it in "
                     f"({lo * 1000:g}, {hi * 1000:g}] ms; the gap is network, client or queueing time "
                     "outside the server's clock")
    return notes


def bucket_around(bounds: list[float], value: float) -> tuple[float, float]:
    """The histogram bucket (lo, hi] that holds `value`."""
    lo = 0.0
    for bound in bounds:
        if value <= bound:
            return lo, bound
        lo = bound
    return lo, math.inf


def _config_from_server(log: ScrapeLog) -> dict:
    """A server we did not start: its config as vllm:cache_config_info reports it."""
    info = next((s.info for s in reversed(log.snapshots) if s.info), {})
    out = {"block_size": int(info["block_size"]) if info.get("block_size", "None").isdigit() else None,
           "gpu_memory_utilization": _float(info.get("gpu_memory_utilization")),
           "kv_cache_dtype": info.get("cache_dtype"),
           "enable_prefix_caching": info.get("enable_prefix_caching") == "True",
           "num_gpu_blocks": int(info["num_gpu_blocks"]) if info.get("num_gpu_blocks", "None").isdigit() else None}
    return {k: v for k, v in out.items() if v is not None}


def _float(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None
