"""Section 1: what to run, how much better it is than vLLM's default, and the commands to start it.

When nothing met the SLOs, the top says so, names the closest config, by how
much it misses each SLO, and why (its diagnoses).
"""
from __future__ import annotations

from collections import Counter

from ..diagnose import Diagnosis
from . import fmt
from ..search.report_data import ReportData
from .document import Block, Bullets, Callout, Code, Heading, Paragraph, Table
from .launch import LaunchCommand, model_export
from ..search.advice import headline, where
from ..search.measurement import Candidate, Measurement
from ..search.ranking import BETTER, INCONCLUSIVE, KEEP_DEFAULT, SIM_TIE, SMALLEST_CHANGE
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
    text = (f"Study **{info.name}** tuned the KV cache of `{info.model}` on `{info.on}`"
            + (f" for the workload `{info.workload}`" if info.workload else "") + ". "
            f"Objective: {objective_text(info)}. "
            + (f"SLOs: {', '.join(slo_text(s) for s in info.slos)}. " if info.slos else "No SLOs were set. ")
            + f"Stage 1 ran {len(ran)} trials on the simulator ({failed} failed). "
            + (f"With {info.gpus} GPUs, each config serves {info.gpus} / TP replicas: the figures assume the "
               "traffic split evenly among them (a balancer spreading requests, no prefix cache shared across "
               "replicas); the simulator ran one replica at its share of the rate and the requests per second "
               "are all the replicas'. " if info.gpus else ""))
    if data.live:
        where = data.measured_on() or ["nothing completed"]
        configs = len({tuple(sorted(m.params.items())) for m in data.live})
        text += (f"Stage 2 ran {configs} configs {len(data.live)} times in all, interleaved, on "
                 f"{', '.join(where)}.")
        if info.live_requests:
            text += (f" Stage 2 replayed the trace's first {info.live_requests:,} requests, stage 1 all of them: "
                     "the two stages' figures are not of the same requests.")
        else:
            text += " Both stages replayed the same requests."
    else:
        text += "Stage 2 (live runs) did not run: every number below comes from the simulator."
    return text


def _verdict(data: ReportData, diagnoses: list[Diagnosis]) -> Callout:
    v = data.verdict
    title = headline(v)
    if v.kind in (BETTER, KEEP_DEFAULT, SMALLEST_CHANGE):
        rec = v.recommended
        lines = [params_text(rec.params), _headline_figures(data, rec), *(f"• {r}" for r in v.reasons)]
        if len(v.tied) > 1:
            test = ("by a Welch t-test over their runs (section 2)" if v.stage == "live" else
                    f"on the simulator (within {SIM_TIE:.0%} of the best)")
            lines.append(f"{len(v.tied)} configs are indistinguishable from the best {test}: the smallest change "
                         "from the default is the one named (one that keeps the KV cache unquantized before one "
                         "that quantizes it, then the fewest flags, then the smallest steps).")
        return Callout("ok", title, lines)
    if v.kind == INCONCLUSIVE:
        lines = ["Nothing is recommended: these runs cannot carry a change of flags. Keep what you run, fix what "
                 "is below, and run the search again."]
        if v.leader is not None:
            lines.append(f"{v.leader.label} measured best ({params_text(v.leader.params)}). "
                         + _headline_figures(data, v.leader))
        lines += [f"• {r}" for r in v.reasons]
        return Callout("warn", title, lines)
    if v.closest is not None:
        lines = [f"The closest is **{v.closest.label}** ({params_text(v.closest.params)}). It misses:",
                 *(f"• {miss_text(m)}" for m in v.misses)]
        if v.feasible_elsewhere:
            lines.append("On the simulator, trials " + ", ".join(map(str, v.feasible_elsewhere)) +
                         " did meet the SLOs; the live runs did not confirm them.")
        lines += [f"• {r}" for r in v.reasons if r != "no config met every SLO"]
        lines += _why(diagnoses, _overload(data, v.closest))
        return Callout("warn", f"No configuration met the SLOs ({where(v)}).", lines)
    if v.stage == "live":
        return Callout("warn", "Stage 2 could not measure: no live run completed.", [f"• {r}" for r in v.reasons[:5]])
    reasons = Counter(t.reason or "no reason recorded" for t in data.trials if t.state == "FAIL")
    return Callout("warn", "No trial completed: every configuration failed to run.",
                   [f"• {count}× {reason}" for reason, count in reasons.most_common(5)])


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


def _headline_figures(data: ReportData, c: Candidate) -> str:
    m = c.measured
    if m is None:
        return "It has no measurement."
    spread = c.spread if m.stage == "live" else {}
    parts = [f"capacity {value_text(data.info, m.value)} the trace's rate"] if data.info.objective == "capacity" else []
    parts += [f"goodput {_with_spread(m.goodput_rps, spread.get('goodput_rps'), fmt.rps)}",
              f"throughput {_with_spread(m.throughput_rps, spread.get('throughput_rps'), fmt.rps)}"]
    parts += [f"{metric_label(s.name)} {_with_spread(m.observed.get(s.name), spread.get(s.name), fmt.ms)} "
              f"(limit {fmt.ms(s.threshold_s)})" for s in data.info.slos]
    runs = f", mean of {m.repeat} runs [95 % interval]" if m.stage == "live" else ""
    return f"Measured on {m.measured_on or m.target}{runs}: " + ", ".join(parts) + "."


def _with_spread(value, iv, show) -> str:
    if iv is None or iv.n < 2 or iv.lo == iv.hi:
        return show(value)
    return f"{show(iv.mean)} [{show(iv.lo)}, {show(iv.hi)}]"


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
    ref = data.info.reference  # the target's default, or the operator's --baseline-args
    name = "your baseline (--baseline-args)" if data.info.baseline_args else "the target's default config"
    title = Heading(f"{head.label} vs {name} (measured on {mine.measured_on or stage})", 3)
    if theirs is None:
        return [title, Paragraph(f"{ref[0].upper()}{ref[1:]} was not measured in this study, so there is nothing "
                                 "to compare against.")]
    rows = []
    live = stage == "live"
    for label, key, show in COMPARED:
        ours, its = (head.spread.get(key), data.default.spread.get(key)) if live else (None, None)
        # one number for one measurement: the figures shown, and their change, are Candidate.figure's
        new, old = head.figure(key, stage), data.default.figure(key, stage)
        rows.append([label, _with_spread(new, ours, show), _with_spread(old, its, show), _change(key, new, old)])
    rows.append(["meets the SLOs", "yes" if mine.feasible else "no", "yes" if theirs.feasible else "no", ""])
    given = f" (`{data.info.baseline_args}`)" if data.info.baseline_args else ""
    return [title, Paragraph(f"{ref[4:].capitalize()}{given}: " + params_text(data.default.params) + "."),
            Table(["", head.label, ref[4:], "change"], rows, numeric=[False, True, True, True])]


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
    which = ("recommended" if data.verdict.recommended is not None else
             "closest" if data.verdict.closest is not None else "best measured, not recommended")
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
