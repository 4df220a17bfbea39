"""Everything the rules read about one run, worked out once."""
from __future__ import annotations

from dataclasses import dataclass

from ..results import RequestRecord, RunResult
from .latency import Contexts, completed, contexts_from_profile, contexts_from_requests, percentile
from .model import Thresholds
from .pool import Pool, pool_of
from .signals import Bins, Series, time_bins


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
        """The clients' TTFT p95, else the server histogram's."""
        if self.requests:
            return percentile([r.ttft_s for r in self.requests], 95), "TTFT p95 (clients)"
        return self.result.summary.get("server_ttft_p95"), "TTFT p95 (server histogram)"

    def preempted_share(self) -> float | None:
        if not self.requests:
            return None
        return sum(r.num_preemptions > 0 for r in self.requests) / len(self.requests)


def gather(result: RunResult, th: Thresholds) -> RunFacts:
    series = Series(result.series)
    pool = pool_of(result)
    requests = completed(result.requests)
    contexts = contexts_from_requests(requests, th.min_requests) or contexts_from_profile(result.workload)
    bins = time_bins(series, th.bins, pool.tokens if pool else None)
    return RunFacts(result, th, series, bins, pool, contexts, requests)
