"""kvtune.scrape: real expositions (current and older vLLM, SGLang, OpenMetrics) parsed by
prometheus_client, counter resets, windowed quantiles, and a Scraper against a live kvengine."""
import http.server
import math
import threading

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client import Histogram as PromHistogram
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from serverproc import ServerProcess, free_port

from kvtune.scrape import Histogram, ScrapeError, ScrapeLog, Scraper, bucket_quantile, parse_exposition

TTFT_BUCKETS = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0",
                "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0")
ITL_BUCKETS = ("0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0",
               "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0")


def histogram_lines(name, labels, buckets, cumulative, total, inf=None):
    """Text-format histogram samples: one `_bucket` per bound, then +Inf, `_count`, `_sum`."""
    inf = cumulative[-1] if inf is None else inf
    lines = [f"# HELP {name} Histogram.", f"# TYPE {name} histogram"]
    for le, n in zip(buckets, cumulative):
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {n}')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {inf}')
    lines.append(f"{name}_count{{{labels}}} {inf}")
    lines.append(f"{name}_sum{{{labels}}} {total}")
    return "\n".join(lines) + "\n"


# vLLM V1 main (reference/vllm.md §1): counters with _total and _created, finished_reason,
# waiting_by_reason, cache_config_info, histograms with vLLM's buckets.
L = 'engine="0",model_name="meta-llama/Llama-3.1-8B"'
CURRENT_VLLM = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{L}}} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{L}}} 3.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{{{L},reason="capacity"}} 2.0
vllm:num_requests_waiting_by_reason{{{L},reason="deferred"}} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{L}}} 0.42
# HELP vllm:engine_sleep_state Engine sleep state
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{{{L},sleep_state="awake"}} 1.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="27306",num_cpu_blocks="None",prefix_caching_hash_algo="sha256"}} 1.0
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{{L}}} 12800.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{{{L}}} 1.7479e+09
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{{L}}} 4800.0
# HELP vllm:num_preemptions Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{{L}}} 2.0
# HELP vllm:prompt_tokens Number of prefill tokens processed.
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{{L}}} 12800.0
# HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{{{L},source="local_compute"}} 8000.0
vllm:prompt_tokens_by_source_total{{{L},source="local_cache_hit"}} 4800.0
vllm:prompt_tokens_by_source_total{{{L},source="external_kv_transfer"}} 0.0
# HELP vllm:generation_tokens Number of generation tokens processed.
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{{L}}} 2500.0
# HELP vllm:request_success Count of successfully processed requests.
# TYPE vllm:request_success counter
vllm:request_success_total{{{L},finished_reason="stop"}} 40.0
vllm:request_success_total{{{L},finished_reason="length"}} 9.0
vllm:request_success_total{{{L},finished_reason="abort"}} 1.0
vllm:request_success_total{{{L},finished_reason="error"}} 0.0
vllm:request_success_total{{{L},finished_reason="repetition"}} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{{{L},finished_reason="stop"}} 1.7479e+09
""" + histogram_lines("vllm:time_to_first_token_seconds", L, TTFT_BUCKETS,
                      [0, 0, 0, 0, 5, 10, 20, 30, 40, 45, 48, 50, 50, 50, 50, 50, 50, 50, 50, 50, 50, 50], 12.5) \
    + histogram_lines("vllm:inter_token_latency_seconds", L, ITL_BUCKETS,
                      [100, 2000, 2400, 2450] + [2450] * 15, 60.0) \
    + histogram_lines("vllm:request_time_per_output_token_seconds", L, ITL_BUCKETS, [0, 45] + [50] * 17, 1.2) \
    + histogram_lines("vllm:iteration_tokens_total", L, ("1", "8", "16", "32"), [10, 200, 300, 310], 9000) \
    + histogram_lines("vllm:e2e_request_latency_seconds", L, ("0.3", "0.5", "0.8", "1.0"), [5, 20, 45, 50], 30)

# vLLM V1 before the renames (0.8-0.10): gpu_* names, time_per_output_token_seconds as ITL.
O = 'engine="0",model_name="m"'
OLD_VLLM = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{O}}} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{O}}} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{{O}}} 0.8
# HELP vllm:gpu_prefix_cache_queries GPU prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{{{O}}} 1000.0
# HELP vllm:gpu_prefix_cache_hits GPU prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{{{O}}} 250.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{O}}} 6.0
""" + histogram_lines("vllm:time_per_output_token_seconds", O, ITL_BUCKETS, [10, 90] + [100] * 17, 2.0)

