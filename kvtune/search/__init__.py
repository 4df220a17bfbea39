"""The search: an Optuna study over the KV-cache knobs, stage 1 on the sim target,
stage 2 on a live one (see cli.py for the flow)."""
from .objective import OBJECTIVES, Objective
from .slo import SLO, Score, parse_slo, score
from .space import SearchSpace, load_space
from .stage2 import Candidate, run_stage2
from .study import Stage1, open_storage, open_study, ranked_trials

__all__ = ["OBJECTIVES", "SLO", "Candidate", "Objective", "Score", "SearchSpace", "Stage1", "load_space",
           "open_storage", "open_study", "parse_slo", "ranked_trials", "run_stage2", "score"]
