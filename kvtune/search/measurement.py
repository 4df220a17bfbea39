"""What the search measured, as data: one run of a config (`Measurement`), a config across both
stages with its live runs combined into means and intervals (`Candidate`, `combine`), and how a
config met the SLOs (`misses`, `tier`, `meets_in`) and ranks on its own figures (`rank_key`).
The verdict on these is `ranking.choose`'s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..results import SUMMARY_FIGURES
from .slo import SLO
from .stats import Interval, interval

FAILED_REQUESTS = "failed_requests"  # the constraint scoring adds when requests errored
SPREAD_KEYS = ("goodput_rps", "throughput_rps")
SUMMARY_MEANS = SUMMARY_FIGURES  # a config's figures over its repeats: the means of its runs' own
EVERY_RUN, ON_AVERAGE, MISSED = 0, 1, 2  # how a config met the SLOs: `tier`'s values, best first


@dataclass
class Measurement:
    """One config measured once: a stage-1 trial (sim) or one stage-2 run (live)."""
    stage: str  # sim | live
    number: int  # the trial number; -1 for the target's default when stage 1 never ran it
    params: dict
    state: str  # COMPLETE | FAIL | RUNNING | ...
    values: list[float] | None = None
    constraints: dict[str, float] = field(default_factory=dict)  # name -> observed - limit (<= 0 ok)
    run_id: int | None = None
    reason: str | None = None  # why it failed
    duplicate_of: int | None = None  # the trial whose measurement this one reused
    surplus: bool = False  # a slot another process took; never ran
    goodput_rps: float | None = None
    throughput_rps: float | None = None
    observed: dict[str, float | None] = field(default_factory=dict)  # SLO name -> seconds
    summary: dict = field(default_factory=dict)  # the run's figures: ttft_p95, tpot_p95, ...
    target: str | None = None  # what ran it: sim, engine, vllm, sglang
    measured_on: str | None = None  # in words: "the simulator", "vLLM 0.32.0 (cpu)", ...
    repeat: int = 1  # which run of this config (live)
    doubts: list[str] = field(default_factory=list)  # why this run's figures may not be trusted
    slot: dict | None = None  # live on a Ray cluster: the node and GPUs it ran on (cluster.slots.Slot)

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETE" and bool(self.values)

    @property
    def feasible(self) -> bool:
        return self.ok and all(v <= 0 for v in self.constraints.values())

    @property
    def value(self) -> float | None:
        return self.values[0] if self.values else None

    @property
    def failed_requests(self) -> int:
        return int(max(self.constraints.get(FAILED_REQUESTS, 0), 0))


@dataclass
class Candidate:
    """A config, with its stage-1 measurement and its stage-2 runs where they exist."""
    label: str  # "trial 7" or "vLLM default"
    params: dict
    sim: Measurement | None = None
    live: Measurement | None = None  # the live runs' means (what tables show), or the failed run
    is_default: bool = False
    runs: list[Measurement] = field(default_factory=list)  # every live run of this config
    spread: dict[str, Interval] = field(default_factory=dict)  # value, goodput_rps, an SLO's name... -> interval

    def on(self, stage: str) -> Measurement | None:
        """Its measurement on `stage`: live, its runs' means (or its failed run); sim, its stage-1 trial."""
        return self.live if stage == "live" else self.sim

    @property
    def measured(self) -> Measurement | None:
        """The measurement that counts: live when it completed, else sim."""
        for m in (self.live, self.sim):
            if m is not None and m.ok:
                return m
        return self.live or self.sim

    def figure(self, key: str, stage: str) -> float | None:
        """One figure of this config on `stage` (sim or live), the one every table shows: the mean of
        its live runs' interval where stage 2 measured it (an SLO's figure is its client-side
        observation), else its measurement's own."""
        m = self.on(stage)
        if m is None or not m.ok:
            return None
        if stage == "live" and key in self.spread:
            return self.spread[key].mean
        return getattr(m, key) if key in ("goodput_rps", "throughput_rps") else m.summary.get(key)


@dataclass
class Miss:
    slo: str  # an SLO's name, or failed_requests
    observed: float | None  # seconds (a count for failed_requests); None: nothing completed
    limit: float | None

    @property
    def ratio(self) -> float | None:
        if self.observed is None or not self.limit:
            return None
        return self.observed / self.limit - 1


