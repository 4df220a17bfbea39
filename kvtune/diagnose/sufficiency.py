"""Too little data to judge: say so instead of guessing."""
from __future__ import annotations

from ..results import RunResult
from .model import INSUFFICIENT_DATA, Diagnosis, Evidence, Thresholds
from .signals import Series


def data_gaps(result: RunResult, th: Thresholds) -> list[Evidence]:
    """What is missing for the rules to mean anything; empty when the run is enough."""
    series = Series(result.series)
    if not len(series):
        return [Evidence("server series", "run", 0, "steps or scrapes of the server's metrics")]
    gaps = []
    if len(series) < th.min_samples:
        gaps.append(Evidence("server samples", series.whole(), len(series), f">= {th.min_samples}"))
    if series.span_s < th.min_duration_s:
        gaps.append(Evidence("run length (s)", series.whole(), round(series.span_s, 2), f">= {th.min_duration_s:g}"))
    finished, source = finished_requests(result, series)
    if finished < th.min_requests:
        gaps.append(Evidence(source, series.whole(), finished, f">= {th.min_requests}"))
    return gaps


def finished_requests(result: RunResult, series: Series) -> tuple[int, str]:
    if result.requests:
        return sum(r.ok for r in result.requests), "completed requests (clients)"
    return int(series.total("requests_finished") or 0), "finished requests (vllm:request_success_total)"


TOO_LITTLE = "the run is too short or too idle to tell a fault from noise"
MORE_DATA = "diagnose a longer run with more traffic (or lower the limits with --threshold)"


def insufficient(gaps: list[Evidence], cause: str = TOO_LITTLE, fix: str = MORE_DATA) -> Diagnosis:
    return Diagnosis(INSUFFICIENT_DATA, "info", "insufficient data: no diagnosis made", gaps, cause, fix)
