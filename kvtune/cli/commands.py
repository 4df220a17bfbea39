"""kvtune's commands: where each one's parser lives, and its line in `kvtune --help`.

`kvtune COMMAND ...` imports that command's module only, so each command loads
what it runs on and no other's, and `kvtune --help` loads none.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str  # under kvtune.cli
    adder: str  # its function that adds the command to the subparsers
    help: str


COMMANDS = {
    "trace": Command("trace", "add_trace_commands", "inspect, convert and synthesize workload traces"),
    "run": Command("run", "add_run_command", "replay a workload on a target and summarise it"),
    "search": Command("search", "add_search_command",
                      "find the KV-cache config that serves a workload best within its SLOs"),
    "report": Command("report", "add_report_command",
                      "write a study's tuning report (Markdown + self-contained HTML)"),
    "diagnose": Command("diagnose", "add_diagnose_command",
                        "find the fault card's KV-cache faults in a run or on a live server"),
    "plan": Command("plan", "add_plan_command",
                    "KV-cache capacity: bytes per token, pool, tokens that fit, max concurrency"),
    "ui": Command("ui", "add_ui_command", "the web UI: runs, searches, diagnoses, capacity planner and live view"),
    "calibrate": Command("calibrate", "add_calibrate_command",
                         "fit the sim's cost model to a live server and save it as a named profile"),
}
