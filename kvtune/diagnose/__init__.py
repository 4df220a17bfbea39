"""Fault diagnosis: the fault card's rules (F1–F8) over a run's series, client latencies and workload profile.

`diagnose(result)` -> [Diagnosis], worst first; `diagnose(result, error=...)`
for a failed run. `add_diagnose_command(subparsers)` wires `kvtune diagnose`.
"""
from .model import INSUFFICIENT_DATA, SEVERITIES, Diagnosis, Evidence, FlagChange, Thresholds
from .run import RULES, diagnose
from .cli import add_diagnose_command

__all__ = ["INSUFFICIENT_DATA", "RULES", "SEVERITIES", "Diagnosis", "Evidence", "FlagChange", "Thresholds",
           "add_diagnose_command", "diagnose"]
