"""`kvtune`: measure, explain and tune the KV cache of vLLM-style servers."""
from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before anything imports torch

from kvengine.config import ConfigError  # noqa: E402

from .calibrate import add_calibrate_command  # noqa: E402
from .diagnose import add_diagnose_command  # noqa: E402
from .plan_cli import add_plan_command  # noqa: E402
from .report import ReportError, add_report_command  # noqa: E402
from .run_cmd import add_run_command  # noqa: E402
from .search.cli import add_search_command  # noqa: E402
from .search.space import SpaceError  # noqa: E402
from .search.study import StudyError  # noqa: E402
from .store import StoreError  # noqa: E402
from .ui.cli import add_ui_command  # noqa: E402
from .workload import TraceError, add_trace_commands  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtune", description="Measure, explain and tune the KV cache of vLLM-style servers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_trace_commands(sub)
    add_run_command(sub)
    add_search_command(sub)
    add_report_command(sub)
    add_diagnose_command(sub)
    add_plan_command(sub)
    add_ui_command(sub)
    add_calibrate_command(sub)
    return parser


class Terminated(BaseException):
    """SIGTERM or SIGHUP: unwind, so every server and load generator kvtune started is stopped."""


def _on_signal(signum, _frame):
    raise Terminated(signum)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    try:
        return args.func(args)
    except (ConfigError, TraceError, StoreError, SpaceError, StudyError, ReportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return 2
    except Terminated as sig:
        print(f"kvtune: stopped by signal {sig.args[0]}; the servers it started are stopped", file=sys.stderr)
        return 128 + sig.args[0]


if __name__ == "__main__":
    sys.exit(main())
