"""A live target whose servers start on a Ray cluster's slots (`kvtune search --ray`, `kvtune run --ray`).

`RayTarget` wraps the target the flags describe (an EngineTarget, VllmTarget, SglangTarget): the
search's check and each run start its server in a Ray task (`rounds.check`, `rounds.run_round`), never
on the machine kvtune runs on. Stage 2 finds the pool through `pool` and runs its rounds in waves
(`search.stage2._Race`); everything else (`rules`, `launch`, ...) is the wrapped target's.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..targets.base import TargetRunError, TargetStartError
from .pool import RayPool


@dataclass
class RayTarget:
    target: object  # the wrapped live target; shipped to each task (it pickles)
    pool: RayPool

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def rules(self):
        return self.target.rules

    def check(self, config) -> dict:
        reported, error = self.pool.check(self.target, config)
        if error is not None:
            raise TargetStartError(error)
        return reported or {}

    def run(self, config, workload):
        """One run in a task of its own (`kvtune run --ray`; stage 2 runs whole rounds instead:
        `RayPool.run_rounds`), its slot in the result's summary["slot"]. A server that did not start
        raises TargetStartError; a run that failed, or a task Ray lost, TargetRunError."""
        from ..search.objective import Objective

        got = []
        self.pool.run_rounds(self.target, Objective("throughput", ()), [[config]], workload,
                             lambda _i, runs, error: got.append((runs, error)))
        runs, error = got[0]
        if error is not None:
            raise TargetRunError(error)
        if runs[0].error is not None:
            raise (TargetStartError if runs[0].start_failed else TargetRunError)(runs[0].error)
        return runs[0].result

    @property
    def size(self) -> int:
        """Rounds that can run at once."""
        return self.pool.size

    def run_rounds(self, objective, configs: list[list], workload, on_round) -> None:
        """`RayPool.run_rounds` of this target (stage 2's waves)."""
        self.pool.run_rounds(self.target, objective, configs, workload, on_round)

    def close(self) -> None:
        """Nothing is kept running between tasks: each task stops what it started."""

    def __getattr__(self, name):
        if name == "target":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.target, name)
