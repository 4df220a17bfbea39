"""What the server says of itself: its model and config (from /v1/models and /metrics, before
the probes are designed), and the counters of its /metrics around a probe (its own prefill
times, its prefix cache's hits).

Where the server exports vLLM's `vllm:request_prefill_time_seconds` (first scheduled to first
token, timed by the engine core), each isolated single-request TTFT probe also reads it, before
and after the request: the same steps without the client overhead, which tells an engine's
per-prefill cost apart from the HTTP path's (in a TTFT alone they only ever add up).
"""
from __future__ import annotations

from dataclasses import dataclass

import httpx

from ..httpclient import http_get
from ..scrape import parse_exposition, reported_config
from .errors import CalibrationError


@dataclass
class ServerInfo:
    """What the probes need to know about the server, from /v1/models and /metrics."""

    url: str
    model_name: str
    max_model_len: int
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: str | None = None
    pool_bytes: int | None = None  # kv_cache_memory_bytes, where the server reports it

    def to_dict(self) -> dict:
        return dict(vars(self))


def server_info(url: str, timeout_s: float = 10.0) -> ServerInfo:
    url = url.rstrip("/")
    try:
        resp = http_get(url + "/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        entry = resp.json()["data"][0]
    except httpx.HTTPError as err:
        raise CalibrationError(f"cannot reach {url}/v1/models: is a server listening there? ({err})") from None
    except (KeyError, IndexError, ValueError) as err:
        raise CalibrationError(f"{url}/v1/models did not name a model: {err}") from None
    info = ServerInfo(url, entry["id"], int(entry.get("max_model_len") or 4096))
    reported = reported_config(url, timeout_s)  # {} without /metrics: the defaults
    info.block_size = reported.get("block_size")
    info.num_gpu_blocks = reported.get("num_gpu_blocks")
    info.enable_prefix_caching = reported.get("enable_prefix_caching")
    info.kv_cache_dtype = reported.get("kv_cache_dtype") or None
    info.pool_bytes = reported.get("kv_cache_memory_bytes")
    return info


async def _scrape(client):
    """The server's /metrics now, parsed; None where it has none (a server without /metrics
    still calibrates on its TTFTs) or serves something else there (a proxy's page, say)."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_exposition(resp.text)
    except ValueError:
        return None


@dataclass(frozen=True)
class PrefillTimes:
    """The server's vllm:request_prefill_time_seconds so far: their sum, and how many."""

    sum_s: float
    count: float


async def prefill_times(client) -> PrefillTimes | None:
    """The server's prefill times so far; None where it has none."""
    snapshot = await _scrape(client)
    hist = None if snapshot is None else snapshot.histograms.get("prefill")
    return PrefillTimes(hist.sum, hist.count) if hist is not None else None


@dataclass(frozen=True)
class PrefixCacheCounts:
    """The server's prefix-cache hits and queries so far (vllm:prefix_cache_hits and _queries),
    in their `unit` (tokens, or blocks on older vLLM)."""

    hits: float
    queries: float
    unit: str


async def prefix_hits(client) -> PrefixCacheCounts | None:
    """The server's prefix-cache counts so far; None where it exports none."""
    snapshot = await _scrape(client)
    if snapshot is None or snapshot.get("prefix_hits") is None or snapshot.get("prefix_queries") is None:
        return None
    return PrefixCacheCounts(snapshot.get("prefix_hits"), snapshot.get("prefix_queries"),
                             snapshot.units.get("prefix_hits", "tokens"))
