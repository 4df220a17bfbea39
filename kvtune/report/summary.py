"""Section 1: what to run, how much better it is than vLLM's default, and the commands to start it.

When nothing met the SLOs, the top says so, names the closest config, by how
much it misses each SLO, and why (its diagnoses).
"""
from __future__ import annotations

from collections import Counter

from ..diagnose import Diagnosis
from . import fmt
from .data import ReportData
from .document import Block, Bullets, Callout, Code, Heading, Paragraph, Table
from .launch import LaunchCommand, model_export
from .verdict import Candidate, Measurement
from .words import (
    GLOSSARY,
    metric_label,
    miss_text,
    objective_text,
    params_text,
    slo_text,
    value_text,
)

COMPARED = (("goodput", "goodput_rps", fmt.rps), ("throughput", "throughput_rps", fmt.rps),
            ("output tokens", "output_tok_s", fmt.tok_s), ("TTFT p95", "ttft_p95", fmt.ms),
            ("TPOT p95", "tpot_p95", fmt.ms), ("end-to-end p95", "e2e_p95", fmt.ms),
            ("prefix hit rate", "prefix_hit_rate", fmt.pct), ("KV usage peak", "kv_usage_peak", fmt.pct),
            ("preemptions", "preemptions", fmt.count))
LOWER_IS_BETTER = {"ttft_p95", "tpot_p95", "e2e_p95", "preemptions"}
NEUTRAL = {"kv_usage_peak"}  # more KV in use is neither good nor bad by itself
SERIOUS = ("critical", "warning")
NEAR_TIE = 0.01  # objective values this close are within run-to-run noise
OVERLOAD_FACTOR, OVERLOAD_SLACK_S = 2.0, 30.0  # finishing after 2x the trace's span + 30 s: the queue only grew


def summary_section(data: ReportData, commands: list[LaunchCommand], served_model: str | None,
                    headline_diagnoses: list[Diagnosis]) -> list[Block]:
    blocks: list[Block] = [Heading("1. Summary"), Paragraph(_scope(data)), _verdict(data, headline_diagnoses)]
    head = data.headline
    if head is not None:
        blocks += _versus_default(data, head)
        blocks += _commands(data, head, commands, served_model)
    blocks += [Heading("Terms used", 3), Bullets(GLOSSARY)]
    return blocks


def _scope(data: ReportData) -> str:
    info = data.info
    ran = [t for t in data.trials if not t.surplus]
    failed = sum(t.state == "FAIL" for t in ran)
    text = (f"Study **{info.name}** tuned the KV cache of `{info.preset}` on `{info.device}`"
            + (f" for the workload `{info.workload}`" if info.workload else "") + ". "
            f"Objective: {objective_text(info)}. "
            + (f"SLOs: {', '.join(slo_text(s) for s in info.slos)}. " if info.slos else "No SLOs were set. ")
            + f"Stage 1 ran {len(ran)} trials on the simulator ({failed} failed). ")
    if data.live:
        targets = sorted({m.target for m in data.live if m.target})
        text += (f"Stage 2 re-ran {len(data.live)} configs on a live server "
                 f"({', '.join(targets) or 'target unknown'}).")
    else:
        text += "Stage 2 (live re-runs) did not run: every number below comes from the simulator."
    return text


def _verdict(data: ReportData, diagnoses: list[Diagnosis]) -> Callout:
    v, info = data.verdict, data.info
    where = "on the live server" if v.stage == "live" else "on the simulator"
    if v.recommended is not None:
        rec = v.recommended
        title = ("vLLM's default config is already the best one found: keep it." if rec.is_default
                 else f"Recommended: {rec.label}, which meets every SLO {where}." if info.slos
                 else f"Recommended: {rec.label}, the best {where}.")
        lines = [params_text(rec.params), _headline_figures(data, rec.measured)]
        return Callout("ok", title, lines + _near_ties(data, rec))
    if v.closest is not None:
        lines = [f"The closest is **{v.closest.label}** ({params_text(v.closest.params)}). It misses:",
                 *(f"• {miss_text(m)}" for m in v.misses)]
        if v.feasible_elsewhere:
            lines.append("On the simulator, trials " + ", ".join(map(str, v.feasible_elsewhere)) +
                         " did meet the SLOs; the live server did not confirm them.")
        lines += _why(diagnoses, _overload(data, v.closest))
        return Callout("warn", f"No configuration met the SLOs {where}.", lines)
    reasons = Counter(t.reason or "no reason recorded" for t in data.trials if t.state == "FAIL")
    return Callout("warn", "No trial completed: every configuration failed to run.",
                   [f"• {count}× {reason}" for reason, count in reasons.most_common(5)])


def _near_ties(data: ReportData, rec: Candidate) -> list[str]:
    """Say so when the choice barely matters: ops may then prefer the config closest to what they run."""
    best = rec.measured
    pool = data.live if data.verdict.stage == "live" else [t for t in data.trials if t.duplicate_of is None]
    close = [m for m in pool if m.feasible and m is not best and m.value is not None and best.value
             and m.value >= best.value * (1 - NEAR_TIE)]
    if not close:
        return []
    text = (f"{len(close)} other config{'s' if len(close) > 1 else ''} scored within {NEAR_TIE * 100:.0f} % of it: "
            "on this workload these knobs matter little, so any of them (see section 2) is as good.")
    if any(m.params == data.default.params for m in close):
        text += " vLLM's default is one of them: changing the config gains little here."
    return [text]


