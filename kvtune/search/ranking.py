"""Which config the report recommends, and when none meets the SLOs, which one comes closest.

Stage 2 (a live server) outranks stage 1 (the simulator) whenever it completed
a run: the report recommends what the real server confirmed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..search.slo import SLO

FAILED_REQUESTS = "failed_requests"  # the constraint scoring adds when requests errored
TOP_SIM_CANDIDATES = 5  # configs compared when no stage 2 ran


@dataclass
class Measurement:
    """One config measured once: a stage-1 trial (sim) or a stage-2 re-run (live)."""
    stage: str  # sim | live
    number: int  # the trial number; -1 for vLLM's default when stage 1 never ran it
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
    """A config, with its stage-1 and stage-2 measurements where they exist."""
    label: str  # "trial 7" or "vLLM default"
    params: dict
    sim: Measurement | None = None
    live: Measurement | None = None
    is_default: bool = False

    @property
    def measured(self) -> Measurement | None:
        """The measurement that counts: live when it completed, else sim."""
        for m in (self.live, self.sim):
            if m is not None and m.ok:
                return m
        return self.live or self.sim


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


@dataclass
class Verdict:
    stage: str | None  # the stage whose numbers decided: live, sim, or None when nothing completed
    recommended: Candidate | None
    closest: Candidate | None  # only when nothing met the SLOs
    misses: list[Miss] = field(default_factory=list)  # the closest one's
    feasible_elsewhere: list[int] = field(default_factory=list)  # sim trials that met the SLOs when live did not


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


def choose(trials: list[Measurement], live: list[Measurement], slos: list[SLO],
           default_params: dict | None) -> tuple[Verdict, list[Candidate], Candidate]:
    """The verdict, the configs to compare across stages (best first, the default last), and the default."""
    sim_done = [t for t in trials if t.ok and t.duplicate_of is None]
    live_done = [m for m in live if m.ok]
    pair = _pairing(sim_done, live, default_params)
    stage, pool = ("live", live_done) if live_done else ("sim", sim_done) if sim_done else (None, [])
    ranked = sorted(pool, key=lambda m: rank_key(m, slos))
    verdict = Verdict(stage, None, None)
    if ranked and ranked[0].feasible:
        verdict.recommended = pair(ranked[0].params)
    elif ranked:
        verdict.closest = pair(ranked[0].params)
        verdict.misses = misses(ranked[0], slos)
        if stage == "live":
            verdict.feasible_elsewhere = [t.number for t in sim_done if t.feasible]
    default = pair(default_params) if default_params is not None else Candidate("vLLM default", {}, is_default=True)
    if live:
        shown = sorted(live, key=lambda m: rank_key(m, slos))
    else:
        shown = sorted(sim_done, key=lambda m: rank_key(m, slos))[:TOP_SIM_CANDIDATES]
    candidates = [c for c in (pair(m.params) for m in shown) if not c.is_default]
    return verdict, _unique(candidates) + [default], default


def _pairing(sim_done: list[Measurement], live: list[Measurement], default_params: dict | None):
    def pair(params: dict) -> Candidate:
        sim = next((t for t in sim_done if t.params == params), None)
        again = next((m for m in live if m.params == params), None)
        is_default = default_params is not None and params == default_params
        number = sim.number if sim is not None else again.number if again is not None else None
        label = "vLLM default" if is_default else f"trial {number}"
        return Candidate(label, dict(params), sim, again, is_default)
    return pair


def _unique(candidates: list[Candidate]) -> list[Candidate]:
    seen, out = [], []
    for c in candidates:
        if c.params not in seen:
            seen.append(c.params)
            out.append(c)
    return out
