"""One /metrics exposition -> one Snapshot of canonical gauges, counters and histograms.

The mapping goes by sample name, not by family: OpenMetrics output escapes
`vllm:x_total` to `vllm_x_total` in sample lines while its TYPE lines keep the
colon, so prometheus_client's text parser files those samples under families
of type "unknown". Text-format `_created` series (extra gauge families) match
no source and drop out on their own.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .histogram import Histogram
from .names import CACHE_CONFIG_INFO, METRICS, MODEL_LABEL, Metric, normalize


@dataclass
class Snapshot:
    t: float  # time.time() of the scrape
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)  # labelled ones also as "name:label"
    histograms: dict[str, Histogram] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)  # labels of vllm:cache_config_info
    model_name: str | None = None
    sources: dict[str, str] = field(default_factory=dict)  # canonical -> exposition name used
    units: dict[str, str] = field(default_factory=dict)  # "prefix_queries": "tokens" | "blocks"

    def get(self, name: str) -> float | None:
        """A gauge or counter by canonical name; None when the server does not export it."""
        return self.gauges.get(name, self.counters.get(name))


@dataclass
class _Exposition:
    samples: dict[str, list] = field(default_factory=lambda: defaultdict(list))  # normalized name -> samples
    docs: dict[str, str] = field(default_factory=dict)  # normalized family name -> HELP


def parse_exposition(text: str, t: float | None = None, model_name: str | None = None) -> Snapshot:
    """Parse Prometheus text (or OpenMetrics) exposition; keep only `model_name`'s series if given."""
    expo = _read(text, model_name)
    snap = Snapshot(t=time.time() if t is None else t)
    for metric in METRICS:
        source = _pick_source(metric, expo)
        if source is not None:
            snap.sources[metric.canonical] = source
            _AGGREGATE[metric.kind](metric, source, expo, snap)
    _derive_prefix_counters(snap)
    _set_units(snap, expo)
    info = expo.samples.get(CACHE_CONFIG_INFO)
    if info:
        snap.info = {k: v for k, v in info[0].labels.items() if k != "engine"}
    snap.model_name = model_name or _model_names(expo, snap)
    return snap


def _read(text: str, model_name: str | None) -> _Exposition:
    expo = _Exposition()
    for family in text_string_to_metric_families(text):
        if family.documentation:
            expo.docs[normalize(family.name).removesuffix("_total")] = family.documentation
        for s in family.samples:
            if model_name is not None and s.labels.get(MODEL_LABEL, model_name) != model_name:
                continue
            expo.samples[normalize(s.name)].append(s)
    return expo


_SUFFIXES = {"gauge": ("",), "counter": ("_total", ""), "histogram": ("_bucket", "_count")}


def _exported(name: str, kind: str, expo: _Exposition) -> bool:
    return any(name + suffix in expo.samples for suffix in _SUFFIXES[kind])


def _pick_source(metric: Metric, expo: _Exposition) -> str | None:
    for source in metric.sources:
        if source.requires and not any(_exported(source.requires, k, expo) for k in _SUFFIXES):
            continue
        if _exported(source.name, metric.kind, expo):
            return source.name
    return None


def _keyed(metric: Metric, samples: list) -> dict[str | None, list[float]]:
    """Values grouped by the metric's splitting label (None when it has none); engines fall in one group."""
    groups = defaultdict(list)
    for s in samples:
        groups[s.labels.get(metric.label) if metric.label else None].append(s.value)
    return groups


def _store(metric: Metric, groups: dict, out: dict[str, float]) -> None:
    def combine(values):
        return sum(values) / len(values) if metric.mean else sum(values)

    for key, values in groups.items():
        if key is not None:
            out[f"{metric.canonical}:{key}"] = combine(values)
    out[metric.canonical] = combine([v for values in groups.values() for v in values])


