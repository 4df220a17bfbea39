"""The search: an Optuna study over the KV-cache knobs, stage 1 on the sim target,
stage 2 on a live one; `run_search` (flow.py) runs the whole of it."""
from ..lazy import exports_of, lazy_face

EXPORTS = exports_of({
    ".flow": ("SearchError", "SearchOutcome", "SearchRequest", "run_search"),
    ".objective": ("OBJECTIVES", "Objective"),
    ".slo": ("SLO", "Score", "parse_slo", "score"),
    ".space": ("SearchSpace", "load_space"),
    ".stage2": ("LiveConfig", "run_stage2"),
    ".study": ("Stage1", "open_storage", "open_study", "ranked_trials"),
})
__getattr__, __dir__ = lazy_face(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