# SGLang (python/sglang/srt/metrics/collector.py, docs/references/production_metrics.md).
S = 'engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"'
SGLANG_COMMON = f"""# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{S}}} 162.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{S}}} 2826.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{{S}}} 0.28
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{{S}}} 0.0075
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{{{S}}} 123859.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{model_name="qwen"}} 8.128902e+06
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{model_name="qwen"}} 7.557572e+06
# HELP sglang:num_requests_total Number of requests processed.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{{model_name="qwen"}} 11008.0
""" + histogram_lines("sglang:time_to_first_token_seconds", 'model_name="qwen"', ("0.1", "0.2", "0.4"),
                      [2, 6, 8], 2.0) \
    + histogram_lines("sglang:e2e_request_latency_seconds", 'model_name="qwen"', ("1", "2"), [3, 7], 9.0)
# Newer SGLang: retraction counter, cached tokens, ITL next to a per-request TPOT.
SGLANG_NEW = SGLANG_COMMON + f"""# HELP sglang:num_retracted_reqs The number of retracted requests.
# TYPE sglang:num_retracted_reqs gauge
sglang:num_retracted_reqs{{{S}}} 3.0
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{{{S}}} 17.0
# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{{model_name="qwen"}} 2.0e+06
""" + histogram_lines("sglang:inter_token_latency_seconds", 'model_name="qwen"', ("0.01", "0.02"), [50, 90], 1.2) \
    + histogram_lines("sglang:time_per_output_token_seconds", 'model_name="qwen"', ("0.01", "0.02"), [1, 7], 0.1) \
    + histogram_lines("sglang:queue_time_seconds", S, ("0.0", "0.1", "0.2"), [5, 8, 10], 0.6)
# Older SGLang: time_per_output_token_seconds was observed once per token.
SGLANG_OLD = SGLANG_COMMON + histogram_lines(
    "sglang:time_per_output_token_seconds", 'model_name="qwen"', ("0.01", "0.02"), [1000, 7000], 90.0)


def test_current_vllm_names_labels_and_info():
    s = parse_exposition(CURRENT_VLLM, t=100.0)
    assert s.t == 100.0 and s.model_name == "meta-llama/Llama-3.1-8B"
    assert s.gauges["running"] == 7 and s.gauges["waiting"] == 3 and s.gauges["kv_usage"] == 0.42
    assert s.gauges["waiting_by_reason:capacity"] == 2 and s.gauges["waiting_by_reason:deferred"] == 1
    assert s.counters["prefix_queries"] == 12800 and s.counters["prefix_hits"] == 4800
    assert s.units["prefix_queries"] == "tokens"
    assert s.counters["preemptions"] == 2 and s.counters["prompt_tokens"] == 12800
    assert s.counters["generation_tokens"] == 2500
    assert s.counters["request_success"] == 50
    assert s.counters["request_success:length"] == 9 and s.counters["request_success:abort"] == 1
    assert s.counters["prompt_tokens_by_source:local_cache_hit"] == 4800
    assert s.info["block_size"] == "16" and s.info["num_gpu_blocks"] == "27306"
    assert s.info["cache_dtype"] == "auto" and "engine" not in s.info
    ttft = s.histograms["ttft"]
    assert ttft.bounds[-1] == math.inf and len(ttft.bounds) == len(TTFT_BUCKETS) + 1
    assert ttft.count == 50 and ttft.sum == 12.5
    assert s.histograms["itl"].count == 2450 and s.histograms["tpot"].count == 50
    assert s.histograms["iteration_tokens"].count == 310  # a histogram despite its `_total` name
    assert "iteration_tokens" not in s.counters
    assert s.sources["itl"] == "vllm:inter_token_latency_seconds"
    assert not any("created" in k for k in [*s.gauges, *s.counters])


def test_older_vllm_names_map_onto_the_same_series():
    s = parse_exposition(OLD_VLLM)
    assert s.gauges["kv_usage"] == 0.8 and s.gauges["running"] == 4
    assert s.counters["prefix_queries"] == 1000 and s.counters["prefix_hits"] == 250
    assert s.counters["preemptions"] == 6
    assert s.sources["itl"] == "vllm:time_per_output_token_seconds"  # per token: an ITL
    assert s.histograms["itl"].count == 100 and "tpot" not in s.histograms