def misses(m: Measurement, slos: list[SLO]) -> list[Miss]:
    out = []
    for slo in slos:
        observed = m.observed.get(slo.name)
        if observed is None or observed > slo.threshold_s:
            out.append(Miss(slo.name, observed, slo.threshold_s))
    if m.failed_requests:
        out.append(Miss(FAILED_REQUESTS, float(m.failed_requests), None))
    return out


def miss_score(m: Measurement, slos: list[SLO]) -> float:
    """How far a config is from meeting every SLO: the sum of its relative misses."""
    total = 0.0
    for miss in misses(m, slos):
        if miss.slo == FAILED_REQUESTS:
            total += miss.observed / max(m.summary.get("requests") or 1, 1)
        else:
            total += miss.ratio if miss.ratio is not None else 1e3
    return total


def rank_key(m: Measurement, slos: list[SLO]):
    """Feasible first by the objective (its first value is always maximised), then the nearest misses."""
    if m.feasible:
        return (0, -(m.value if m.value is not None and math.isfinite(m.value) else -math.inf), m.number)
    return (1, miss_score(m, slos), m.number)


def meets_in(c: Candidate) -> tuple[int, int]:
    """(runs that met every SLO, runs completed) of a live config."""
    done = [m for m in c.runs if m.ok]
    return sum(1 for m in done if m.feasible), len(done)


def tier(c: Candidate, stage: str) -> int:
    """How `c` met the SLOs on `stage`: EVERY_RUN; ON_AVERAGE (its means meet them, some run missed:
    fragile); MISSED (its means miss them). A simulated trial is one run: it met them or not."""
    m = c.on(stage)
    if m is None or not m.feasible:
        return MISSED
    met, done = meets_in(c) if stage == "live" else (1, 1)
    return EVERY_RUN if met == done else ON_AVERAGE


# ---------------------------------------------------------------- repeats -> one config's figures

def combine(runs: list[Measurement], slos: list[SLO]) -> tuple[Measurement, dict[str, Interval]]:
    """A config's live runs as one measurement (the means) and the intervals around them."""
    done = [m for m in runs if m.ok]
    if not done:
        return runs[-1], {}
    spread = {"value": interval([m.value for m in done])}
    spread |= {key: interval([getattr(m, key) for m in done]) for key in SPREAD_KEYS}
    spread |= {slo.name: interval([m.observed.get(slo.name) for m in done]) for slo in slos}
    spread |= {key: interval([m.summary.get(key) for m in done])
               for key in ("ttft_p95", "tpot_p95", "e2e_p95") if key not in spread}  # an SLO's own comes first
    mid = sorted(done, key=lambda m: m.value)[(len(done) - 1) // 2]  # the median run: the one plotted
    values = [float(np.mean([m.values[i] for m in done])) for i in range(len(done[0].values))]
    observed = {slo.name: _mean_or_none(spread[slo.name]) for slo in slos}
    constraints = {slo.name: (observed[slo.name] - slo.threshold_s) if observed[slo.name] is not None else 1e9
                   for slo in slos}
    failed = float(np.mean([m.failed_requests for m in done]))
    if failed:
        constraints[FAILED_REQUESTS] = failed
    summary = {k: _mean([m.summary.get(k) for m in done]) for k in SUMMARY_MEANS}
    doubts = list(dict.fromkeys(d for m in runs for d in m.doubts))
    merged = Measurement(stage="live", number=mid.number, params=dict(mid.params), state="COMPLETE", values=values,
                         constraints=constraints, run_id=mid.run_id, goodput_rps=_mean_or_none(spread["goodput_rps"]),
                         throughput_rps=_mean_or_none(spread["throughput_rps"]), observed=observed, summary=summary,
                         target=mid.target, measured_on=mid.measured_on, repeat=len(done), doubts=doubts)
    return merged, {k: v for k, v in spread.items() if v is not None}


def _mean(values) -> float | None:
    xs = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return float(np.mean(xs)) if xs else None


def _mean_or_none(iv: Interval | None) -> float | None:
    return None if iv is None else iv.mean
