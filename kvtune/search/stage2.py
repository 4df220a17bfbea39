"""Stage 2: re-run the best stage-1 configs, and vLLM's default, on a live target."""
from __future__ import annotations

from dataclasses import dataclass

from kvengine.config import EngineConfig

from ..store import Store
from ..targets import TargetRunError, TargetStartError
from .objective import Objective
from .slo import Score
from .space import SearchSpace

DEFAULT_NUMBER = -1  # the trials table's number for vLLM's default config when stage 1 never ran it


@dataclass
class Candidate:
    label: str  # "default" or "trial 17"
    number: int
    params: dict


@dataclass
class LiveOutcome:
    candidate: Candidate
    values: list[float] | None = None
    score: Score | None = None
    run_id: int | None = None
    error: str | None = None


def default_params(space: SearchSpace, default: EngineConfig) -> dict:
    """vLLM's default config, in the space's knobs."""
    return {name: getattr(default, name) for name in space.names}


def representable(space: SearchSpace, params: dict) -> bool:
    """Whether Optuna can take these params as a trial of this space."""
    for knob in space.knobs:
        value = params[knob.name]
        if knob.choices is not None and value not in knob.choices:
            return False
        if knob.choices is None and not knob.low <= value <= knob.high:
            return False
    return True


def run_stage2(run, candidates: list[Candidate], space: SearchSpace, base: EngineConfig, workload,
               objective: Objective, store: Store, study: str, on_result=None) -> list[LiveOutcome]:
    outcomes = []
    for cand in candidates:
        config = space.config(cand.params, base)
        outcome = LiveOutcome(cand)
        try:
            outcome.values, outcome.score, result = objective.evaluate(run, config, workload)
        except (TargetStartError, TargetRunError) as err:
            outcome.error = str(err)
            store.save_trial(study, cand.number, "live", "FAIL", cand.params, reason=outcome.error)
        else:
            outcome.run_id = store.save_run(result, study=study, trial=cand.number, label=f"live {cand.label}")
            store.save_trial(study, cand.number, "live", "COMPLETE", cand.params, values=outcome.values,
                             constraints=outcome.score.violations, run_id=outcome.run_id)
        outcomes.append(outcome)
        if on_result:
            on_result(outcome)
    return outcomes