def test_first_v1_prefix_counters_said_blocks():
    text = OLD_VLLM.replace("number of queried tokens", "number of queried blocks")
    assert parse_exposition(text).units == {"prefix_queries": "blocks", "prefix_hits": "blocks"}


def test_deprecated_and_new_names_together_count_once():
    """vLLM 0.9-0.10 exported both (or with --show-hidden-metrics-for-version)."""
    both = CURRENT_VLLM + f"""vllm:gpu_cache_usage_perc{{{L}}} 0.42
vllm:gpu_prefix_cache_queries_total{{{L}}} 12800.0
vllm:gpu_prefix_cache_hits_total{{{L}}} 4800.0
"""
    s = parse_exposition(both)
    assert s.gauges["kv_usage"] == 0.42 and s.counters["prefix_queries"] == 12800
    assert s.sources["prefix_hits"] == "vllm:prefix_cache_hits"


def test_sglang_new():
    s = parse_exposition(SGLANG_NEW)
    assert s.model_name == "qwen"
    assert s.gauges["running"] == 162 and s.gauges["waiting"] == 2826 and s.gauges["kv_usage"] == 0.28
    assert s.gauges["prefix_hit_rate_gauge"] == 0.0075 and "prefix_hit_rate" not in s.counters
    assert s.gauges["retracted_reqs_gauge"] == 3 and s.counters["preemptions"] == 17
    assert s.counters["prompt_tokens"] == 8128902 and s.counters["generation_tokens"] == 7557572
    assert s.counters["request_success"] == 11008
    assert s.counters["prefix_queries"] == 8128902 and s.counters["prefix_hits"] == 2e6  # from cached_tokens
    assert s.histograms["ttft"].count == 8 and s.histograms["e2e"].count == 7
    assert s.sources["itl"] == "sglang:inter_token_latency_seconds" and s.histograms["itl"].count == 90
    assert s.sources["tpot"] == "sglang:time_per_output_token_seconds" and s.histograms["tpot"].count == 7
    assert s.histograms["queue"].quantile(0.3) == 0.0  # lowest bucket bound <= 0: Prometheus returns it


def test_sglang_old_tpot_is_per_token():
    s = parse_exposition(SGLANG_OLD)
    assert s.sources["itl"] == "sglang:time_per_output_token_seconds" and "tpot" not in s.histograms
    assert "preemptions" not in s.counters
    # before the first prefix hit SGLang has no cached_tokens_total: hits are 0, not missing
    assert s.counters["prefix_hits"] == 0 and s.counters["prefix_queries"] == 8128902


def test_sglang_realtime_tokens_give_prefix_counters():
    text = SGLANG_NEW + """# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{model_name="qwen",mode="prefill_compute"} 600.0
sglang:realtime_tokens_total{model_name="qwen",mode="prefill_cache"} 400.0
sglang:realtime_tokens_total{model_name="qwen",mode="decode"} 900.0
"""
    s = parse_exposition(text)
    assert s.counters["prefix_queries"] == 1000 and s.counters["prefix_hits"] == 400


def openmetrics_text() -> str:
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:kv_cache_usage_perc", "usage", labels, registry=reg).labels("m", "0").set(0.5)
    Counter("vllm:prompt_tokens", "prompt", labels, registry=reg).labels("m", "0").inc(128)
    ok = Counter("vllm:request_success", "done", labels + ["finished_reason"], registry=reg)
    ok.labels("m", "0", "stop").inc(3)
    h = PromHistogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=(0.1, 1.0), registry=reg)
    for v in (0.05, 0.5, 0.7):
        h.labels("m", "0").observe(v)
    PromHistogram("vllm:iteration_tokens_total", "it", labels, buckets=(1, 8), registry=reg).labels("m", "0").observe(4)
    Gauge("kvengine:num_free_blocks", "free", labels, registry=reg).labels("m", "0").set(99)
    return openmetrics_latest(reg).decode()


def test_openmetrics_escaped_names():
    text = openmetrics_text()
    assert "vllm_prompt_tokens_total" in text and "# EOF" in text  # what prometheus-client 0.26 writes
    s = parse_exposition(text)
    assert s.gauges["kv_usage"] == 0.5 and s.counters["prompt_tokens"] == 128
    assert s.counters["request_success:stop"] == 3 and s.gauges["kvengine_num_free_blocks"] == 99
    assert s.histograms["ttft"].count == 3 and s.histograms["ttft"].counts == [1, 3, 3]
    assert s.histograms["iteration_tokens"].count == 1


