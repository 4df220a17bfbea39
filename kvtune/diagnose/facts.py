"""Everything the rules read about one run, worked out once."""
from __future__ import annotations

from dataclasses import dataclass

from ..results import RequestRecord, RunResult, bound_text, quantile_bound
from .latency import Contexts, completed, contexts_from_profile, contexts_from_requests, percentile
from .model import Thresholds
from .pool import Pool, pool_of
from .signals import Bins, Series, time_bins

SERVER_HISTOGRAM = "vllm:request_num_preemptions"


@dataclass
class RunFacts:
    result: RunResult
    th: Thresholds
    series: Series
    bins: Bins | None
    pool: Pool | None
    contexts: Contexts | None
    requests: list[RequestRecord]  # the completed ones

    @property
    def config(self) -> dict:
        return self.result.config

    @property
    def max_num_seqs(self) -> int | None:
        value = self.config.get("max_num_seqs")
        return int(value) if value else None

    @property
    def prefix_caching_off(self) -> bool:
        return self.config.get("enable_prefix_caching") is False

    @property
    def hit_rate(self) -> float | None:
        """Prefix-cache hits over queries (tokens) from the server's counters; None if nothing was queried."""
        queries, hits = self.series.total("prefix_queries"), self.series.total("prefix_hits")
        return hits / queries if queries else None

    @property
    def ideal_hit_rate(self) -> float | None:
        return self.result.workload.get("ideal_prefix_hit_rate")

    def ttft_p95(self) -> tuple[float | None, str]:
        """The clients' TTFT p95, else the server histogram's. Where that lies in the +Inf bucket,
        its last bound (the p95 is above it); in the first bucket, None (it is below a millisecond)."""
        if self.requests:
            return percentile([r.ttft_s for r in self.requests], 95), "TTFT p95 (clients)"
        summary = self.result.summary
        bound = quantile_bound(summary, "server_ttft_p95")
        if bound is not None and bound[0] == ">":
            return bound[1], f"TTFT p95 (server histogram: {bound_text(*bound)})"
        return summary.get("server_ttft_p95"), "TTFT p95 (server histogram)"

    @property
    def live(self) -> bool:
        """The run's figures include a live server's own counters (scraped /metrics)."""
        return "server_preemptions" in self.result.summary

    def preempted(self) -> Preempted | None:
        """Requests preempted at least once: the server's vllm:request_num_preemptions histogram where
        the run has it; else the records where they can see preemptions (the simulator's do: a live
        server's clients cannot, theirs always read 0); else None (unknown)."""
        s = self.result.summary
        finished = s.get("server_request_preemptions_count")
        # A histogram with no preempted request while the server's counter preempted is not
        # reporting them (a frontend that does not track them): unknown, never a 0 as evidence.
        silent = not s.get("server_requests_preempted") and (s.get("server_preemptions") or 0) > 0
        if finished and s.get("server_requests_preempted") is not None and not silent:
            most = s.get("server_requests_preempted_max", s["server_requests_preempted"])
            return Preempted(int(s["server_requests_preempted"]), int(most), int(finished),
                             s.get("server_preemptions_per_request"), SERVER_HISTOGRAM)
        if self.live or not self.requests:
            return None
        counts = [r.num_preemptions for r in self.requests]
        hit = sum(c > 0 for c in counts)
        return Preempted(hit, hit, len(counts), sum(counts) / len(counts), "requests' records")

    def cached_tokens_per_request(self) -> tuple[float | None, str]:
        """Mean cached prompt tokens per completed request: the records' (clients see them only with
        vLLM's --enable-prompt-tokens-details), else the server's vllm:prompt_tokens_by_source
        local_cache_hit (+ external) over the requests it finished."""
        records = sum(r.cached_tokens for r in self.requests)
        server = self.result.summary.get("server_cached_prompt_tokens")
        finished = self.result.summary.get("server_e2e_count") or len(self.requests)
        if (records == 0 or not self.requests) and server is not None and finished:
            return server / finished, "cached prompt tokens per request (server, prompt_tokens_by_source)"
        if not self.requests:
            return None, "cached prompt tokens per request"
        return records / len(self.requests), "cached prompt tokens per request (mean)"


@dataclass
class Preempted:
    """Requests preempted at least once over the run, as far as `source` tells."""

    fewest: int
    most: int  # equal to `fewest` unless the histogram's coarse buckets leave a range
    requests: int  # the requests it covers (finished ones)
    per_request: float | None  # mean preemptions per request
    source: str

    @property
    def from_server(self) -> bool:
        return self.source == SERVER_HISTOGRAM

    @property
    def share(self) -> float | None:
        return self.fewest / self.requests if self.requests else None

    @property
    def text(self) -> str:
        count = f"{self.fewest}" if self.fewest == self.most else f"{self.fewest}–{self.most}"
        return f"{count} of {self.requests}"


def gather(result: RunResult, th: Thresholds) -> RunFacts:
    series = Series(result.series).busy()
    pool = pool_of(result)
    requests = completed(result.requests)
    contexts = contexts_from_requests(requests, th.min_requests) or contexts_from_profile(result.workload)
    bins = time_bins(series, th.bins, pool.tokens if pool else None)
    return RunFacts(result, th, series, bins, pool, contexts, requests)
