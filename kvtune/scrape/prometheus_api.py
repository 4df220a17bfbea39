"""Read a server's series back from a Prometheus server: the ScrapeLog kvtune would have recorded
had it scraped the server itself, one snapshot per step.

    log = read_range("http://127.0.0.1:9090", '{job="engine"}', start, end, step_s=5)
    result = kvtune.targets.watch.result_from_scrape(log, "http://engine:8000")

Range queries (`/api/v1/query_range`, in pieces of at most 10,000 steps: Prometheus answers at
most 11,000 points per series) fetch every raw vllm:*, sglang:* and kvengine:* series the selector
matches; each step's samples are written back as a /metrics exposition and parsed by
`parse_exposition`, so the snapshots go through the very mapping a live scrape goes through
(names, units, histograms, vllm:cache_config_info, model_name). The HELP texts come from
`/api/v1/metadata` when Prometheus still has them (it keeps metadata for active targets only);
without them only `Snapshot.units` falls back to its default, tokens.

A step's snapshot holds each series' latest sample at or before the step (Prometheus' lookback),
so with `step_s` at the scrape interval the snapshots are the scrapes, up to one interval late; a
step with no sample at all (before the server was first scraped, after it went stale) has no
snapshot. The labels Prometheus adds to every target (`job`, `instance`) are dropped; other target
labels from the scrape config stay, and no rule reads them.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import replace

import httpx

from ..httpclient import HTTP_ERRORS, http_client
from .log import ScrapeLog
from .parse import Snapshot, parse_exposition
from .scraper import ScrapeError

# Both spellings: a Prometheus 2 that negotiated OpenMetrics with prometheus-client stores `vllm_x`.
NAMES = '__name__=~"(vllm|sglang|kvengine)[:_].+"'
NOT_CREATED = '__name__!~".+_created"'  # creation times, which no canonical metric reads
TARGET_LABELS = ("job", "instance")
MAX_POINTS = 10_000  # Prometheus refuses a range query of more than 11,000 points per series
TIMEOUT_S = 60.0


def read_range(prometheus_url: str, selector: str, start: float, end: float, step_s: float) -> ScrapeLog:
    """The series `selector` matches between `start` and `end` (Unix seconds), one Snapshot per `step_s`.

    `selector` is a PromQL label matcher that picks one server, e.g. `{job="engine"}` or
    `{instance="127.0.0.1:8000"}`. Raises ScrapeError, naming the Prometheus URL, when Prometheus
    cannot be reached, refuses the query, matches no series or matches more than one server;
    ValueError for a selector that is not a label matcher or an empty time range."""
    if not (math.isfinite(start) and math.isfinite(end) and end > start):
        raise ValueError(f"read_range needs start < end, got {start} and {end}")
    if not step_s > 0:
        raise ValueError(f"read_range needs a step > 0 s, got {step_s}")
    base = prometheus_url.rstrip("/")
    query = series_query(selector)
    series = [s for lo, hi in chunks(start, end, step_s) for s in _query_range(base, query, lo, hi, step_s)]
    if not series:
        raise ScrapeError(f"no vllm:, sglang: or kvengine: series match {selector} on Prometheus at {base} "
                          f"between {start:.0f} and {end:.0f}", retryable=False)
    _check_one_server(series, selector, base)
    helps = _helps(base, {s["metric"]["__name__"] for s in series})
    by_time: dict[float, list[str]] = defaultdict(list)
    for s in series:
        line = _sample_line(s["metric"])
        for t, value in s["values"]:
            by_time[float(t)].append(f"{line} {value}")
    parsed: dict[str, Snapshot] = {}  # steps between two scrapes, or on an idle server, repeat a text
    snapshots = []
    for t, lines in sorted(by_time.items()):
        text = _exposition(lines, helps)
        if text not in parsed:
            parsed[text] = parse_exposition(text, t=t)
        snapshots.append(_at(parsed[text], t))
    return ScrapeLog(snapshots, url=f"{base} {selector}")


def _at(snap: Snapshot, t: float) -> Snapshot:
    """A copy of `snap` taken at `t`, sharing nothing another snapshot could change."""
    return replace(snap, t=t, gauges=dict(snap.gauges), counters=dict(snap.counters),
                   histograms=dict(snap.histograms), info=dict(snap.info), sources=dict(snap.sources),
                   units=dict(snap.units))


def series_query(selector: str) -> str:
    """`{job="engine"}` -> the raw-series selector for the server's own metrics."""
    inner = selector.strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1].strip()
    elif "{" in inner or "}" in inner:
        raise ValueError(f"the selector is a label matcher like {{job=\"engine\"}}, not a series: {selector!r}")
    return "{" + ", ".join(m for m in (NAMES, NOT_CREATED, inner) if m) + "}"


