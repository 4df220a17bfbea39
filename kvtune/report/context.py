"""What was measured, where, when: the context an ops reader needs before trusting a figure.

The report's date and the study's, the versions (kvtune's, the live server's),
what each stage ran on (the simulator, the bundled engine, vLLM, SGLang), the
search host's hardware (the study's user attr "environment", which `kvtune
search` stores from `kvtune.environment.host_environment()`), the workload
replayed, and the KV headroom of the headline config.
"""
from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta, timezone

from kvengine.config import ConfigError, device_preset

from ..diagnose.pool import pool_of
from ..environment import DISTRIBUTION, package_version
from ..results import Launch
from ..workload import TraceError, read_workload, workload_stats
from . import fmt
from ..search.report_data import ReportData, RunView
from .document import Block, Bullets, Heading, Paragraph, Table

ENVIRONMENT_ATTR = "environment"  # the study's user attr: host_environment() of the search host
SERVER_VERSION_KEY = "server_version"  # a live run's config: what the server's GET /version said
SERVER_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "engine": "kvengine server", "url": "running server"}
TFLOP, TB, GB = 1e12, 1e12, 1e9


def context_section(data: ReportData) -> list[Block]:
    env = data.study.user_attrs.get(ENVIRONMENT_ATTR)
    env = env if isinstance(env, dict) else None
    lines = [_when(data, env), _versions(data, env), _stage1(data), _stage2(data), _hardware(env, data),
             _headroom(data)]
    blocks: list[Block] = [Heading("What was measured, where, when"), Bullets([x for x in lines if x])]
    return blocks + _workload(data)


# ---------------------------------------------------------------- when

def _when(data: ReportData, env: dict | None) -> str:
    text = f"**Report written** {fmt.utc(datetime.now(UTC))}."
    trials = data.study.get_trials(deepcopy=False)
    offset = timezone(timedelta(seconds=env["utc_offset_s"])) if env and isinstance(
        env.get("utc_offset_s"), int) else None
    starts = [_aware(t.datetime_start, offset) for t in trials if t.datetime_start is not None]
    ends = [_aware(t.datetime_complete, offset) for t in trials if t.datetime_complete is not None]
    if not starts:
        return text
    first, last = min(starts), max(ends + starts)
    end = fmt.utc(last)
    if end[:10] == fmt.utc(first)[:10]:
        end = end[11:]  # the same day: its time only
    text += (f" **Stage 1 ran** from {fmt.utc(first)} to {end} "
             f"({fmt.seconds((last - first).total_seconds())}, {len(trials)} trials).")
    if offset is None:
        text += " (Optuna stores local times without a zone, and the study does not record the search host's: " \
                "read in this machine's zone.)"
    return text


def _aware(moment: datetime, offset: timezone | None) -> datetime:
    """Optuna's naive local times, in the search host's zone (recorded), else this machine's."""
    if moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=offset) if offset is not None else moment.astimezone()


# ---------------------------------------------------------------- versions and targets

def _versions(data: ReportData, env: dict | None) -> str:
    mine = package_version(DISTRIBUTION)
    parts = [f"kvtune {mine or 'unknown'} wrote this report"]
    if env:
        searched = env.get("kvtune")
        ran = f"the search ran kvtune {searched or 'unknown'}"
        if env.get("kvengine"):
            ran += f" (kvengine {env['kvengine']})"
        if searched and mine and searched != mine:
            ran += " (**another version**: re-run the search to compare like with like)"
        parts.append(ran)
        extras = [f"Python {env['python']}"] if env.get("python") else []
        extras += [f"{name} {version}" for name, version in (env.get("packages") or {}).items()]
        if extras:
            parts.append(", ".join(extras))
    else:
        parts.append("the search's versions were not recorded")
    servers = _server_versions(data)
    if servers:
        parts.append("live server: " + ", ".join(servers))
    return "**Versions**: " + "; ".join(parts) + "."


def _server_versions(data: ReportData) -> list[str]:
    out = []
    for run in _live_runs(data):
        version = run.result.config.get(SERVER_VERSION_KEY)
        name = SERVER_NAMES.get(run.result.target, run.result.target)
        text = f"{name} {version}" if version else f"{name} (version not recorded)"
        if text not in out:
            out.append(text)
    return out


def _live_runs(data: ReportData) -> list[RunView]:
    runs = [r for r in (data.best_run, data.default_run) if r is not None and r.stage == "live"]
    return [r for i, r in enumerate(runs) if all(r.run_id != o.run_id for o in runs[:i])]


def _stage1(data: ReportData) -> str:
    info = data.info
    profile = data.study.user_attrs.get("profile")
    costs = (f"step times from the calibrated cost profile `{profile}`" if profile
             else "step times from the roofline cost model (not calibrated to a real server)")
    return (f"**Stage 1** ran on the **simulator**: kvengine's scheduler and KV cache manager replaying the trace "
            f"in virtual time, model `{info.model}` on the simulated device {_device_text(info.device)}"
            + (f" × {info.tensor_parallel_size} (tensor parallel)" if info.tensor_parallel_size > 1 else "") + ", "
            f"{costs}. No real GPU ran these trials.")


