"""Fault diagnosis: the fault card"s rules (F1–F8) over a run"s series, client latencies and workload profile.

`diagnose(result)` -> [Diagnosis], worst first; `diagnose(result, error=...)`
for a failed run. `kvtune diagnose` is in kvtune/cli/diagnose.py.
"""
from ..lazy import exports_of, lazy_face

EXPORTS = exports_of({
    ".model": ("INSUFFICIENT_DATA", "SEVERITIES", "Diagnosis", "Evidence", "FlagChange", "Thresholds"),
    ".run": ("RULES", "diagnose"),
})
__getattr__, __dir__ = lazy_face(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