def _why(diagnoses: list[Diagnosis], overload: str | None) -> list[str]:
    serious = [d for d in diagnoses if d.severity in SERIOUS]
    lines = [overload] if overload else []
    if serious:
        return lines + ["Why (its diagnoses, see section 5):",
                        *(f"• **{d.id}** ({d.severity}) {d.symptom}. Fix: {d.fix}" for d in serious[:3])]
    if not overload:
        lines.append("Its run shows no critical or warning fault from the fault card: the SLOs may simply be out "
                     "of reach for this model, device and traffic. Relax them, add capacity, or lower the rate.")
    return lines


def _overload(data: ReportData, closest: Candidate) -> str | None:
    """The plainest 'why': the server needed far longer than the trace lasts to finish its requests."""
    run = data.best_run.result if data.best_run is not None else None
    if run is None or not run.duration_s:
        return None
    span, count = run.workload.get("duration_s") or 0.0, run.workload.get("requests") or len(run.requests)
    if run.duration_s <= OVERLOAD_FACTOR * span + OVERLOAD_SLACK_S:
        return None  # only a drain tail: every trace ends with requests still running
    return (f"The trace's {count:,} requests arrive over {span:,.1f} s, but this config needed "
            f"{run.duration_s:,.1f} s to finish them: the server is overloaded, so requests queue. No setting "
            "of these knobs fixes that alone: add GPUs or replicas, use a larger GPU, or lower the request rate.")


def _headline_figures(data: ReportData, m: Measurement | None) -> str:
    if m is None:
        return "It has no measurement."
    parts = [f"capacity {value_text(data.info, m.value)} the trace's rate"] if data.info.objective == "capacity" else []
    parts += [f"goodput {fmt.rps(m.goodput_rps)}", f"throughput {fmt.rps(m.throughput_rps)}"]
    parts += [f"{metric_label(s.name)} {fmt.ms(m.observed.get(s.name))} (limit {fmt.ms(s.threshold_s)})"
              for s in data.info.slos]
    return f"Measured ({'live server' if m.stage == 'live' else 'simulator'}): " + ", ".join(parts) + "."


def _same_stage(data: ReportData, head: Candidate) -> tuple[Measurement | None, Measurement | None, str]:
    """The headline's and the default's measurements from one stage, live when both have one."""
    d = data.default
    for stage in ("live", "sim"):
        a, b = getattr(head, stage), getattr(d, stage)
        if a is not None and a.ok and b is not None and b.ok:
            return a, b, stage
    m = head.measured
    return m, None, m.stage if m else "sim"


def _versus_default(data: ReportData, head: Candidate) -> list[Block]:
    if head.is_default:
        return []
    mine, theirs, stage = _same_stage(data, head)
    if mine is None:
        return []
    title = Heading(f"{head.label} vs vLLM's default config ({'live server' if stage == 'live' else 'simulator'})", 3)
    if theirs is None:
        return [title, Paragraph("vLLM's default config was not measured in this study, so there is nothing to "
                                 "compare against.")]
    rows = []
    for label, key, show in COMPARED:
        new, old = _figure(mine, key), _figure(theirs, key)
        rows.append([label, show(new), show(old), _change(key, new, old)])
    rows.append(["meets the SLOs", "yes" if mine.feasible else "no", "yes" if theirs.feasible else "no", ""])
    return [title, Paragraph("Default: " + params_text(data.default.params) + "."),
            Table(["", head.label, "vLLM default", "change"], rows, numeric=[False, True, True, True])]


def _figure(m: Measurement, key: str):
    if key in ("goodput_rps", "throughput_rps"):
        return getattr(m, key)
    return m.summary.get(key)


def _change(key: str, new, old) -> str:
    text = fmt.change(new, old)
    if text in ("+0 %", "-0 %"):
        return "same"
    if not text or key in NEUTRAL:
        return text
    better = (new < old) if key in LOWER_IS_BETTER else (new > old)
    return f"{text} ({'better' if better else 'worse'})"


def _commands(data: ReportData, head: Candidate, commands: list[LaunchCommand],
              served_model: str | None) -> list[Block]:
    which = "recommended" if data.verdict.recommended is not None else "closest"
    blocks: list[Block] = [Heading(f"Launch commands ({which} config)", 3),
                           Paragraph("Each command starts a server with exactly the knobs measured above "
                                     "(including the limits that were fixed during the search).")]
    export = model_export(data.info.preset, served_model)
    if export:
        blocks.append(Paragraph("Set the model first (any checkpoint with the same architecture):"))
        blocks.append(Code(export))
    for cmd in commands:
        if cmd.text is None:
            blocks.append(Paragraph(f"**{cmd.server}**: cannot run this config: {cmd.note}."))
        else:
            blocks.append(Code(cmd.text, f"**{cmd.server}**" + (f" ({cmd.note})" if cmd.note else "")))
    return blocks
