"""Search page: a study's trials, optimisation history, Pareto front, parameter importance, best configs
with their launch commands, and stage 1 against stage 2."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from kvtune.report import fmt
from kvtune.search.report_data import ReportData, ReportError
from kvtune.report.launch import launch_commands, model_export
from kvtune.results import engine_config
from kvtune.report.sections import comparison_rows, comparisons_text, trial_note
from kvtune.search.advice import describe
from kvtune.search.measurement import Candidate, Measurement
from kvtune.search.ranking import BETTER, KEEP_DEFAULT, SMALLEST_CHANGE
from kvtune.report.words import (
    metric_label,
    miss_text,
    objective_text,
    slo_text,
    status,
    value_label,
)
from kvtune.report.writer import LIVE_MODEL_TARGETS
from kvtune.ui import charts, data, tables, widgets

# Plain symbols, not emoji: a browser without an emoji font (a headless one) shows emoji as boxes.
MARKS = {"ok": ("✔", "#2ca02c"), "bad": ("✖", "#d62728"), "failed": ("⚠", "#7f7f7f")}
BEST_SHOWN = 3  # configs with launch commands
NOTES_SHOWN = 5  # failed trials' reasons in full under the table; the rest behind an expander
STAGE_NAMES = {"sim": "the simulator", "live": "the live target"}
IMPORTANCE_WIDTH = 760  # pixels: a few bars, stretched across the page, would stand a screen tall


def studies_frame(rows: list[data.StudyRow]) -> pd.DataFrame:
    return pd.DataFrame([{"study": r.name, "objective": r.objective, "trials": r.trials,
                          "SLOs": ", ".join(r.slos), "model": r.preset, "device": r.device,
                          "workload": r.workload,
                          "started": r.started.strftime("%Y-%m-%d %H:%M") if r.started else None} for r in rows])


def mark(m: Measurement) -> str:
    """The trial's result with a marker: meets the SLOs, misses one, or failed."""
    if not m.ok:
        kind = "failed"
    else:
        kind = "ok" if m.feasible else "bad"
    return f"{MARKS[kind][0]} {status(m)}"


def result_colour(text: str) -> str:
    colour = next((c for symbol, c in MARKS.values() if str(text).startswith(symbol)), None)
    return f"color: {colour}" if colour else ""


def trials_frame(report: ReportData) -> pd.DataFrame:
    info = report.info
    rows = []
    for m in sorted(report.trials, key=lambda t: t.number) + sorted(report.live, key=lambda t: t.number):
        row = {"stage": m.stage, "trial": m.number, "result": mark(m)}
        row |= {k: _cell(m.params.get(k)) for k in info.knobs}
        if info.objective == "capacity":  # otherwise the value is the goodput or the throughput beside it
            row["value"] = m.value if m.ok else None
        row["goodput (req/s)"] = m.goodput_rps if m.ok else None
        row["throughput (req/s)"] = m.throughput_rps if m.ok else None
        for slo in info.slos:
            observed = m.observed.get(slo.name)
            row[f"{metric_label(slo.name)} (ms)"] = observed * 1000 if m.ok and observed is not None else None
        for key in ("ttft_p95", "tpot_p95"):
            if key not in {s.name for s in info.slos}:
                value = m.summary.get(key)
                row[f"{metric_label(key)} (ms)"] = value * 1000 if m.ok and value is not None else None
        row["run"] = m.run_id
        row["note"] = trial_note(m)
        rows.append(row)
    return pd.DataFrame(rows)


def _cell(value):
    # Knob columns mix bools, ints and strings across studies: keep each column one type for sorting.
    return fmt.param("", value) if isinstance(value, bool) else value


def latency_axis(report: ReportData) -> str:
    info = report.info
    if info.objective == "multi":
        return info.latency
    return info.slos[0].name if info.slos else "ttft_p95"


def pareto_front(points: list[tuple[Measurement, float, float]]) -> list[int]:
    """Trial numbers no other trial beats on both more throughput and less latency."""
    front = []
    for t, x, y in points:
        beaten = any(x2 >= x and y2 <= y and (x2 > x or y2 < y) for _, x2, y2 in points)
        if not beaten:
            front.append(t.number)
    return front


def stages(report: ReportData) -> tuple[str, ...]:
    return ("sim", "live") if report.live else ("sim",)


def configs_frame(report: ReportData) -> pd.DataFrame:
    """The compared configs' knobs: one row each, the figures beside them in stages_frame."""
    knobs = report.info.knobs
    return pd.DataFrame([{"config": c.label} | {k: _cell(c.params.get(k)) for k in knobs}
                         for c in report.candidates], columns=["config", *knobs])


