"""`diagnose(result)`: every fault rule over one run, worst first."""
from __future__ import annotations

from ..results import RunResult
from .capacity import context_overcommit, head_of_line_blocking, preemption_thrash
from .decode import bandwidth_bound_decode, memory_bound_throughput
from .facts import gather
from .model import SEVERITIES, Diagnosis, Evidence, Thresholds
from .prefix import low_prefix_hits, session_reprefill
from .startup import failed_start, log_path_of, oom_during_run, start_cause
from .sufficiency import data_gaps, insufficient

RULES = {
    "F1": head_of_line_blocking,
    "F2": bandwidth_bound_decode,
    "F3": memory_bound_throughput,
    "F4": low_prefix_hits,
    "F5": oom_during_run,
    "F6": preemption_thrash,
    "F7": session_reprefill,
    "F8": context_overcommit,
}


def diagnose(result: RunResult, thresholds: Thresholds | None = None, error: str | None = None) -> list[Diagnosis]:
    """The faults the run shows, critical first; `error` (a failed run's error text) diagnoses its start.

    A run with too little data gives one INSUFFICIENT_DATA diagnosis and nothing else.
    """
    th = thresholds or Thresholds()
    if error is not None:
        return [failed_start(result, error, th) or _failed_without_cause(error)]
    gaps = data_gaps(result, th)
    if gaps:
        return [insufficient(gaps)]
    facts = gather(result, th)
    found = [d for rule in RULES.values() if (d := rule(facts)) is not None]
    return sorted(found, key=lambda d: (SEVERITIES.index(d.severity), d.id))


def _failed_without_cause(error: str) -> Diagnosis:
    """A failed run that is neither F5 nor START: it cites the error's root-cause line (not a wrapper
    such as "the server exited with status 1") and the server's kept log."""
    cause = start_cause(error)[:300] or "(no error text)"
    evidence = [Evidence("run error", "start-up log", cause, "a memory error (F5) or a refused config (START)")]
    path = log_path_of(error)
    if path:
        evidence.append(Evidence("full log", "start-up", path, "kept"))
    return insufficient(evidence, cause="the run failed, not for lack of memory, and left no series to diagnose",
                        fix="read the cited line" + (f" and the full log ({path})" if path else "")
                            + ": it is not a KV-cache fault")
