"""`write_report(db_url, study, out_dir)`: gather, compose, write report.md (+ PNGs) and report.html."""
from __future__ import annotations

from pathlib import Path

from kvengine.config import DTYPE_BYTES, EngineConfig

from .capacity import capacity_for
from .context import context_section
from ..search.report_data import ReportData, RunView, load_report_data
from .diagnoses import pool_lines, run_diagnoses
from .document import Block, Image
from .html import render_html
from .importance import param_importance
from ..results import engine_config
from .launch import launch_commands
from .markdown import render_markdown
from .sections import (
    capacity_section,
    diagnoses_section,
    kv_section,
    quality_section,
    search_section,
    stages_section,
    trials_section,
)
from .summary import summary_section
from .words import value_label

LIVE_MODEL_TARGETS = ("vllm", "sglang")  # their runs record the real model served


def write_report(db_url: str, study: str, out_dir: str, data: ReportData | None = None) -> tuple[Path, Path]:
    """Write report.md, its PNGs and a self-contained report.html into out_dir; return both paths.
    `data`: the study's, loaded already (the search that just ended has it), else loaded here.

    Raises ReportError for a missing database or an unknown or empty study."""
    data = load_report_data(db_url, study) if data is None else data
    title, blocks = f"kvtune tuning report: {study}", compose(data, db_url)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for block in blocks:
        if isinstance(block, Image):
            (out / block.filename).write_bytes(block.png)
    md, html = out / "report.md", out / "report.html"
    md.write_text(render_markdown(title, blocks), encoding="utf-8")
    html.write_text(render_html(title, blocks), encoding="utf-8")
    return md, html


def compose(data: ReportData, db_url: str) -> list[Block]:
    runs = _runs(data)
    diagnoses = {r.run_id: run_diagnoses(db_url, r, data.info.slos) for r in runs}
    pools = {r.run_id: pool_lines(r, data.info.slos) for r in runs}
    head_diagnoses = diagnoses.get(data.best_run.run_id, []) if data.best_run else []
    config, served_model = _headline_config(data)
    measured = data.best_run.result.config if data.best_run else None
    commands = launch_commands(config, data.info.preset, data.info.device, served_model, measured) if config else []
    blocks = summary_section(data, commands, served_model, head_diagnoses)
    blocks += context_section(data)  # what was measured, where, when
    blocks += stages_section(data)
    blocks += search_section(data, param_importance(data.study, value_label(data.info)))
    blocks += kv_section(data, runs, pools)
    blocks += diagnoses_section(runs, diagnoses)
    profile = data.best_run.result.workload if data.best_run else None
    capacity = capacity_for(config or EngineConfig(), data.info.preset, data.info.device, data.info.workload,
                            profile, run=data.best_run, db_url=db_url, live_run_ids=[m.run_id for m in data.live])
    blocks += capacity_section(capacity)
    dtypes = {t.params.get("kv_cache_dtype") for t in data.trials + data.live}
    plan = capacity.plan
    auto_bytes = plan and (plan.auto_element_bytes or DTYPE_BYTES.get(plan.model_dtype))
    blocks += quality_section(dtypes, config.kv_cache_dtype if config and data.verdict.recommended else None,
                              auto_bytes)
    blocks += trials_section(data)
    return blocks


def _runs(data: ReportData) -> list[RunView]:
    runs = [data.best_run] if data.best_run else []
    if data.default_run and all(r.run_id != data.default_run.run_id for r in runs):
        runs.append(data.default_run)
    return runs


def _headline_config(data: ReportData):
    """The recommended (else closest) config as its run used it, and the model a live vLLM/SGLang run served."""
    head = data.headline
    if head is None:
        return None, None
    run = data.best_run.result if data.best_run else None
    config = engine_config(run.config if run else {}, head.params)
    served = run.model if run is not None and run.target in LIVE_MODEL_TARGETS else None
    return config, served