def _device_text(name: str | None) -> str:
    if not name:
        return "(not recorded)"
    try:
        d = device_preset(name)
    except ConfigError:
        return f"`{name}`"
    bandwidth = (f"{d.hbm_bandwidth / TB:.3g} TB/s" if d.hbm_bandwidth >= TB
                 else f"{d.hbm_bandwidth / GB:.3g} GB/s")
    return f"`{name}` ({fmt.gib(d.memory_bytes)}, {bandwidth} memory bandwidth, {d.bf16_flops / TFLOP:.3g} TFLOP/s BF16)"


def _stage2(data: ReportData) -> str:
    if not data.live:
        return "**Stage 2** (live re-runs) did not run."
    kinds = sorted({m.target for m in data.live if m.target})
    runs = _live_runs(data)
    described = [_target_text(kind, next((r for r in runs if r.result.target == kind), None)) for kind in kinds]
    configs = len({tuple(sorted(m.params.items(), key=str)) for m in data.live})
    runs_text = f" ({len(data.live)} runs)" if len(data.live) != configs else ""
    return (f"**Stage 2** re-ran {configs} config{'s' if configs != 1 else ''}{runs_text} on "
            + ("; ".join(described) or "a live target (kind not recorded)") + ".")


def _target_text(kind: str, run: RunView | None) -> str:
    config = run.result.config if run is not None else {}
    version = config.get(SERVER_VERSION_KEY)
    model = f" `{run.result.model}`" if run is not None and run.result.model else ""
    if kind == "engine":
        executor = launch.executor if (launch := Launch.of(config)) else None
        device = run.result.device if run is not None else None
        if executor == "sim":
            return (f"the bundled kvengine server with the **sim executor**: the simulated device "
                    f"{_device_text(device)} replayed in real (wall-clock) time behind a real HTTP server, "
                    "**not a real GPU server**: its latencies are the cost model's")
        if executor == "torch":
            return f"the bundled kvengine server running real forward passes (torch executor) of{model} on `{device}`"
        return ("the bundled kvengine server (its executor was not recorded; with `kvtune search`'s default, "
                "--executor sim, that is the simulated device replayed in real time, not a real GPU server)")
    name = SERVER_NAMES.get(kind, kind)
    if kind == "url":
        return f"an already running server (the url target: kvtune neither started nor configured it){model}"
    return f"a live {name}{' ' + version if version else ''} server started by kvtune, serving{model}"


# ---------------------------------------------------------------- hardware

def _hardware(env: dict | None, data: ReportData) -> str:
    if env is None:
        return ("**Search host**: not recorded (this study stores no `environment`; a search with this kvtune "
                "records it).")
    cores = env.get("cpu_count")
    usable = env.get("cpu_affinity")
    cpu = env.get("cpu_model") or "CPU model unknown"
    cpu += f", {cores} logical cores" if cores else ""
    cpu += f" ({usable} usable by kvtune)" if usable and usable != cores else ""
    memory = f"{fmt.gib(env['memory_total_bytes'])} memory" if env.get("memory_total_bytes") else "memory unknown"
    if env.get("memory_limit_bytes"):
        memory += f" (container limit {fmt.gib(env['memory_limit_bytes'])})"
    gpus = env.get("gpus") or []
    if gpus:
        gpu = ", ".join(f"{g.get('name', 'GPU')} ({fmt.gib(g.get('memory_total_bytes'))})" for g in gpus)
        gpu = f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}: {gpu}"
    else:
        gpu = "no GPU" + (f" ({env['gpu_status'].removeprefix('no GPU: ')})" if env.get("gpu_status") else "")
        gpu = gpu.replace(" (no NVIDIA driver installed))", ": no NVIDIA driver installed)")
    system = " ".join(x for x in (env.get("os"), env.get("kernel")) if x)
    if env.get("distro"):
        system += f", {env['distro']}"
    host = f" `{env['hostname']}`" if env.get("hostname") else ""
    where = ""
    if data.live and any(m.target == "url" for m in data.live):
        where = " The url target's server may run elsewhere: its hardware is not this."
    elif data.live:
        where = " Stage 2's servers ran on this host."
    return f"**Search host**{host}: {cpu}; {memory}; {gpu}; {system or 'OS unknown'}.{where}"


# ---------------------------------------------------------------- KV headroom

def _headroom(data: ReportData) -> str:
    head = data.headline
    if head is None:
        return "**KV headroom**: no configuration completed a run, so there is no KV usage to report."
    m = head.measured
    run = data.best_run
    peak = m.summary.get("kv_usage_peak") if m is not None else None
    if peak is None and run is not None:
        peak = run.result.summary.get("kv_usage_peak")
    which = ("recommended" if data.verdict.recommended is not None else
             "closest" if data.verdict.closest is not None else "best measured")
    where = _measured_on(m, run)
    if peak is None:
        return f"**KV headroom** of the {which} config ({head.label}): KV usage was not recorded {where}."
    text = (f"**KV headroom** of the {which} config ({head.label}): peak KV usage {fmt.pct(peak)} of the pool "
            f"({fmt.pct(max(1 - peak, 0.0))} headroom), measured {where}.")
    pool = pool_of(run.result) if run is not None else None
    if pool is not None:
        usable = max(pool.num_gpu_blocks - 1, 1)  # vLLM's usage leaves out the null block
        used = round(peak * usable) * pool.block_size
        text += (f" The pool holds {fmt.tokens(pool.tokens)} ({fmt.count(pool.num_gpu_blocks)} blocks × "
                 f"{fmt.tokens(pool.block_size)}, {pool.source}): about {fmt.tokens(used)} in use at the peak, "
                 f"{fmt.tokens(max(usable * pool.block_size - used, 0))} free.")
    return text


