"""The observe-only target: watch a running vLLM-compatible server (scrape /metrics for a while,
or read its history back from Prometheus), then read it as a RunResult.

No clients of ours, so no client latencies: the rules work from the server's
series, its histograms (TTFT, prompt and output lengths) and its
vllm:cache_config_info (block size, utilisation, num_gpu_blocks). A server on
this machine also gets NVML samples (utilisation, memory) where a GPU exists.
"""
from __future__ import annotations

import time
import urllib.parse

import numpy as np

from ..gpu import GpuLog, GpuSampler
from ..httpclient import is_loopback
from ..results import RunResult
from ..scrape import ScrapeError, ScrapeLog, Scraper
from ..scrape.prometheus_api import read_range
from .live import config_from_cache_info, served_max_model_len, server_figures

GPU_SERIES = ("gpu_utilization", "gpu_memory_used", "gpu_memory_total")


class WatchError(RuntimeError):
    """The server cannot be watched (unreachable, not a metrics endpoint)."""


def watch(url: str, duration_s: float, interval_s: float = 1.0) -> RunResult:
    """Scrape `url` every `interval_s` for `duration_s` (Ctrl-C ends it early) and return what it said."""
    scraper = Scraper(url, interval_s=interval_s)
    try:
        scraper.scrape_once()
    except ScrapeError as err:
        raise WatchError(f"cannot watch {url}: {err}") from None
    gpu = GpuSampler(interval_s).start() if is_loopback(url) else None
    scraper.start()
    try:
        time.sleep(duration_s)
    except KeyboardInterrupt:
        pass  # diagnose what was seen so far
    log = scraper.stop()
    result = result_from_scrape(log, url)
    limit = served_max_model_len(url)
    if limit:
        result.config["max_model_len"] = limit
    if gpu is not None:
        result.series |= gpu_series_at_scrapes(gpu.stop(), log)
    return result


def history(prometheus_url: str, url: str, duration_s: float, step_s: float, selector: str | None = None,
            end: float | None = None) -> ScrapeLog:
    """The server's last `duration_s` as a Prometheus server recorded it, as the scrapes a watch would
    have made; `selector` picks the server's series there (default: its instance, host:port of `url`)."""
    end = time.time() if end is None else end
    selector = selector or f'{{instance="{urllib.parse.urlsplit(url).netloc}"}}'
    try:
        return read_range(prometheus_url, selector, end - duration_s, end, step_s)
    except ScrapeError as err:
        raise WatchError(str(err)) from None


def gpu_series_at_scrapes(gpu: GpuLog, log: ScrapeLog) -> dict[str, list]:
    """NVML samples lined up with the scrapes: at each scrape, the latest GPU sample before it."""
    if not gpu.samples or not log.snapshots:
        return {}
    samples = gpu.series(start=log.start)
    scrapes = np.array([s.t - log.start for s in log.snapshots])
    index = np.searchsorted(np.array(samples["time"]), scrapes, side="right") - 1
    return {name: [samples[name][i] if i >= 0 else None for i in index] for name in GPU_SERIES}


def result_from_scrape(log: ScrapeLog, url: str) -> RunResult:
    series = log.series()
    snapshot = log.snapshots[-1] if log.snapshots else None
    model = (snapshot.model_name if snapshot else None) or url
    span = series["time"][-1] if series["time"] else 0.0
    result = RunResult(target="watch", model=model, device="unknown",
                       config=config_from_cache_info(log),
                       workload=profile_from_histograms(log, url), requests=[], series=series, duration_s=span)
    result.summary = server_figures(log)
    return result


def profile_from_histograms(log: ScrapeLog, url: str) -> dict:
    """A workload profile from what the server observed: prompt and output lengths per finished request."""
    profile: dict = {"source": f"server histograms at {url}", "requests": int(log.histogram_count("e2e") or 0)}
    for key, name in (("input_len", "prompt_len"), ("output_len", "generation_len")):
        quantiles = {f"p{q}": log.histogram_quantile(name, q / 100) for q in (50, 95, 99)}
        if quantiles["p99"] is not None:
            profile[key] = quantiles | {"mean": log.histogram_mean(name)}
    return profile
