"""Which knobs mattered: Optuna's parameter importance, or a sentence saying why there is none.

Optuna 5's default evaluator (PED-ANOVA) measures what it takes to reach LOW
target values; every kvtune objective's first value is maximised, so the target
is its negation.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from ..search.ranking import SIM_TIE, within_tie

MIN_TRIALS = 10  # below this the top-quantile split of PED-ANOVA is a handful of points: noise


@dataclass
class Importance:
    values: dict[str, float] | None  # knob -> share of importance, largest first
    note: str  # what was measured, or why nothing was


def param_importance(study: optuna.Study, objective_label: str) -> Importance:
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if "duplicate_of" not in t.user_attrs]
    if len(done) < MIN_TRIALS:
        return Importance(None, f"Parameter importance needs at least {MIN_TRIALS} completed trials; "
                                f"this study has {len(done)}. Run more trials to see which knobs matter.")
    if len({t.values[0] for t in done}) < 2:
        return Importance(None, f"Every completed trial scored the same {objective_label}: "
                                "no knob made a difference on this workload.")
    low, high = min(t.values[0] for t in done), max(t.values[0] for t in done)
    if within_tie(low, high):
        # differences the simulator cannot resolve: ranking them by knob would rank its rounding
        return Importance(None, f"Every completed trial scored within {SIM_TIE:.0%} of the others by "
                                f"{objective_label}, the simulator's own tie: no knob made a difference it can "
                                "resolve on this workload.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PED-ANOVA's reminder that it ranks low targets: we negate
        try:
            values = optuna.importance.get_param_importances(study, target=lambda t: -t.values[0])
        except (ValueError, RuntimeError) as err:
            return Importance(None, f"Optuna could not compute parameter importance: {err}")
    if not values:
        return Importance(None, "Optuna found no parameter that varied across the completed trials.")
    return Importance(dict(values), f"How much each knob decides whether a trial lands among the best 10 % "
                                    f"by {objective_label} (Optuna's PED-ANOVA over {len(done)} trials; "
                                    "the shares add up to 100 %).")