def _measured_on(m, run: RunView | None) -> str:
    if m is None or m.stage != "live":
        return "on the simulator (stage 1)"
    return f"on {m.measured_on or m.target or 'a live target'} (stage 2)"


# ---------------------------------------------------------------- workload

def _workload(data: ReportData) -> list[Block]:
    stats, source = _workload_stats(data)
    blocks: list[Block] = [Heading("The workload replayed", 3)]
    if stats is None:
        return blocks + [Paragraph(source)]
    inputs, outputs = stats.get("input_len") or {}, stats.get("output_len") or {}
    rows = [["requests", fmt.count(stats.get("requests"))]]
    if stats.get("sessions"):
        rows.append(["conversations (sessions)", fmt.count(stats["sessions"])])
    rows += [["duration (first to last arrival)", fmt.seconds(stats.get("duration_s"))],
             ["mean arrival rate", fmt.rps(stats.get("rate_rps"))]]
    for label, dist in (("prompt", inputs), ("output", outputs)):
        rows += [[f"{label} length {q}", fmt.tokens(dist.get(q))] for q in ("p50", "p95", "max")]
    rows += [["prompt tokens, all requests", fmt.tokens(stats.get("prompt_tokens"))],
             ["output tokens, all requests", fmt.tokens(stats.get("output_tokens"))],
             [f"ideal prefix-cache hit rate ({fmt.count(stats.get('block_size'))}-token blocks, unbounded cache)",
              f"{fmt.pct(stats.get('ideal_prefix_hit_rate'))} of prompt tokens"]]
    dropped = (stats.get("skipped") or 0) + (stats.get("failed") or 0)
    if dropped:
        rows.append(["records left out (unreadable, or never answered)", fmt.count(dropped)])
    note = _replayed_note(data, stats)
    return blocks + [Paragraph(source + note), Table(["workload", "value"], rows, numeric=[False, True])]


def _workload_stats(data: ReportData) -> tuple[dict | None, str]:
    """The trace's figures: measured again from the file where it is here, else as a stored run measured them."""
    path = data.info.workload
    block_size = _block_size(data)
    runs = sorted((r for r in (data.best_run, data.default_run) if r is not None and r.result.workload),
                  key=lambda r: r.stage != "sim")  # stage 1 replayed the whole trace; stage 2 maybe its head
    if path and os.path.exists(path):
        try:
            stats = workload_stats(read_workload(path), block_size=block_size)
        except (TraceError, OSError, ValueError) as err:
            problem = f"the trace file `{path}` cannot be read now ({err})"
        else:
            replayed = next((r for r in runs if r.stage == "sim"), None)
            if replayed is None or _same_trace(stats, replayed.result.workload):
                return stats, f"From the trace file `{path}`, read again for this report."
            problem = (f"the trace file `{path}` has changed since the search (it now holds "
                       f"{fmt.count(stats.get('requests'))} requests)")
    else:
        problem = f"the trace file `{path}` is not on this machine" if path else "the study names no trace file"
    if runs:
        run = runs[0]
        return run.result.workload, f"Figures as {run.stage} run {run.run_id} measured them when it ran: {problem}."
    return None, f"No workload figures: {problem}, and no stored run carries its profile."


def _same_trace(now: dict, then: dict) -> bool:
    return all(now.get(k) == then.get(k) for k in ("requests", "prompt_tokens", "output_tokens"))


def _block_size(data: ReportData) -> int:
    run = data.best_run
    size = (run.result.config.get("block_size") if run is not None else None) or \
        (data.headline.params.get("block_size") if data.headline is not None else None)
    try:
        return max(int(size), 1) if size else 16
    except (TypeError, ValueError):
        return 16


def _replayed_note(data: ReportData, stats: dict) -> str:
    """Where a stage replayed fewer requests than these figures describe (stage 2's --live-head), or more."""
    shown = stats.get("requests") or 0
    stage1 = max((t.summary.get("requests") or 0 for t in data.trials), default=0)
    stage2 = max((m.summary.get("requests") or 0 for m in data.live), default=0)
    if stage1 > shown:
        return (f" These are the figures of the first {fmt.count(shown)} requests, which stage 2 replayed; "
                f"stage 1 replayed all {fmt.count(stage1)}.")
    if 0 < stage2 < shown:
        return f" Stage 2 replayed only the first {fmt.count(stage2)} of these requests (--live-head)."
    return ""