def test_two_engines_sum_counts_and_average_usage():
    def engine(i, running, usage, tokens, buckets):
        lab = f'engine="{i}",model_name="m"'
        return (f"vllm:num_requests_running{{{lab}}} {running}\n"
                f"vllm:num_requests_waiting{{{lab}}} 1\n"
                f"vllm:kv_cache_usage_perc{{{lab}}} {usage}\n"
                f"vllm:generation_tokens_total{{{lab}}} {tokens}\n"
                f'vllm:request_success_total{{{lab},finished_reason="stop"}} {i + 1}\n'
                f'vllm:cache_config_info{{block_size="16",engine="{i}",num_gpu_blocks="1000"}} 1\n'
                + histogram_lines("vllm:time_to_first_token_seconds", lab, ("0.1", "1.0"), buckets, 1.0))
    s = parse_exposition(engine(0, 3, 0.2, 100, [1, 2]) + engine(1, 5, 0.6, 50, [0, 4]))
    assert s.gauges["running"] == 8 and s.gauges["waiting"] == 2
    assert s.gauges["kv_usage"] == pytest.approx(0.4)
    assert s.counters["generation_tokens"] == 150 and s.counters["request_success:stop"] == 3
    ttft = s.histograms["ttft"]
    assert ttft.counts == [1, 6, 6] and ttft.count == 6 and ttft.sum == 2.0
    assert s.info["block_size"] == "16"


def test_model_name_filter():
    text = OLD_VLLM + OLD_VLLM.replace('model_name="m"', 'model_name="other"').replace(
        "vllm:num_requests_running{" + 'engine="0",model_name="other"' + "} 4.0",
        "vllm:num_requests_running{" + 'engine="0",model_name="other"' + "} 40.0")
    assert parse_exposition(text, model_name="other").gauges["running"] == 40
    assert parse_exposition(text, model_name="m").gauges["running"] == 4
    assert parse_exposition(text).model_name == "m,other"


def test_missing_metrics_are_none_not_a_crash():
    s = parse_exposition("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n")
    assert s.get("kv_usage") is None and s.get("prefix_hits") is None and s.get("running") == 1
    assert s.histograms == {} and s.info == {} and s.model_name is None
    log = ScrapeLog([s, parse_exposition("vllm:num_requests_running 2\n", t=s.t + 1)])
    assert log.counter_increase("prefix_queries") is None and log.rate("generation_tokens") is None
    assert log.histogram_quantile("ttft", 0.99) is None and log.histogram_count("ttft") is None
    assert log.gauge_stats("kv_usage") is None
    series = log.series()
    assert series["num_running"] == [1, 2] and "kv_usage" not in series and "prefix_hits" not in series
    assert ScrapeLog().series() == {"time": [], "duration": []}
    assert parse_exposition("").counters == {}


# -- counters through resets -------------------------------------------------
def counter_snapshot(t, tokens, hits=None):
    text = f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens}\n'
    if hits is not None:
        text += f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
    return parse_exposition(text, t=t)


def test_counter_increase_and_series_survive_resets():
    log = ScrapeLog([counter_snapshot(1000.0 + i, v) for i, v in enumerate([10, 20, 5, 8, 8])])
    assert log.counter_increase("generation_tokens") == 10 + 5 + 3 + 0
    assert log.series()["generation_tokens"] == [0, 10, 5, 3, 0]
    assert log.series()["time"] == [0, 1, 2, 3, 4] and log.series()["duration"] == [0, 1, 1, 1, 1]
    assert log.counter_increase("generation_tokens", t0=2, t1=4) == 3
    assert log.rate("generation_tokens") == pytest.approx(18 / 4)
    assert log.rate("generation_tokens", t0=1, t1=3) == pytest.approx((5 + 3) / 2)
    assert log.rate("generation_tokens", t0=4) is None  # one snapshot: no span


def test_counter_that_appears_late_started_from_zero():
    log = ScrapeLog([counter_snapshot(0.0, 1), counter_snapshot(1.0, 2, hits=16), counter_snapshot(2.0, 3, hits=48)])
    assert log.counter_increase("prefix_hits") == 48
    assert log.series()["prefix_hits"] == [0, 16, 32]


