"""What a run was measured on, in words, and the doubts its own evidence raises.

A doubt is anything that makes a run's figures describe the measurement rather than
the config: clients and server disagree beyond bucket resolution, the load generator
fell behind its schedule or ran out of CPU, the host was saturated, requests failed
or were rejected. The ranking turns a verdict that rests on doubtful runs into
"inconclusive".
"""
from __future__ import annotations

from ..results import Launch, RunResult
from .slo import Score

HOST_BUSY = 0.95  # all CPUs this busy, with the server's own share unknown: the host is timed too
HOST_OTHERS = 0.2  # other work taking this share of all CPUs times itself into every latency


def measured_on(target: str | None, device: str | None, config: dict) -> str:
    """The honest name of what ran a measurement."""
    version = config.get("server_version")
    if target == "sim":
        return f"the simulator ({device}, virtual time)"
    if target == "engine":
        if (launch := Launch.of(config)) and launch.executor == "sim":
            return f"simulated {device}, replayed in real time by kvengine (no model runs)"
        return f"kvengine {version or ''} (real forward passes on {device})".replace("  ", " ")
    if target == "vllm":
        return f"vLLM {version or '(version unknown)'}"
    if target == "sglang":
        return f"SGLang {version or '(version unknown)'}"
    if target == "url":
        return " ".join(["the running server", *([f"at {config['server_url']}"] if config.get("server_url") else []),
                         *([f"(version {version})"] if version else [])])
    return target or "unknown"


def run_doubts(result: RunResult, score: Score) -> list[str]:
    summary = result.summary
    doubts = [f"clients and server disagree: {d}" for d in summary.get("disagreements") or []]
    if summary.get("load_kept_up") is False:
        doubts.append(f"the load generator fell behind its schedule (a request went out "
                      f"{summary.get('max_lateness_s', 0):.1f} s late)")
    if summary.get("load_cpu_warning"):
        doubts.append("the load generator (Locust) warned that its CPU was above 90 %")
    busy, others = summary.get("host_cpu_busy"), summary.get("host_cpu_others")
    if others is not None and others >= HOST_OTHERS:
        doubts.append(f"other work took {others:.0%} of the host's CPUs during the run (all busy: {busy:.0%}): "
                      "it timed the host as much as the config")
    elif others is None and busy is not None and busy >= HOST_BUSY:
        doubts.append(f"the host's CPUs were {busy:.0%} busy over the run: it timed the host as much as the config")
    failed = sum(1 for r in result.requests if r.error and r.finish_reason != "rejected")
    rejected = sum(1 for r in result.requests if r.finish_reason == "rejected")
    if failed:
        doubts.append(f"{failed} of {len(result.requests)} requests failed")
    if rejected:
        doubts.append(f"{rejected} of {len(result.requests)} requests were rejected (longer than max_model_len)")
    return doubts