def chunks(start: float, end: float, step_s: float):
    """(start, end) pieces of at most MAX_POINTS steps, on the same step grid."""
    span = step_s * (MAX_POINTS - 1)
    lo = start
    while lo <= end:
        hi = min(lo + span, end)
        yield lo, hi
        lo = hi + step_s


def _query_range(base: str, query: str, start: float, end: float, step_s: float) -> list[dict]:
    params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
    data = _api(base, "query_range", params, post=True)
    if data.get("resultType") != "matrix":
        raise ScrapeError(f"Prometheus at {base} answered a range query with {data.get('resultType')!r}",
                          retryable=False)
    return data["result"]


def _helps(base: str, names: set[str]) -> dict[str, str]:
    """HELP text of the families the series `names` belong to; empty when this Prometheus keeps none
    (it has metadata only for targets it still scrapes)."""
    try:
        metadata = _api(base, "metadata", {})
    except ScrapeError:
        return {}
    return {family: entries[0].get("help", "") for family, entries in metadata.items()
            if entries and any(n == family or n.startswith(family + "_") for n in names)}


def _api(base: str, path: str, params: dict, post: bool = False) -> dict:
    """`data` of a Prometheus /api/v1 answer, or a ScrapeError that says what went wrong where."""
    url = f"{base}/api/v1/{path}"
    try:
        with http_client(base, TIMEOUT_S) as client:
            response = client.post(url, data=params) if post else client.get(url, params=params)
    except httpx.UnsupportedProtocol as e:
        raise ValueError(f"cannot reach Prometheus at {base}: {e}") from e
    except HTTP_ERRORS as e:  # refused, timed out, reset
        raise ScrapeError(f"cannot reach Prometheus at {base}: {e}") from e
    answer = _json(response.content, url, status=response.status_code)
    if answer.get("status") != "success":
        raise ScrapeError(f"Prometheus at {base} refused {path} {params.get('query', '')}: "
                          f"{answer.get('errorType', 'error')}: {answer.get('error', answer)}", retryable=False)
    return answer["data"]


def _json(raw: bytes, url: str, status: int = 200) -> dict:
    try:
        answer = json.loads(raw)
    except ValueError:
        raise ScrapeError(f"{url} (HTTP {status}) did not answer in JSON: is it a Prometheus server?",
                          retryable=False) from None
    if not isinstance(answer, dict):
        raise ScrapeError(f"{url} (HTTP {status}) did not answer like the Prometheus HTTP API", retryable=False)
    return answer


def _check_one_server(series: list[dict], selector: str, base: str) -> None:
    servers = sorted({(s["metric"].get("job", ""), s["metric"].get("instance", "")) for s in series})
    if len(servers) > 1:
        named = ", ".join(f'job="{job}" instance="{instance}"' for job, instance in servers)
        raise ScrapeError(f"{selector} matches {len(servers)} servers on Prometheus at {base} ({named}): "
                          "add an instance=\"...\" matcher to pick one", retryable=False)


def _sample_line(metric: dict[str, str]) -> str:
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(metric.items())
                      if k != "__name__" and k not in TARGET_LABELS)
    return f"{metric['__name__']}{{{labels}}}" if labels else metric["__name__"]


def _exposition(sample_lines: list[str], helps: dict[str, str]) -> str:
    help_lines = [f"# HELP {name} {text.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}"
                  for name, text in helps.items()]
    return "\n".join(help_lines + sample_lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