# -- histogram quantiles -----------------------------------------------------
def hist_snapshot(t, cumulative):
    """e2e buckets 0.1, 0.5, 1.0, +Inf with these cumulative counts; sum = count / 20."""
    text = histogram_lines("vllm:e2e_request_latency_seconds", 'engine="0",model_name="m"', ("0.1", "0.5", "1.0"),
                           cumulative[:3], cumulative[3] / 20, inf=cumulative[3])
    return parse_exposition(text, t=t)


def test_bucket_quantile_by_hand():
    bounds, counts = [0.1, 0.5, 1.0, math.inf], [2, 6, 9, 10]
    assert bucket_quantile(0.5, bounds, counts) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert bucket_quantile(0.1, bounds, counts) == pytest.approx(0.05)  # from 0 in the lowest bucket
    assert bucket_quantile(0.9, bounds, counts) == pytest.approx(1.0)
    assert bucket_quantile(0.95, bounds, counts) == 1.0  # in +Inf: the highest finite bound
    assert bucket_quantile(1.5, bounds, counts) == math.inf and bucket_quantile(-1, bounds, counts) == -math.inf
    assert bucket_quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert bucket_quantile(0.5, [0.1, 0.5], [1, 2]) is None  # no +Inf bucket
    assert bucket_quantile(0.5, bounds, [2, 6, 5, 10]) == pytest.approx(0.1 + 0.4 * 3 / 4)  # non-monotonic read


def test_histogram_quantile_over_windows_and_resets():
    log = ScrapeLog([hist_snapshot(0.0, [2, 6, 9, 10]),
                     hist_snapshot(1.0, [2, 6, 19, 20]),  # +10 observations, all in (0.5, 1.0]
                     hist_snapshot(2.0, [1, 1, 1, 1])])  # restarted: one new observation <= 0.1
    assert log.histogram_count("e2e", t1=1) == 10
    assert log.histogram_quantile("e2e", 0.5, t1=1) == pytest.approx(0.5 + 0.5 * 5 / 10)
    assert log.histogram_count("e2e") == 11
    assert log.histogram_quantile("e2e", 0.05) == pytest.approx(0.1 * 0.55)  # rank 0.55 of 1 in [0, 0.1]
    assert log.histogram_quantile("e2e", 0.5, t0=0, t1=0) is None  # one snapshot: empty window
    assert log.histogram_quantile("e2e", 0.5, t0=5) is None
    whole = log.snapshots[1].histograms["e2e"]  # cumulative since the server started
    assert whole.quantile(0.5) == pytest.approx(0.5 + 0.5 * 4 / 13) and whole.mean() == pytest.approx(1 / 20)


def test_quantiles_in_the_first_or_the_inf_bucket_are_only_bounds():
    """Prometheus interpolates inside (0, b] from 0 and answers the last bound for +Inf; neither is a
    measurement, so the bounded form says "< b" or "> last bound" instead."""
    log = ScrapeLog([hist_snapshot(0.0, [2, 6, 9, 10]),
                     hist_snapshot(1.0, [2, 6, 19, 20]),
                     hist_snapshot(2.0, [1, 1, 1, 1])])
    assert log.histogram_quantile_bound("e2e", 0.5, t1=1).value == log.histogram_quantile("e2e", 0.5, t1=1)
    after_reset = log.histogram_quantile_bound("e2e", 0.05)  # rank 0.55 of 11, in (0, 0.1]
    assert after_reset.value is None and after_reset.below == 0.1
    whole = log.snapshots[0].histograms["e2e"]
    assert whole.quantile(0.95) == 1.0 and whole.quantile_bound(0.95).above == 1.0  # rank 9.5 in +Inf
    assert whole.quantile_bound(0.9).value == pytest.approx(1.0)  # rank 9 of 10: inside (0.5, 1.0]
    missing = log.histogram_quantile_bound("ttft", 0.5)
    assert not missing.known and missing.value is None


def test_histogram_sum_of_different_buckets_is_monotonic():
    a = Histogram([0.1, 1.0, math.inf], [1, 2, 2], 0.5, 2)
    b = Histogram([0.5, math.inf], [3, 4], 1.0, 4)
    c = a + b
    assert c.bounds == [0.1, 0.5, 1.0, math.inf] and c.counts == [1, 4, 5, 6] and c.count == 6


