"""Sections 2–7: stage 1 vs stage 2, the search's figures, the KV cache over time, diagnoses,
capacity, the quantized-KV quality note and every trial."""
from __future__ import annotations

from ..diagnose import Diagnosis
from ..diagnose.render import show
from ..plan import CapacityPlan, is_one_byte
from . import fmt, plots
from .capacity import Capacity
from ..search.report_data import ReportData, RunView
from .document import Block, Bullets, Code, Heading, Image, Paragraph, Table
from .importance import Importance
from ..search.advice import changed_flags, describe
from ..search.measurement import Candidate, Measurement
from ..search.ranking import Verdict
from .words import metric_label, row_kind, status, value_label, value_text

QUANTIZED = ("fp8", "fp8_e4m3", "fp8_e5m2", "int8")
FIGURES = ("goodput", "throughput", "TTFT p95", "TPOT p95", "meets SLOs")


# ---------------------------------------------------------------- 2. stage 1 vs stage 2

def stages_section(data: ReportData) -> list[Block]:
    if data.live:
        where = data.measured_on() or ["nothing completed"]
        intro = (f"Stage 1 replays the workload on the simulator; stage 2 runs the best configs and the target's "
                 f"default several times each, interleaved, on {', '.join(where)}. Live figures are the mean of "
                 "the runs with its Student-t 95 % interval in brackets and the number of runs; a config wins only "
                 "where a one-sided Welch t-test against the default says so at the stated error budget. "
                 + describe(data.verdict))
    else:
        intro = ("Stage 2 did not run (`--target none`), so only the simulator's numbers exist. The best stage-1 "
                 "configs and the target's default:")
    knobs, stages = data.info.knobs, ("sim", "live") if data.live else ("sim",)
    header = ["config", *knobs]
    for name in FIGURES:
        header += [f"{name} ({stage})" for stage in stages]
    if data.live:
        header.append("runs (ok/all)")
    rows = [_stage_row(c, knobs, stages) for c in data.candidates]
    numeric = [False] + [True] * (len(header) - 1 - len(stages) - bool(data.live)) + [False] * (len(stages) + bool(data.live))
    kinds = [row_kind(c.measured) for c in data.candidates]
    return [Heading("2. Stage 1 (simulator) vs stage 2 (live runs)"), Paragraph(intro),
            Table(header, rows, row_kinds=kinds, numeric=numeric)] + comparisons_blocks(data) + slots_blocks(data.live)


def comparisons_blocks(data: ReportData) -> list[Block]:
    """Each live config's test against the reference, as the verdict judged it (`Verdict.comparisons`)."""
    v = data.verdict
    if not v.comparisons:
        return []
    header, rows = comparison_rows(v)
    rows = [[label, flags if flags == "none" else f"`{flags}`", *rest] for label, flags, *rest in rows]
    return [Paragraph(comparisons_text(v)), Table(header, rows)]


def comparisons_text(v: Verdict) -> str:
    """What the comparisons table shows, and the test behind it (the report's and the dashboard's words)."""
    ref = v.reference
    return (f"Each live config against {ref}: the one-sided Welch t-test's p-value (the smallest over the objective "
            f"and each SLO it meets in every run while {ref} misses it on average, Bonferroni-combined), and whether "
            f"the test counts it as beating {ref}: Holm over the configs tied at the top, at α = {v.alpha:.2g} "
            "for each of stage 2's looks. An inconclusive verdict trusts none of these runs.")


