"""SLOs, and how a run scores against them.

`--slo ttft_p95=500ms` says two things, as `vllm bench serve --goodput` and
DistServe read it: the run's p95 TTFT must be at most 500 ms (an Optuna
constraint), and a request counts towards goodput only if its own TTFT is at
most 500 ms. Per request, TPOT and E2E are its own values; ITL is the
request's own gaps at the SLO's percentile.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import numpy as np

from ..diagnose import Thresholds

from ..results import RequestRecord, RunResult

METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 95, 99)
_SLO = re.compile(r"^(ttft|tpot|itl|e2e)_p(50|90|95|99)=(\d+(?:\.\d+)?)(ms|s)$")


class SLOError(ValueError):
    """An --slo value that cannot be parsed."""


@dataclass(frozen=True)
class SLO:
    metric: str
    percentile: int
    threshold_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.percentile}"

    def __str__(self) -> str:
        return f"{self.name} <= {self.threshold_s * 1000:g} ms"

    def request_value(self, rec: RequestRecord) -> float | None:
        if self.metric == "itl":
            return float(np.percentile(rec.itl_s, self.percentile)) if rec.itl_s else 0.0
        return getattr(rec, f"{self.metric}_s")


def parse_slo(text: str) -> SLO:
    m = _SLO.match(text.strip().replace(" ", ""))
    if not m:
        raise SLOError(f"--slo {text}: expected METRIC_pPCT=VALUE with METRIC one of {', '.join(METRICS)}, "
                       f"PCT one of {', '.join(map(str, PERCENTILES))} and VALUE in ms or s, "
                       "e.g. ttft_p95=500ms or e2e_p99=10s")
    metric, pct, value, unit = m.groups()
    threshold = float(value) / (1000 if unit == "ms" else 1)
    if threshold <= 0:
        raise SLOError(f"--slo {text}: the threshold must be above 0")
    return SLO(metric, int(pct), threshold)


_STORED_TEXT = re.compile(r"^(ttft|tpot|itl|e2e)_p(\d+)\s*<=\s*([0-9.eE+-]+)\s*ms$")


def study_slos_from_attrs(attrs: dict) -> list[SLO]:
    """A study's SLOs as the search stored them (its user attrs); a study from before it stored them
    whole is read back from their text (str(SLO): 'ttft_p95 <= 500 ms')."""
    if attrs.get("slo_specs") is not None:
        return [SLO(d["metric"], int(d["percentile"]), float(d["threshold_s"])) for d in attrs["slo_specs"]]
    slos = []
    for text in attrs.get("slos") or []:
        m = _STORED_TEXT.match(text.strip())
        if not m:
            raise SLOError(f"cannot read the study's SLO {text!r}; expected e.g. 'ttft_p95 <= 500 ms'")
        metric, pct, value = m.groups()
        slos.append(SLO(metric, int(pct), float(value) / 1000))
    return slos


@dataclass
class Score:
    goodput_rps: float
    throughput_rps: float
    output_tok_s: float
    completed: int
    requests: int
    good: int
    observed: dict[str, float | None] = field(default_factory=dict)  # SLO name -> run percentile
    violations: dict[str, float] = field(default_factory=dict)  # SLO name -> observed - threshold (<= 0 ok)

    @property
    def feasible(self) -> bool:
        return all(v <= 0 for v in self.violations.values())

    def as_dict(self) -> dict:
        return {"goodput_rps": self.goodput_rps, "throughput_rps": self.throughput_rps,
                "output_tok_s": self.output_tok_s, "completed": self.completed, "requests": self.requests,
                "good": self.good, "observed": self.observed, "violations": self.violations,
                "feasible": self.feasible}


def score(result: RunResult, slos: list[SLO]) -> Score:
    ok = [r for r in result.requests if r.ok]
    duration = result.duration_s or 0.0
    good = [r for r in ok if all(_meets(slo, r) for slo in slos)]
    observed, violations = {}, {}
    for slo in slos:
        values = [v for v in (slo.request_value(r) for r in ok) if v is not None]
        if slo.metric == "itl":
            values = [g for r in ok for g in r.itl_s]
        value = float(np.percentile(values, slo.percentile)) if values else None
        observed[slo.name] = value
        # Nothing completed is the worst violation there is, not a pass.
        violations[slo.name] = (value - slo.threshold_s) if value is not None else float(1e9)
    failed = sum(1 for r in result.requests if r.error and r.finish_reason != "rejected")
    if failed:  # requests that errored or timed out (prompts over max_model_len fail every config alike)
        violations["failed_requests"] = float(failed)
    rate = 1.0 / duration if duration > 0 else 0.0
    return Score(goodput_rps=len(good) * rate, throughput_rps=len(ok) * rate,
                 output_tok_s=sum(r.output_tokens for r in ok) * rate, completed=len(ok),
                 requests=len(result.requests), good=len(good), observed=observed, violations=violations)


def diagnosis_thresholds(slos: list[SLO], base: Thresholds | None = None) -> Thresholds:
    """The fault rules' TTFT limit is the study's own TTFT p95 SLO where it has one."""
    base = base or Thresholds()
    ttft = next((s for s in slos if s.name == "ttft_p95"), None)
    return replace(base, ttft_p95_slo_s=ttft.threshold_s) if ttft else base


def _meets(slo: SLO, rec: RequestRecord) -> bool:
    value = slo.request_value(rec)
    return value is not None and value <= slo.threshold_s