def test_gauge_stats():
    log = ScrapeLog([parse_exposition(f"vllm:kv_cache_usage_perc {u}\n", t=float(i))
                     for i, u in enumerate([0.2, 0.6, 0.4])])
    stats = log.gauge_stats("kv_usage")
    assert (stats.min, stats.max, stats.last) == (0.2, 0.6, 0.4) and stats.mean == pytest.approx(0.4)
    assert log.gauge_stats("kv_usage", t0=1, t1=1).last == 0.6


# -- the Scraper over real HTTP ----------------------------------------------
SIM = ("--executor", "sim", "--preset", "llama-3-8b", "--device", "h100-80gb",
       "--served-model-name", "sim-llama", "--max-model-len", "2048")


def test_scraper_against_a_live_kvengine():
    server = ServerProcess(*SIM)
    try:
        scraper = Scraper(server.url, interval_s=0.1, model_name="sim-llama").start()
        prompt = [3000 + i for i in range(200)]  # 12 full blocks of 16
        for max_tokens in (10, 10, 4):
            r = httpx.post(server.url + "/v1/completions",
                           json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
            assert r.status_code == 200
        log = scraper.stop()
    finally:
        server.stop()
        server.proc.stdout.close()  # ServerProcess.stop() reads it but leaves it open
    assert log.errors == 0 and len(log) >= 2 and log.url == server.url + "/metrics"
    assert log.counter_increase("request_success") == 3 and log.counter_increase("request_success:length") == 3
    assert log.counter_increase("prompt_tokens") == 600
    assert log.counter_increase("generation_tokens") == 24
    assert log.counter_increase("prefix_queries") == 600
    assert log.counter_increase("prefix_hits") == 2 * 192  # the 2nd and 3rd requests hit 12 blocks
    assert log.histogram_count("ttft") == 3 and log.histogram_count("e2e") == 3
    assert log.histogram_count("itl") == 9 + 9 + 3 and log.histogram_count("tpot") == 3
    assert log.histogram_count("prompt_len") == 3 and log.snapshots[-1].histograms["prompt_len"].sum == 600
    assert 0 < log.histogram_quantile("ttft", 0.5) <= log.histogram_quantile("ttft", 0.99)
    last = log.snapshots[-1]
    assert last.model_name == "sim-llama" and last.info["block_size"] == "16"
    assert last.gauges["running"] == 0 and last.gauges["kv_usage"] == 0
    assert last.gauges["kvengine_num_free_blocks"] == int(last.info["num_gpu_blocks"]) - 1
    series = log.series()
    assert len(series["time"]) == len(log) == len(series["kv_usage"]) == len(series["prefix_hits"])
    assert sum(series["requests_finished"]) == 3 and sum(series["prefix_hits"]) == 384
    assert sum(series["num_preemptions"]) == 0


def test_refused_connection_gives_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    scraper = Scraper(url, interval_s=0.05, timeout_s=1.0, retries=1, retry_delay_s=0.01)
    with pytest.raises(ScrapeError, match=f"connection refused by {url}/metrics"):
        scraper.scrape_once()
    scraper.start()
    threading.Event().wait(0.2)
    log = scraper.stop()  # the thread never raises
    assert log.snapshots == [] and log.errors >= 2 and "connection refused" in log.last_error


class _Handler(http.server.BaseHTTPRequestHandler):
    body, status, accepts = b"", 200, []

    def do_GET(self):
        type(self).accepts.append(self.headers.get("Accept", ""))
        self.send_response(self.status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def tiny_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_plain_text_accept_header_http_errors_and_garbage(tiny_server):
    _, url = tiny_server
    _Handler.body, _Handler.status, _Handler.accepts = OLD_VLLM.encode(), 200, []
    snap = Scraper(url + "/metrics/").scrape_once()
    assert snap.gauges["kv_usage"] == 0.8
    assert _Handler.accepts[-1].startswith("text/plain") and "openmetrics" not in _Handler.accepts[-1]
    _Handler.status = 404
    with pytest.raises(ScrapeError, match="HTTP 404"):
        Scraper(url, retries=3, retry_delay_s=5).scrape_once()  # 4xx: not retried, so no 15 s wait
    _Handler.status, _Handler.body = 200, b"vllm:num_requests_running{ 1 2 3\n"
    with pytest.raises(ScrapeError, match="cannot parse"):
        Scraper(url).scrape_once()
