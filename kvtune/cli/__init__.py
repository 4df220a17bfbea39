"""`kvtune`: measure, explain and tune the KV cache of vLLM-style servers."""
from __future__ import annotations

import _thread
import argparse
import os
import signal
import sys
import threading
import time

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
from .targets.process import Terminated, signal_number  # noqa: E402
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


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOPPED = "the servers it started are stopped"


class _Stop:
    """The first stop signal, and whether its exception must be raised again.

    A handler's exception that lands in a `__del__` or a weakref callback (SQLAlchemy's, during
    a garbage collection) is printed as "Exception ignored" and dropped: kvtune would go on to
    the end and exit 0. The unraisable hook sees it dropped and delivers the signal again, once
    the collection is over."""
    signum: int | None = None
    redeliver = False


def _on_signal(signum, _frame):
    if _Stop.signum is not None and not _Stop.redeliver:
        return  # a second signal must not cut short the unwinding the first one started
    _Stop.signum = _Stop.signum or signum
    _Stop.redeliver = False
    raise KeyboardInterrupt if _Stop.signum == signal.SIGINT else Terminated(_Stop.signum)


def _on_unraisable(unraisable) -> None:
    if _Stop.signum is not None and isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
        _Stop.redeliver = True
        threading.Thread(target=_deliver_again, args=(_Stop.signum,), daemon=True).start()
        return
    sys.__unraisablehook__(unraisable)


def _deliver_again(signum: int) -> None:
    time.sleep(0.05)  # after the hook has returned: the handler must not raise inside it
    _thread.interrupt_main(signum)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    previous = {sig: signal.signal(sig, _on_signal) for sig in SIGNALS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _on_unraisable
    _Stop.signum, _Stop.redeliver = None, False
    try:
        return _run(args)
    finally:  # main() called in-process (tests) leaves the caller's handlers as they were
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        sys.unraisablehook = previous_hook


ERRORS = (ConfigError, TraceError, StoreError, SpaceError, StudyError, ReportError)


def _run(args) -> int:
    try:
        return args.func(args)
    except BaseException as err:
        signum = signal_number(err)  # first: an error raised while a signal unwound is the signal's
        if signum is not None:
            return _stopped(signum)
        if isinstance(err, ERRORS):
            print(f"error: {err}", file=sys.stderr)
            return 2
        if isinstance(err, OSError):
            print(f"error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
            return 2
        raise


def _stopped(signum: int) -> int:
    """One line, and the shell's status for a command a signal ended (130 for Ctrl-C)."""
    try:
        print(f"kvtune: interrupted; {STOPPED}" if signum == signal.SIGINT else
              f"kvtune: stopped by signal {signum} ({signal.Signals(signum).name}); {STOPPED}", file=sys.stderr)
    except OSError:  # SIGHUP: the terminal may be gone
        pass
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