def _gauge(metric: Metric, source: str, expo: _Exposition, snap: Snapshot) -> None:
    _store(metric, _keyed(metric, expo.samples[source]), snap.gauges)


def _counter(metric: Metric, source: str, expo: _Exposition, snap: Snapshot) -> None:
    samples = expo.samples.get(source + "_total") or expo.samples[source]
    _store(metric, _keyed(metric, samples), snap.counters)


def _histogram(metric: Metric, source: str, expo: _Exposition, snap: Snapshot) -> None:
    """One Histogram per series (engine, ...), then summed, as `sum by(le)` does."""
    series = defaultdict(lambda: {"buckets": {}, "sum": 0.0, "count": None})

    def ident(s):
        return tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))

    for s in expo.samples.get(source + "_bucket", ()):
        series[ident(s)]["buckets"][float(s.labels["le"])] = s.value
    for s in expo.samples.get(source + "_sum", ()):
        series[ident(s)]["sum"] = s.value
    for s in expo.samples.get(source + "_count", ()):
        series[ident(s)]["count"] = s.value
    hists = [Histogram.from_buckets(p["buckets"], p["sum"], p["count"]) for p in series.values()]
    if hists:
        total = hists[0]
        for h in hists[1:]:
            total = total + h
        snap.histograms[metric.canonical] = total


_AGGREGATE = {"gauge": _gauge, "counter": _counter, "histogram": _histogram}


def _derive_prefix_counters(snap: Snapshot) -> None:
    """SGLang has no prefix query/hit counters; rebuild them in tokens from what it does count."""
    c = snap.counters
    if "prefix_queries" in c:
        return
    cache, compute = c.get("realtime_tokens:prefill_cache"), c.get("realtime_tokens:prefill_compute")
    if cache is not None and compute is not None:
        c["prefix_hits"], c["prefix_queries"] = cache, cache + compute
        snap.sources["prefix_queries"] = snap.sources["prefix_hits"] = "sglang:realtime_tokens"
    elif snap.sources.get("prompt_tokens", "").startswith("sglang:"):
        # cached_tokens_total is only created at the first hit: until then it is 0.
        c["prefix_hits"], c["prefix_queries"] = c.get("cached_prompt_tokens", 0.0), c["prompt_tokens"]
        snap.sources["prefix_queries"] = snap.sources["prefix_hits"] = "sglang:cached_tokens"


def _set_units(snap: Snapshot, expo: _Exposition) -> None:
    source = snap.sources.get("prefix_queries")
    if source is None:
        return
    unit = "blocks" if "blocks" in expo.docs.get(source, "") else "tokens"
    snap.units["prefix_queries"] = snap.units["prefix_hits"] = unit


def _model_names(expo: _Exposition, snap: Snapshot) -> str | None:
    names = {s.labels[MODEL_LABEL] for source in snap.sources.values()
             for suffix in ("", "_total", "_count") for s in expo.samples.get(source + suffix, ())
             if MODEL_LABEL in s.labels}
    return ",".join(sorted(names)) or None


def config_from_info(info: dict) -> dict:
    """The config that vllm:cache_config_info's labels (every one a string) report."""
    out = {"block_size": _int(info.get("block_size")),
           "gpu_memory_utilization": _float(info.get("gpu_memory_utilization")),
           "kv_cache_dtype": info.get("cache_dtype"),
           "enable_prefix_caching": {"True": True, "False": False}.get(info.get("enable_prefix_caching")),
           "num_gpu_blocks": _int(info.get("num_gpu_blocks")),
           "num_gpu_blocks_override": _int(info.get("num_gpu_blocks_override")),
           "kv_cache_memory_bytes": _int(info.get("kv_cache_memory_bytes")),
           "kv_cache_size_tokens": _int(info.get("kv_cache_size_tokens"))}
    return {k: v for k, v in out.items() if v is not None}


def _int(text):
    return int(text) if isinstance(text, str) and text.isdigit() else None


def _float(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None
