"""The report's vocabulary: how objectives, SLOs, knobs and configs are named for an ops reader."""
from __future__ import annotations

from ..search.slo import SLO
from . import fmt
from ..search.report_data import StudyInfo
from ..search.measurement import FAILED_REQUESTS, Measurement, Miss

OBJECTIVES = {
    "goodput": "goodput: requests per second that meet every SLO",
    "throughput": "throughput: completed requests per second",
    "multi": "throughput and {latency} together (a Pareto front: no config on it is beaten on both)",
    "capacity": "capacity: the highest request rate, as a multiple of the trace's rate, that still meets the SLOs",
}
METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "end-to-end latency"}
GLOSSARY = [
    "**TTFT** (time to first token): how long a user waits before the answer starts streaming.",
    "**TPOT** (time per output token): the average gap between streamed tokens after the first.",
    "**p95**: 95 % of requests were at or below this value.",
    "**goodput**: requests per second that met every SLO; **throughput** counts all completed requests.",
    ("**KV cache**: GPU memory holding each running request's attention keys and values, in fixed-size "
     "**blocks** of `block_size` tokens; when it is full, new requests wait and running ones may be "
     "**preempted** (paused and recomputed later)."),
    "**prefix hit rate**: share of prompt tokens served from the cache instead of being recomputed.",
    ("**stage 1** runs on kvtune's simulator (the engine's real scheduler and KV cache, modelled step "
     "times); **stage 2** runs the best configs and the target's default several times each, interleaved, "
     "on the live target."),
    ("**[lo, hi]**: the Student-t 95 % interval of a mean over repeated runs. A config beats the default "
     "only where a one-sided Welch t-test says so, Holm-corrected over the configs compared and with the "
     "5 % error budget split over stage 2's looks; the verdict gives the p-value and the difference's interval."),
]


def objective_text(info: StudyInfo) -> str:
    return OBJECTIVES.get(info.objective, info.objective).format(latency=metric_label(info.latency))


def value_label(info: StudyInfo) -> str:
    """The y axis of the objective's first value."""
    if info.objective == "capacity":
        return "capacity (× trace rate)"
    return "goodput (req/s)" if info.objective == "goodput" else "throughput (req/s)"


def value_text(info: StudyInfo, value: float | None) -> str:
    if info.objective == "capacity":
        return fmt.MISSING if value is None else f"×{value:.2f}"
    return fmt.rps(value)


def metric_label(name: str) -> str:
    """ttft_p95 -> 'TTFT p95'."""
    metric, _, pct = name.partition("_")
    return f"{METRIC_NAMES.get(metric, metric)} {pct}".strip()


def slo_text(slo: SLO) -> str:
    return f"{metric_label(slo.name)} ≤ {fmt.ms(slo.threshold_s)}"


def params_text(params: dict) -> str:
    return ", ".join(f"`{k}` {fmt.param(k, v)}" for k, v in params.items())


def status(m: Measurement | None) -> str:
    if m is None:
        return "not run"
    if m.surplus:
        return "not run (slot taken by another worker)"
    if m.state == "FAIL":
        return "failed"
    if not m.ok:
        return m.state.lower()
    return "meets SLOs" if m.feasible else "misses SLOs"


def row_kind(m: Measurement | None) -> str:
    if m is None or not m.ok:
        return "failed"
    return "ok" if m.feasible else "bad"


def miss_text(miss: Miss) -> str:
    if miss.slo == FAILED_REQUESTS:
        return f"{int(miss.observed)} requests failed (errors or timeouts)"
    if miss.observed is None:
        return f"{metric_label(miss.slo)}: no request completed (limit {fmt.ms(miss.limit)})"
    over = f"+{miss.ratio * 100:.0f} %" if miss.ratio < 1 else f"{miss.observed / miss.limit:,.1f}× the limit"
    return (f"{metric_label(miss.slo)} {fmt.ms(miss.observed)} vs the {fmt.ms(miss.limit)} limit "
            f"({over}, {fmt.ms(miss.observed - miss.limit)} over)")
