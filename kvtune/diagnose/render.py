"""Diagnoses as a table by severity (with evidence rows and the fix), and as JSON.

Every report also shows the KV pool itself, as the fault card asks: used and
free blocks, the hit rate, preemptions, and what a contiguous worst-case
reservation at max_model_len would hold in the same pool.
"""
from __future__ import annotations

import math

from kvengine.core.memory import max_concurrency

from ..results import RunResult
from .facts import RunFacts
from .model import SEVERITIES, Diagnosis

HEADER = ("metric", "window", "value", "threshold")
WIDEST_VALUE = 100  # an error message as evidence: the table shows its start, the JSON all of it


def show(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float) and math.isfinite(value) and abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def evidence_table(diagnosis: Diagnosis, indent: str = "    ") -> list[str]:
    rows = [HEADER] + [(e.metric, e.window, _clip(show(e.value)), e.threshold) for e in diagnosis.evidence]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3]
            for row in rows]


def _clip(text: str) -> str:
    return text if len(text) <= WIDEST_VALUE else text[:WIDEST_VALUE - 1] + "…"


def format_diagnoses(diagnoses: list[Diagnosis]) -> str:
    if not diagnoses:
        return "no faults found: none of the rules F1–F8 fired"
    lines = []
    for severity in SEVERITIES:
        for d in (d for d in diagnoses if d.severity == severity):
            lines += [f"{severity.upper():<9} {d.id}  {d.symptom}", *evidence_table(d),
                      f"    cause: {d.cause}", f"    fix:   {d.fix}", *trial_lines(d), ""]
    counts = ", ".join(f"{sum(d.severity == s for d in diagnoses)} {s}" for s in SEVERITIES)
    lines.append(f"{len(diagnoses)} finding{'s' * (len(diagnoses) != 1)}: {counts}")
    return "\n".join(lines)


def trial_lines(d: Diagnosis, indent: str = "    ") -> list[str]:
    """What each proposed change did when the simulator tried it (the fix line keeps those that helped)."""
    return [f"{indent}{'tried:' if i == 0 else '':<6} {t.verdict}: {t.change}: {t.note}"
            for i, t in enumerate(d.tried)]


def pool_overview(f: RunFacts) -> list[str]:
    """The KV figures every report shows, whatever fired."""
    s, pool = f.series, f.pool
    lines = []
    usage_peak, usage_mean = s.peak("kv_usage"), s.time_mean("kv_usage")
    if pool is not None:
        usable = pool.num_gpu_blocks - 1  # vLLM's usage leaves out the null block
        used = round((usage_peak or 0) * usable)
        lines.append(f"KV pool      {pool.tokens:,} tokens = {pool.num_gpu_blocks:,} blocks of {pool.block_size} "
                     f"({pool.source}); peak {used:,} blocks used, {usable - used:,} free")
    if usage_peak is not None:
        lines.append(f"KV usage     peak {usage_peak:.1%}, mean {usage_mean or 0:.1%}")
    hit, ideal = f.hit_rate, f.ideal_hit_rate
    lines.append(f"prefix hits  {_pct(hit)} observed, {_pct(ideal)} ideal (unbounded cache)"
                 + ("; prefix caching off" if f.prefix_caching_off else ""))
    preempted = f.preempted()
    lines.append(f"preemptions  {int(s.total('num_preemptions') or 0):,}; peak running "
                 f"{int(s.peak('num_running') or 0):,}"
                 + (f"; {preempted.text} requests preempted at least once ({preempted.source})"
                    if preempted is not None and preempted.requests else ""))
    max_len = f.config.get("max_model_len")
    if pool is not None and max_len:
        held = int(max_concurrency(pool.num_gpu_blocks, pool.block_size, int(max_len)))
        lines.append(f"contiguous   reserving max_model_len ({int(max_len):,}) per request, the same pool "
                     f"would hold {held:,} requests at once")
    return lines


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def run_title(result: RunResult, label: str) -> str:
    return f"kvtune diagnose: {label} ({result.target}: {result.model} on {result.device})"