def stages_frame(report: ReportData) -> pd.DataFrame:
    """Each compared config's figures, one row per stage: the report's (Candidate.figure), one number
    for one measurement."""
    rows = []
    for c in report.candidates:
        for stage in stages(report):
            m = getattr(c, stage)
            row = {"config": c.label, "stage": stage,
                   "goodput (req/s)": c.figure("goodput_rps", stage),
                   "throughput (req/s)": c.figure("throughput_rps", stage),
                   "TTFT p95 (ms)": _ms(c.figure("ttft_p95", stage)),
                   "TPOT p95 (ms)": _ms(c.figure("tpot_p95", stage)),
                   "meets SLOs": ("yes" if m.feasible else "no") if m is not None and m.ok else status(m)}
            if report.live:
                iv = c.spread.get("goodput_rps") if stage == "live" else None
                row["goodput, 95 % interval (req/s)"] = f"{iv.lo:.2f} to {iv.hi:.2f}" if iv is not None else None
                row["runs (ok/all)"] = (f"{sum(r.ok for r in c.runs)}/{len(c.runs)}"
                                        if stage == "live" and c.runs else None)
            rows.append(row)
    return pd.DataFrame(rows)


def stage_failures(report: ReportData) -> list[str]:
    """Why each compared config that failed on a stage failed, in full."""
    out = []
    for c in report.candidates:
        for stage in stages(report):
            m = getattr(c, stage)
            if m is not None and not m.ok and not m.surplus:
                which = f"trial {m.number}" if stage == "sim" else f"run {m.run_id}" if m.run_id else "its run"
                out.append(f"{MARKS['failed'][0]} **{c.label}** failed on {STAGE_NAMES[stage]} ({which}): "
                           f"{markdown_text(m.reason or 'no reason recorded')}")
    return out


def trial_failures(report: ReportData) -> list[str]:
    """The failed trials' reasons, in full (the table's note column holds what its width shows), the trials
    that failed alike together."""
    by_reason: dict[str, list[Measurement]] = {}
    for m in sorted(report.trials, key=lambda t: t.number) + sorted(report.live, key=lambda t: t.number):
        if not m.ok and not m.surplus:
            by_reason.setdefault(m.reason or "no reason recorded", []).append(m)
    out = []
    for reason, failed in by_reason.items():
        names = ", ".join(f"{m.number}" if m.stage == "sim" else f"{m.number} (live)" for m in failed)
        out.append(f"{MARKS['failed'][0]} **trial{'s' * (len(failed) > 1)} {names}** failed: {markdown_text(reason)}")
    return out


def markdown_text(text: str) -> str:
    """Plain text for st.markdown: `$` would start LaTeX, a newline a paragraph."""
    return " ".join(text.split()).replace("$", "\\$")


def best_candidates(report: ReportData) -> list[Candidate]:
    """The verdict's config first (even when it is vLLM's default), then the next best measured ones."""
    out = []
    for c in [report.headline, *report.candidates]:
        if c is None or c.measured is None or not c.measured.ok or any(c.params == o.params for o in out):
            continue
        if c is report.headline or not c.is_default:
            out.append(c)
    return out[:BEST_SHOWN]


def _ms(seconds):
    return None if seconds is None else seconds * 1000


def render() -> None:
    st.title("Search")
    db = data.database()
    if not widgets.require_data(db, "runs or studies"):
        return
    if not db.studies:
        st.info("No studies in this database yet. Start one (it reads only what it stores):")
        st.code(widgets.fill_commands(db), language="bash")
        return
    rows = data.studies(db.url)
    with st.expander(f"{len(rows)} stud{'ies' if len(rows) != 1 else 'y'} in {db.display_url}"):
        tables.table(studies_frame(rows), key="studies_table")
    by_name = {r.name: r for r in rows}
    name = st.selectbox("Study", list(by_name), key="study")
    if name is None:
        return
    try:
        view = data.study_view(db.url, name, by_name[name].trials)
    except ReportError as err:
        st.info(str(err))
        return
    show_study(view)


