"""What a trial maximises, and how one config is evaluated for it.

goodput     requests/s that meet every SLO (vllm bench serve --goodput)
throughput  completed requests/s
multi       (throughput, a latency percentile): the Pareto front
capacity    the highest rate scale of the workload that still meets the SLOs,
            by bisection over the rate (as Vidur-Search does)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvengine.config import EngineConfig

from ..results import RunResult
from ..workload import Workload, rate_scale
from .slo import SLO, Score, score

OBJECTIVES = ("goodput", "throughput", "multi", "capacity")
DIRECTIONS = {"goodput": ["maximize"], "throughput": ["maximize"], "capacity": ["maximize"],
              "multi": ["maximize", "minimize"]}


@dataclass(frozen=True)
class Objective:
    kind: str
    slos: tuple[SLO, ...]
    latency: str = "ttft_p95"  # the multi-objective's latency axis
    capacity_low: float = 0.25
    capacity_high: float = 8.0
    capacity_steps: int = 6

    def __post_init__(self):
        if self.kind not in OBJECTIVES:
            raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.kind!r}")
        if self.kind == "capacity" and not self.slos:
            raise ValueError("--objective capacity needs at least one --slo: capacity is the highest "
                             "rate that still meets them")

    @property
    def directions(self) -> list[str]:
        return DIRECTIONS[self.kind]

    def values(self, sc: Score, result: RunResult, scale: float | None = None) -> list[float]:
        if self.kind == "goodput":
            return [sc.goodput_rps]
        if self.kind == "throughput":
            return [sc.throughput_rps]
        if self.kind == "capacity":
            return [scale or 0.0]
        latency = sc.observed.get(self.latency)
        if latency is None:
            latency = result.summary.get(self.latency)
        return [sc.throughput_rps, latency if latency is not None else math.inf]

    def for_replicas(self, values: list[float], replicas: int) -> list[float]:
        """A replica's values for `replicas` of them sharing the traffic evenly: requests per second
        add up; a capacity (a rate scale of the whole workload) and a latency stay as they are."""
        if replicas == 1 or self.kind == "capacity":
            return values
        return [values[0] * replicas, *values[1:]]

    def evaluate(self, run, config: EngineConfig, workload: Workload) -> tuple[list[float], Score, RunResult]:
        """Run `config` (through `run(config, workload) -> RunResult`) and score it."""
        if self.kind != "capacity":
            result = run(config, workload)
            sc = score(result, list(self.slos))
            return self.values(sc, result), sc, result
        return self._capacity(run, config, workload)

    def _capacity(self, run, config, workload):
        def attempt(scale):
            result = run(config, rate_scale(workload, scale))
            return score(result, list(self.slos)), result

        lo, hi = self.capacity_low, self.capacity_high
        sc, result = attempt(lo)
        if not sc.feasible:
            return [0.0], sc, result  # not even the lowest rate meets the SLOs
        best = (lo, sc, result)
        sc_hi, result_hi = attempt(hi)
        if sc_hi.feasible:
            return [hi], sc_hi, result_hi
        for _ in range(self.capacity_steps):  # geometric bisection: rates span orders of magnitude
            mid = math.sqrt(lo * hi)
            sc_mid, result_mid = attempt(mid)
            if sc_mid.feasible:
                lo, best = mid, (mid, sc_mid, result_mid)
            else:
                hi = mid
        scale, sc, result = best
        return [scale], sc, result