def comparison_rows(v: Verdict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of `Verdict.comparisons`: config, the flags it changes (plain), p, whether it beats the
    reference, the test's words."""
    rows = [[c.label, changed_flags(c.params, v.default_params) if c.params != v.default_params else "none",
             f"{c.p:.2g}" if c.p is not None else
             "no test (fewer than 2 completed runs, or no gain)", "yes" if c.beats else "no", c.why or ""]
            for c in v.comparisons]
    return ["config", "flags changed", "p (one-sided)", f"beats {v.reference}", "the test"], rows


def slots_blocks(live: list[Measurement]) -> list[Block]:
    """The Ray slots stage 2 ran on (`kvtune search --ray`), and whether one was slower than the others
    beyond the spread (cluster.slots.slot_check states the test); nothing for a search without --ray."""
    from ..cluster.slots import ALPHA, slot_check

    runs = [(m.slot, m.number, m.value) for m in live if m.ok and m.slot and m.value is not None]
    if not runs:
        return []
    rows = slot_check(runs)
    slower = [r.slot.label for r in rows if r.slower]
    text = (f"Stage 2 ran on {len(rows)} slot(s) of a Ray cluster, each round of every config on one slot, so a "
            "slot is a block: it meets every config alike. Each run's value is divided by its config's mean over "
            "all its runs, and each slot's ratios are compared with the other slots' by a one-sided Welch t-test, "
            f"Holm-corrected over the slots at {ALPHA:g}. "
            + (f"Slower than the others beyond the spread: {', '.join(slower)}." if slower else
               "No slot was slower than the others beyond the spread."))
    table = [[r.slot.label, str(r.runs), str(r.configs),
              "-" if r.ratio is None else f"{r.ratio.mean:.3f}" + (f" [{r.ratio.lo:.3f}, {r.ratio.hi:.3f}]"
                                                                     if r.ratio.n > 1 else ""),
              "-" if r.p is None else f"{r.p:.3f}", "yes" if r.slower else "no"] for r in rows]
    return [Paragraph(text), Table(["slot", "runs", "configs", "value / config mean", "p (slower)", "slower"],
                                   table, numeric=[False, True, True, True, True, False])]


def _stage_row(c: Candidate, knobs: list[str], stages: tuple[str, ...]) -> list[str]:
    row = [c.label] + [fmt.param(k, c.params.get(k, fmt.MISSING)) for k in knobs]
    figures = ((lambda m: m.goodput_rps, "goodput_rps", fmt.rps), (lambda m: m.throughput_rps, "throughput_rps", fmt.rps),
               (lambda m: m.summary.get("ttft_p95"), "ttft_p95", fmt.ms),
               (lambda m: m.summary.get("tpot_p95"), "tpot_p95", fmt.ms))
    for get, key, fmt_value in figures:
        for stage in stages:
            m = getattr(c, stage)
            iv = c.spread.get(key) if stage == "live" else None
            if m is not None and m.ok and iv is not None and iv.n > 1 and iv.lo != iv.hi:
                row.append(f"{fmt_value(iv.mean)} [{fmt_value(iv.lo)}, {fmt_value(iv.hi)}]")
            else:
                row.append(_cell(m, lambda m: fmt_value(get(m)) if key.endswith("rps") else fmt.quantile(m.summary, key)))
    row += [_feasible(getattr(c, stage)) for stage in stages]
    if "live" in stages:
        row.append(f"{sum(m.ok for m in c.runs)}/{len(c.runs)}" if c.runs else fmt.MISSING)
    return row


def _cell(m: Measurement | None, show_value) -> str:
    if m is None:
        return fmt.MISSING
    return show_value(m) if m.ok else "failed"


def _feasible(m: Measurement | None) -> str:
    if m is None:
        return fmt.MISSING
    return ("yes" if m.feasible else "no") if m.ok else "failed"


# ---------------------------------------------------------------- 3. the search

def search_section(data: ReportData, importance: Importance) -> list[Block]:
    info = data.info
    blocks: list[Block] = [Heading("3. The search")]
    history = plots.history(data.trials, value_label(info))
    if history is not None:
        blocks += [Paragraph(f"Each dot is one stage-1 trial's {value_label(info)}; the line is the best value so "
                             "far among trials that meet the SLOs."),
                   Image("history.png", "optimisation history", plots.png(history))]
    latency = info.latency if info.objective == "multi" else (info.slos[0].name if info.slos else "ttft_p95")
    front = {t.number for t in data.study.best_trials} if info.objective == "multi" else set()
    limit = next((s.threshold_s for s in info.slos if s.name == latency), None)
    trade = plots.tradeoff(data.trials, latency, front, limit)
    if trade is not None:
        text = (f"The Pareto front: configs where no other one has both more throughput and a lower "
                f"{metric_label(latency)}." if front else
                f"Throughput against {metric_label(latency)}: lower right is better (more requests, less waiting).")
        blocks += [Paragraph(text), Image("tradeoff.png", f"throughput vs {latency}", plots.png(trade))]
    blocks.append(Heading("Which knobs mattered", 3))
    blocks.append(Paragraph(importance.note))
    if importance.values:
        blocks.append(Image("importance.png", "parameter importance", plots.png(plots.importance(importance.values))))
    return blocks


# ---------------------------------------------------------------- 4. KV cache over time

def kv_section(data: ReportData, runs: list[RunView], pools: dict[int, list[str]]) -> list[Block]:
    blocks: list[Block] = [Heading("4. The KV cache over time")]
    if not runs:
        return blocks + [Paragraph("No stored run of the recommended or the default config to plot.")]
    figure = plots.kv_over_time(runs)
    blocks.append(Paragraph("Top: share of KV blocks in use (at 100 % new requests wait). Middle: share of prompt "
                            "tokens served from the prefix cache so far. Bottom: preemptions so far (requests paused "
                            "because the KV cache ran out)."))
    if figure is not None:
        blocks.append(Image("kv_over_time.png", "KV usage, prefix hit rate and preemptions over time",
                            plots.png(figure)))
    for run in runs:
        blocks.append(Code("\n".join(pools.get(run.run_id) or ["no pool figures"]),
                           f"KV pool of {run.label} ({run.stage} run {run.run_id})", language="text"))
    return blocks


# ---------------------------------------------------------------- 5. diagnoses

def diagnoses_section(runs: list[RunView], diagnoses: dict[int, list[Diagnosis]]) -> list[Block]:
    blocks: list[Block] = [Heading("5. Diagnoses"),
                           Paragraph("The fault card's rules (F1–F8) applied to each run: what went wrong, the "
                                     "evidence, the cause and the flag change that fixes it.")]
    if not runs:
        return blocks + [Paragraph("No stored run to diagnose.")]
    for run in runs:
        blocks.append(Heading(f"{run.label} ({run.stage} run {run.run_id})", 3))
        found = diagnoses.get(run.run_id) or []
        if not found:
            blocks.append(Paragraph("No faults found: none of the rules F1–F8 fired."))
        for d in found:
            blocks += _diagnosis(d)
    return blocks


def _diagnosis(d: Diagnosis) -> list[Block]:
    rows = [[e.metric, e.window, show(e.value), e.threshold] for e in d.evidence]
    return [Paragraph(f"**{d.id}** ({d.severity}): {d.symptom}"),
            Table(["evidence", "window", "value", "compared with"], rows, numeric=[False, False, True, False]),
            Bullets([f"**Cause**: {d.cause}", f"**Fix**: {d.fix}"]),
            *_trials(d)]


def _trials(d: Diagnosis) -> list[Block]:
    """Every change the simulator tried for this fault, those that did not help included."""
    rows = [[t.change, t.verdict, t.note] for t in d.tried]
    return [Table(["change tried in the simulator", "verdict", "what it did"], rows)] if rows else []


# ---------------------------------------------------------------- 6. capacity

def capacity_section(capacity: Capacity) -> list[Block]:
    blocks: list[Block] = [Heading("6. Capacity plan")]
    plan = capacity.plan
    if plan is None:
        return blocks + [Paragraph(capacity.note)]
    cfg = plan.config
    contexts_from = f"Context lengths (prompt + output tokens per request) from {capacity.source}."
    if plan.server_pool is not None:
        blocks.append(Paragraph(f"{_live_pool_text(plan)} {contexts_from}"))
    elif plan.pool_fixed:
        blocks.append(Paragraph(
            f"What fits in the KV cache of `{plan.model}` on `{plan.device}` at `block_size` {cfg.block_size}: "
            f"KV pool fixed at {fmt.gib(cfg.kv_cache_memory_bytes)} (--kv-cache-memory-bytes / the server's "
            f"environment); `gpu_memory_utilization` does not size it. {contexts_from}"))
    else:
        blocks.append(Paragraph(
            f"What fits in the KV cache of `{plan.model}` on `{plan.device}` at `gpu_memory_utilization` "
            f"{cfg.gpu_memory_utilization:.2f} and `block_size` {cfg.block_size}: device memory "
            f"{fmt.gib(plan.total_bytes)} × {cfg.gpu_memory_utilization:.2f} = {fmt.gib(plan.requested_bytes)}, "
            f"minus weights {fmt.gib(plan.weights_bytes)}, activation peak {fmt.gib(plan.activation_bytes)} and "
            f"overhead {fmt.gib(plan.overhead_bytes)}. {contexts_from}"))
    names = {v: k for k, v in plan.workload_contexts.items()}
    header = ["", *(f"auto ({plan.model_dtype})" if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
                    for c in plan.by_dtype)]
    rows = [["KV bytes per token", *(fmt.kib(c.kv_bytes_per_token) for c in plan.by_dtype)],
            ["KV pool", *(fmt.gib(c.pool_bytes) for c in plan.by_dtype)],
            ["tokens that fit", *(fmt.count(c.pool_tokens) for c in plan.by_dtype)]]
    for context in plan.contexts:
        label = f"requests at once, {context:,} tokens" + (f" ({names[context]})" if context in names else "")
        rows.append([label, *(f"{c.max_concurrency[str(context)]:,.1f}" for c in plan.by_dtype)])
    if cfg.max_model_len:
        rows.append([f"requests at once if each reserved max_model_len ({cfg.max_model_len:,}) up front",
                     *(fmt.count(c.contiguous_requests) for c in plan.by_dtype)])
    blocks.append(Table(header, rows, numeric=[False] + [True] * len(plan.by_dtype)))
    blocks.append(Paragraph("Paged KV blocks (vLLM, SGLang, kvengine) hold as many requests as their real length "
                            "allows; the last row is what a server reserving the worst case per request would "
                            "hold in the same memory. Plan for the p99 context, not the mean."))
    return blocks


def _live_pool_text(plan: CapacityPlan) -> str:
    """Where a live plan's pool comes from, and what each dtype column assumes."""
    pool = plan.server_pool
    where = f"`{plan.model}` on `{plan.device}`" if plan.model else f"`{plan.device}`"
    size = f", {fmt.gib(pool.pool_bytes)}" if pool.pool_bytes else ""
    set_by = f" ({pool.set_by})" if pool.set_by else ""
    text = (f"What fits in the KV cache of {where}: the live server's pool, as vllm:cache_config_info reports it: "
            f"{pool.num_gpu_blocks:,} blocks of {pool.block_size} tokens{size}{set_by}, "
            f"{pool.tokens:,} tokens in `{pool.kv_cache_dtype}`.")
    if not pool.pool_bytes:
        text += (" The server does not report the pool's bytes: the KV pool row is those tokens at the "
                 "preset's bytes per token." if plan.primary.pool_bytes else
                 " The server does not report the pool's bytes, and the model's shape is unknown.")
    n = plan.auto_element_bytes
    per = f"{n} byte{'s' if n != 1 else ''} per K/V element"
    run = plan.by_dtype[1] if is_one_byte(pool.kv_cache_dtype) else plan.by_dtype[0]
    if run.kv_cache_dtype == "auto":
        how = plan.auto_dtype_source
        if how == "the server's bytes per token":
            how = f"the server's {fmt.kib(run.kv_bytes_per_token)} per token for the preset's shape"
        text += (f" Under `auto` it stores {per} ({how}); the fp8 column is the same memory at 1 byte per "
                 "element.")
    else:
        text += (f" It ran `{run.kv_cache_dtype}` (1 byte per K/V element); the `auto` column is the same memory "
                 f"at {per} ({plan.auto_dtype_source}).")
    return text


# ---------------------------------------------------------------- 7. quality and every trial

def quality_section(dtypes_used: set[str], recommended_dtype: str | None, auto_bytes: int | None = None) -> list[Block]:
    """`auto_bytes`: bytes per K/V element under `auto` (the capacity plan's), where known."""
    quantized = sorted(dtypes_used & set(QUANTIZED))
    if recommended_dtype in QUANTIZED:
        n = auto_bytes or 2
        times = {2: "twice", 4: "four times"}.get(n, f"{n} times")
        lead = (f"The recommended config stores the KV cache as `{recommended_dtype}`, 1 byte per value instead "
                f"of the model's {n}{'' if auto_bytes else ' (16-bit, assumed)'}: about {times} the tokens fit, "
                "at a small accuracy cost.")
    elif quantized:
        lead = f"The search also tried quantized KV caches ({', '.join(f'`{d}`' for d in quantized)})."
    else:
        lead = "The search did not try a quantized KV cache; the notes below apply if you do."
    return [Heading("7. Quality note on quantized KV caches"), Paragraph(lead), Bullets([
        ("kvtune measures speed, not answer quality. Check quantized KV caches on your own evaluation set "
         "before and after."),
        ("`fp8` is `fp8_e4m3` in vLLM. vLLM's documentation reports that FP8 E4M3 KV caches typically degrade "
         "accuracy only minimally. Without calibrated scales vLLM uses a scale of 1.0; calibrated scales "
         "(e.g. from llm-compressor) are the recommended way to keep accuracy."),
        "`fp8_e5m2` has more range but fewer mantissa bits than `fp8_e4m3`: it is less precise.",
        "`int8` (per-block scales) exists only in kvengine; vLLM and SGLang do not take it.",
        ("kvengine's tests (tests/test_model_kv_dtypes.py) compare each quantized dtype with `auto` on a small "
         "random-weight model, feeding both the same 256 tokens: the top token must agree at ≥ 90 % of "
         "positions for `int8`, ≥ 70 % for `fp8`/`fp8_e4m3` and ≥ 50 % for `fp8_e5m2`. A random model's "
         "near-flat scores make this a harsh floor, not a forecast for a trained model."),
    ])]


def trials_section(data: ReportData) -> list[Block]:
    info = data.info
    extra = [value_label(info)] if info.objective == "capacity" else []  # otherwise it is goodput or throughput
    header = ["stage", "trial", "result", *info.knobs, *extra, "goodput", "throughput",
              *(metric_label(s.name) for s in info.slos), "note"]
    ordered = sorted(data.trials, key=lambda t: t.number) + sorted(data.live, key=lambda m: m.number)
    rows = [_trial_row(m, data) for m in ordered]
    numeric = [False, True, False] + [True] * len(info.knobs) + [True] * (len(header) - 4 - len(info.knobs)) + [False]
    return [Heading("Every trial", 3),
            Paragraph(f"{len(data.trials)} stage-1 trials and {len(data.live)} stage-2 re-runs. "
                      "Click a column header in the HTML report to sort."),
            Table(header, rows, sortable=True, row_kinds=[row_kind(m) for m in ordered], numeric=numeric)]


def _trial_row(m: Measurement, data: ReportData) -> list[str]:
    info = data.info
    number = "default" if m.number < 0 else str(m.number)
    row = [m.stage, number, status(m), *(fmt.param(k, m.params.get(k, fmt.MISSING)) for k in info.knobs)]
    figures = [value_text(info, m.value)] if info.objective == "capacity" else []
    figures += [fmt.rps(m.goodput_rps), fmt.rps(m.throughput_rps), *(fmt.ms(m.observed.get(s.name)) for s in info.slos)]
    row += figures if m.ok else [fmt.MISSING] * len(figures)
    row.append(trial_note(m))
    return row


def trial_note(m: Measurement) -> str:
    """Why a trial's row reads as it does: its failure, a reused measurement, failed requests."""
    if m.reason:
        return m.reason.splitlines()[0][:300]
    if m.duplicate_of is not None:
        return f"same config as trial {m.duplicate_of}: its measurement reused"
    if m.failed_requests:
        return f"{m.failed_requests} requests failed"
    return ""