def show_study(view: data.StudyView) -> None:
    report, info = view.report, view.report.info
    st.markdown(f"**{info.name}**: `{info.model}` on `{info.on}`"
                + (f", workload `{info.workload}`" if info.workload else "")
                + f". Objective: {objective_text(info)}. "
                + (f"SLOs: {', '.join(slo_text(s) for s in info.slos)}." if info.slos else "No SLOs."))
    verdict(report)

    st.subheader("Trials")
    st.caption("Click a column header to sort. ✔ meets the SLOs, ✖ misses one, ⚠ failed (why: below the table).")
    tables.table(trials_frame(report), key="trials_table", colour=("result", result_colour),
                 column_config={"value": st.column_config.NumberColumn(value_label(info), format="%.2f")})
    notes(trial_failures(report), "trial_failures")

    left, right = st.columns(2)
    with left:
        st.subheader("Optimisation history")
        figure = charts.history(report.trials, value_label(info))
        if figure is None:
            st.info("No completed trial to plot.")
        else:
            charts.show(figure)
    with right:
        st.subheader("Pareto front")
        latency = latency_axis(report)
        points = charts.tradeoff_points(report.trials, latency)
        limit = next((s.threshold_s for s in info.slos if s.name == latency), None)
        figure = charts.pareto(points, pareto_front(points), metric_label(latency), limit)
        if figure is None:
            st.info("No completed trial to plot.")
        else:
            charts.show(figure)
            st.caption(f"Throughput against {metric_label(latency)} (stage 1): lower right is better; "
                       "the line joins the configs no other one beats on both.")

    st.subheader("Parameter importance")
    st.caption(view.importance.note)
    if view.importance.values:
        charts.show(charts.importance(view.importance.values), width=IMPORTANCE_WIDTH)

    st.subheader("Best configs and their launch commands")
    best_configs(view)

    st.subheader("Stage 1 (simulator) vs stage 2 (live runs)")
    if not report.live:
        st.info("Stage 2 did not run for this study (`--target none`): only the simulator's numbers exist. "
                "The best stage-1 configs and the target's default:")
    # Two tables: the knobs and both stages' figures side by side would run past the page's right edge.
    tables.table(configs_frame(report), key="stage_configs_table")
    st.caption("Their figures on each stage" + (": on stage 2 the mean of its runs" if report.live else "") + ".")
    tables.table(stages_frame(report), key="stages_table")
    notes(stage_failures(report), "stage_failures")
    comparisons(report)


def comparisons(report: ReportData) -> None:
    """Each live config's test against the reference, as the report's section 2 tabulates it."""
    v = report.verdict
    if not v.comparisons:
        return
    st.subheader(f"Each config against {v.reference}")
    st.caption(comparisons_text(v))
    header, rows = comparison_rows(v)
    # The test's words run long: under the table, in full, as the failed trials' reasons are.
    tables.table(pd.DataFrame([row[:-1] for row in rows], columns=header[:-1]), key="comparisons_table")
    notes([f"{row[0]}: {row[-1]}" for row in rows if row[-1]], "comparison_tests")


def notes(lines: list[str], key: str) -> None:
    """Lines of text under a table, the first few shown, the rest behind an expander."""
    for line in lines[:NOTES_SHOWN]:
        st.markdown(line)
    if len(lines) > NOTES_SHOWN:
        with st.expander(f"{len(lines) - NOTES_SHOWN} more", key=key):
            for line in lines[NOTES_SHOWN:]:
                st.markdown(line)


def verdict(report: ReportData) -> None:
    """The ranking's verdict, in the words the report and the terminal use."""
    v = report.verdict
    text = describe(v)
    if v.kind in (BETTER, KEEP_DEFAULT, SMALLEST_CHANGE):
        st.success(text)
    elif v.closest is not None:
        misses = "; ".join(miss_text(x) for x in v.misses)
        st.warning(f"{text} Closest: **{v.closest.label}** ({misses}).")
        if v.feasible_elsewhere:
            st.caption(f"Stage-1 trials that met the SLOs on the simulator: "
                       f"{', '.join(map(str, v.feasible_elsewhere))}.")
    else:
        st.warning(text)


def best_configs(view: data.StudyView) -> None:
    report, info = view.report, view.report.info
    best = best_candidates(report)
    if not best:
        st.info("No completed config to recommend yet.")
        return
    run = report.best_run.result if report.best_run else None
    served = run.model if run is not None and run.target in LIVE_MODEL_TARGETS else None
    export = model_export(info.preset, served)
    for tab, candidate in zip(st.tabs([c.label for c in best]), best):
        with tab:
            m = candidate.measured
            tables.table(pd.DataFrame([{k: fmt.param(k, v) for k, v in candidate.params.items()}]))
            st.markdown(f"Measured on {m.measured_on or m.stage}: goodput {fmt.rps(m.goodput_rps)}, "
                        f"throughput {fmt.rps(m.throughput_rps)}, TTFT p95 {fmt.ms(m.summary.get('ttft_p95'))}, "
                        f"TPOT p95 {fmt.ms(m.summary.get('tpot_p95'))}; "
                        f"{'meets' if m.feasible else 'misses'} the SLOs.")
            if export:
                st.code(export, language="bash")
            config = engine_config(view.base_config, candidate.params)
            for command in launch_commands(config, info.preset, info.device, served,
                                           run.config if run is not None else None):
                if command.text is None:
                    st.caption(f"**{command.server}** cannot run this config: {command.note}")
                else:
                    st.caption(f"**{command.server}**" + (f": {command.note}" if command.note else ""))
                    st.code(command.text, language="bash")


if __name__ == "__main__":
    render()
