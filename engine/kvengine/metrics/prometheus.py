"""The engine's Prometheus metrics, with vLLM V1's names, types, labels and buckets.

Counters are declared without `_total`: prometheus_client appends it on export,
as it does for vLLM (`vllm:prompt_tokens` is scraped as `vllm:prompt_tokens_total`).
Every metric carries `model_name` and `engine` labels and exists at 0 before
any traffic. What vLLM lacks goes under `kvengine:`.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvengine.engine.outputs import CoreOutputs, EngineInfo, FinishedRequestStats, IterationStats, SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's token buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def cache_config_labels(config, num_gpu_blocks: int, user_specified_block_size: bool = True) -> dict[str, str]:
    """vLLM's CacheConfig.metrics_info(): every attribute, stringified."""
    return {
        "block_size": str(config.block_size),
        "user_specified_block_size": str(user_specified_block_size),
        "hash_block_size": str(config.block_size),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "cache_dtype": config.kv_cache_dtype,
        "is_attention_free": "False",
        "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
        "sliding_window": "None",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "prefix_caching_hash_algo": "sha256",
        "calculate_kv_scales": "False",
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_cpu_blocks": "None",
        "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes),
        "kv_offloading_size": "None",
        "kv_offloading_backend": "None",
    }


class EngineMetrics:
    """Owns a registry; the frontend records every CoreOutputs the engine core sends."""

    def __init__(self, model_name: str, info: EngineInfo, engine_index: str = "0",
                 user_specified_block_size: bool = True):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": engine_index}
        names = list(labels)
        reg = self.registry
        max_len = info.config.max_model_len

        def gauge(name, doc, extra=()):
            return Gauge(name, doc, names + list(extra), registry=reg, multiprocess_mode="mostrecent")

        def counter(name, doc, extra=()):
            return Counter(name, doc, names + list(extra), registry=reg)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.").labels(**labels)
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(**labels)
        waiting_by_reason = gauge("vllm:num_requests_waiting_by_reason",
                                  "Number of waiting requests by reason.", ["reason"])
        self.waiting_capacity = waiting_by_reason.labels(**labels, reason="capacity")
        waiting_by_reason.labels(**labels, reason="deferred").set(0)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.").labels(**labels)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.").labels(**labels)
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.").labels(**labels)
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.").labels(**labels)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(**labels)
        by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ["source"])
        self.prompt_computed = by_source.labels(**labels, source="local_compute")
        self.prompt_cache_hit = by_source.labels(**labels, source="local_cache_hit")
        by_source.labels(**labels, source="external_kv_transfer")
        self.prompt_cached = counter("vllm:prompt_tokens_cached",
                                     "Number of cached prompt tokens (local + external).").labels(**labels)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.").labels(**labels)
        success = counter("vllm:request_success", "Count of successfully processed requests.",
                          ["finished_reason"])
        self.success = {reason: success.labels(**labels, finished_reason=reason) for reason in FINISHED_REASONS}

        token_buckets = build_1_2_5_buckets(max_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                  PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.num_preemptions_hist = histogram("vllm:request_num_preemptions",
                                              "Number of preemptions per finished request.", NUM_PREEMPTIONS_BUCKETS)
        self.prefill_kv_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                             "Histogram of new KV tokens computed during prefill "
                                             "(excluding cached tokens).", token_buckets)
        config_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                            list(cache_config_labels(info.config, 0)) + ["engine"], registry=reg,
                            multiprocess_mode="mostrecent")
        config_info.labels(**cache_config_labels(info.config, info.num_gpu_blocks, user_specified_block_size),
                           engine=engine_index).set(1)

        self.free_blocks = gauge("kvengine:num_free_blocks",
                                 "KV blocks not referenced by any request (cached ones included).").labels(**labels)
        self.cached_blocks = None
        if info.scheduler.num_cached_blocks is not None:  # the allocator has a prefix cache pool
            self.cached_blocks = gauge("kvengine:num_cached_blocks",
                                       "Distinct KV blocks the prefix cache can serve (in use or free).").labels(
                **labels)
        gauge("kvengine:num_gpu_blocks", "KV blocks in the pool, the null block included.").labels(
            **labels).set(info.num_gpu_blocks)
        self.evictions = counter("kvengine:prefix_cache_evictions",
                                 "Cached KV blocks evicted to be reused.").labels(**labels)
        self.reserved_tokens = gauge("kvengine:kv_reserved_tokens",
                                     "Token slots held by running requests (the contiguous baseline "
                                     "reserves max_model_len each).").labels(**labels)
        self._seen_evictions = 0
        self._seen_prefix = (0, 0)
        self._record_scheduler(info.scheduler)

    # -- called from the frontend's reader thread ---------------------------------
    def record(self, out: CoreOutputs) -> None:
        if out.scheduler is not None:
            self._record_scheduler(out.scheduler)
        if out.iteration is not None:
            self._record_iteration(out.iteration)
        for finished in out.finished:
            self._record_finished(finished)

    def _record_scheduler(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.waiting_capacity.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.free_blocks.set(s.num_free_blocks)
        self.reserved_tokens.set(s.reserved_tokens)
        if self.cached_blocks is not None:
            self.cached_blocks.set(s.num_cached_blocks)
        if s.num_evictions > self._seen_evictions:
            self.evictions.inc(s.num_evictions - self._seen_evictions)
            self._seen_evictions = s.num_evictions
        queries, hits = self._seen_prefix
        self.prefix_queries.inc(s.prefix_queries - queries)
        self.prefix_hits.inc(s.prefix_hits - hits)
        self._seen_prefix = (s.prefix_queries, s.prefix_hits)

    def _record_iteration(self, it: IterationStats) -> None:
        if it.num_preempted:
            self.preemptions.inc(it.num_preempted)
        for prompt_tokens, cached, ttft in it.first_tokens:  # the whole prompt counts at its first token
            self.prompt_tokens.inc(prompt_tokens)
            self.prompt_computed.inc(prompt_tokens - cached)
            self.prompt_cache_hit.inc(cached)
            self.prompt_cached.inc(cached)
            self.ttft.observe(ttft)
        for itl in it.inter_token_latencies:
            self.itl.observe(itl)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_generation_tokens:  # vLLM observes only steps with outputs (not mid-prefill chunks)
            self.iteration_tokens.observe(it.num_iteration_tokens)

    def _record_finished(self, f: FinishedRequestStats) -> None:
        self.success[f.finish_reason].inc()
        self.request_prompt_tokens.observe(f.prompt_tokens)
        self.request_generation_tokens.observe(f.generation_tokens)
        self.max_num_generation_tokens.observe(f.max_tokens)
        self.params_max_tokens.observe(f.max_tokens)
        self.params_n.observe(f.n)
        self.num_preemptions_hist.observe(f.num_preemptions)
        self.prefill_kv_computed.observe(f.prefill_kv_computed)
        t = f.timings
        if t is None:
            return
        self.e2e.observe(t.e2e)
        self.queue.observe(t.queue)
        self.inference.observe(t.inference)
        self.prefill.observe(t.prefill)
        self.decode.observe(t.decode)
        self.tpot.observe(t.tpot)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
