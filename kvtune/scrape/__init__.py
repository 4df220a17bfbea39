"""Scrape a vLLM-style server's /metrics during a run and read it back as canonical series.

- `parse_exposition(text)` -> `Snapshot`: vLLM's current and older names, SGLang's
  and the bundled engine's `kvengine:` extras, mapped onto one set of names
  (see `names.py`).
- `Scraper(url).start()` ... `.stop()` -> `ScrapeLog`: series in the RunResult
  convention, counter increases and rates through resets, windowed histogram
  quantiles with Prometheus' interpolation.
"""
from .histogram import Histogram, Quantile, bounded_quantile, bucket_quantile
from .log import GaugeStats, ScrapeLog
from .names import METRICS, Metric, Source
from .parse import Snapshot, config_from_info, parse_exposition
from .scraper import ScrapeError, Scraper, fetch, metrics_url, reported_config

__all__ = [
    "METRICS", "GaugeStats", "Histogram", "Metric", "Quantile", "ScrapeError", "ScrapeLog", "Scraper",
    "Snapshot", "Source", "bounded_quantile", "bucket_quantile", "config_from_info", "fetch", "metrics_url",
    "parse_exposition", "reported_config",
]
