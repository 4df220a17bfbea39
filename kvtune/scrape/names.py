"""Which exposition names feed which canonical series.

One table for vLLM (current and older names), SGLang and the bundled engine's
`kvengine:` extras. Each canonical metric lists its sources in order of
preference; the first one a server exports wins, so a vLLM that exports a
deprecated name next to its replacement is not counted twice.

Sources:
- current vLLM: /work/shared/reference/vllm.md §1 (`vllm/v1/metrics/loggers.py`).
- older vLLM V1 (`vllm/v1/metrics/loggers.py` before #29330 and #32661):
  `vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_queries` / `_hits` and
  `vllm:time_per_output_token_seconds`. The last one observed
  `iteration_stats.time_per_output_tokens_iter`, one sample per decoded token, so
  it is the inter-token latency and maps to `itl` (the per-request TPOT is
  `vllm:request_time_per_output_token_seconds`). The prefix counters count
  tokens ("in terms of number of queried tokens", `queries += request.num_tokens`)
  except in the first V1 releases, whose HELP says blocks and whose
  `KVCacheManager.get_computed_blocks` did `queries += len(block_hashes)`;
  `Snapshot.units` records which one a server says it is.
- vLLM V0 (`vllm/engine/metrics.py`): `vllm:gpu_prefix_cache_hit_rate`, a gauge
  ("GPU prefix cache block hit rate"), kept as `prefix_hit_rate_gauge`.
- SGLang: `python/sglang/srt/metrics/collector.py` in sgl-project/sglang
  (SchedulerMetricsCollector, TokenizerMetricsCollector) and
  `docs/references/production_metrics.md`. Its counters are declared with
  `_total` in the name, which prometheus_client strips and re-adds, so the
  sources below are written without it. `sglang:cache_hit_rate` and
  `sglang:num_retracted_reqs` are gauges of the last logging interval, not
  counters; retractions (SGLang's preemptions) are counted by
  `sglang:num_retracted_requests_total` in newer versions only.
  `sglang:time_per_output_token_seconds` changed meaning: old SGLang observed
  it once per token (its docs example has ~7.4M observations for 11k requests:
  an inter-token latency), and versions that also export
  `sglang:inter_token_latency_seconds` observe `e2e_latency / generation_tokens`
  once per finished request (a per-request TPOT that includes the TTFT).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    name: str  # the family name as declared: no `_total`, `_bucket`, `_sum` or `_count`
    requires: str | None = None  # counts only when the server also exports this family


@dataclass(frozen=True)
class Metric:
    canonical: str
    kind: str  # "gauge" | "counter" | "histogram"
    sources: tuple[Source, ...]
    label: str | None = None  # splits the metric: keys "canonical:<label value>" plus the total
    mean: bool = False  # across engines: average (usage fractions) instead of sum


def _m(canonical: str, kind: str, *sources: str | Source, label: str | None = None,
       mean: bool = False) -> Metric:
    return Metric(canonical, kind, tuple(s if isinstance(s, Source) else Source(s) for s in sources),
                  label, mean)


SGLANG_TPOT = Source("sglang:time_per_output_token_seconds", requires="sglang:inter_token_latency_seconds")

METRICS: tuple[Metric, ...] = (
    # gauges
    _m("running", "gauge", "vllm:num_requests_running", "sglang:num_running_reqs"),
    _m("waiting", "gauge", "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    _m("waiting_by_reason", "gauge", "vllm:num_requests_waiting_by_reason", label="reason"),
    _m("kv_usage", "gauge", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
       mean=True),
    _m("prefix_hit_rate_gauge", "gauge", "sglang:cache_hit_rate", "vllm:gpu_prefix_cache_hit_rate", mean=True),
    _m("kv_used_tokens", "gauge", "sglang:num_used_tokens"),
    _m("kv_capacity_tokens", "gauge", "sglang:max_total_num_tokens"),
    _m("retracted_reqs_gauge", "gauge", "sglang:num_retracted_reqs"),
    _m("gen_throughput_gauge", "gauge", "sglang:gen_throughput"),
    _m("kvengine_num_free_blocks", "gauge", "kvengine:num_free_blocks"),
    _m("kvengine_num_gpu_blocks", "gauge", "kvengine:num_gpu_blocks"),
    _m("kvengine_num_cached_blocks", "gauge", "kvengine:num_cached_blocks"),
    _m("kvengine_kv_reserved_tokens", "gauge", "kvengine:kv_reserved_tokens"),
    # counters (exported with `_total`)
    _m("prefix_queries", "counter", "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    _m("prefix_hits", "counter", "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    _m("external_prefix_queries", "counter", "vllm:external_prefix_cache_queries"),
    _m("external_prefix_hits", "counter", "vllm:external_prefix_cache_hits"),
    _m("preemptions", "counter", "vllm:num_preemptions", "sglang:num_retracted_requests"),
    _m("prompt_tokens", "counter", "vllm:prompt_tokens", "sglang:prompt_tokens"),
    _m("prompt_tokens_by_source", "counter", "vllm:prompt_tokens_by_source", label="source"),
    _m("cached_prompt_tokens", "counter", "vllm:prompt_tokens_cached", "sglang:cached_tokens"),
    _m("generation_tokens", "counter", "vllm:generation_tokens", "sglang:generation_tokens"),
    # vLLM counts every finished request here, aborts included; SGLang's
    # num_requests_total counts finished requests without a reason label.
    _m("request_success", "counter", "vllm:request_success", "sglang:num_requests", label="finished_reason"),
    _m("requests_aborted", "counter", "sglang:num_aborted_requests"),
    _m("realtime_tokens", "counter", "sglang:realtime_tokens", label="mode"),
    _m("kvengine_evictions", "counter", "kvengine:prefix_cache_evictions"),
    # histograms
    _m("ttft", "histogram", "vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    _m("itl", "histogram", "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
       "sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    _m("tpot", "histogram", "vllm:request_time_per_output_token_seconds", SGLANG_TPOT),
    _m("e2e", "histogram", "vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds"),
    _m("queue", "histogram", "vllm:request_queue_time_seconds", "sglang:queue_time_seconds"),
    _m("prefill", "histogram", "vllm:request_prefill_time_seconds"),
    _m("decode", "histogram", "vllm:request_decode_time_seconds"),
    _m("inference", "histogram", "vllm:request_inference_time_seconds"),
    _m("prompt_len", "histogram", "vllm:request_prompt_tokens", "sglang:prompt_tokens_histogram"),
    _m("generation_len", "histogram", "vllm:request_generation_tokens", "sglang:generation_tokens_histogram"),
    _m("prefill_kv_computed", "histogram", "vllm:request_prefill_kv_computed_tokens"),
    _m("max_tokens", "histogram", "vllm:request_params_max_tokens"),
    _m("iteration_tokens", "histogram", "vllm:iteration_tokens_total"),
    _m("request_preemptions", "histogram", "vllm:request_num_preemptions", "sglang:num_retractions"),
    _m("kv_block_lifetime", "histogram", "vllm:kv_block_lifetime_seconds"),
    _m("kv_block_idle_before_evict", "histogram", "vllm:kv_block_idle_before_evict_seconds"),
    _m("kv_block_reuse_gap", "histogram", "vllm:kv_block_reuse_gap_seconds"),
)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
# OpenMetrics output escapes `:` to `_` in sample names (prometheus-client 0.26).
PREFIXES = ("vllm", "sglang", "kvengine")
MODEL_LABEL = "model_name"


def normalize(name: str) -> str:
    """`vllm_x` -> `vllm:x` for the prefixes we know, as OpenMetrics escaping wrote it."""
    for prefix in PREFIXES:
        if name.startswith(prefix + "_"):
            return f"{prefix}:{name[len(prefix) + 1:]}"
    return name
