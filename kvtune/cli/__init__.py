"""`kvtune`: measure, explain and tune the KV cache of vLLM-style servers."""
from __future__ import annotations

import _thread
import argparse
import logging
import os
import signal
import sys
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before anything imports torch

import importlib  # noqa: E402

from ..stopping import STOP_SIGNALS, Terminated, signal_number  # noqa: E402
from .commands import COMMANDS  # noqa: E402


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """kvtune's parser: with `only`, that command's in full and the others by name and help line
    (their modules not imported); without it, every command's in full."""
    parser = argparse.ArgumentParser(
        prog="kvtune", description="Measure, explain and tune the KV cache of vLLM-style servers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        if only is None or name == only:
            getattr(importlib.import_module(f".{command.module}", __name__), command.adder)(sub)
        else:
            sub.add_parser(name, help=command.help, add_help=False)
    return parser


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
    # The exception can land in SQLAlchemy's connection-reset finalizer, which logs it as a traceback
    # before passing it on: the stop is under way, so the pool's own log is quieted.
    logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)
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
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(only=argv[0] if argv and argv[0] in COMMANDS else "").parse_args(argv)
    previous = {sig: signal.signal(sig, _on_signal) for sig in STOP_SIGNALS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _on_unraisable
    _Stop.signum, _Stop.redeliver = None, False
    try:
        return _run(args)
    finally:  # main() called in-process (tests) leaves the caller's handlers as they were
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        sys.unraisablehook = previous_hook


# The errors a command reports as `error: message` (exit 2): (module, class). A module that was
# never imported raised none, so none is imported to check.
ERRORS = (("kvengine.config", "ConfigError"), ("kvtune.workload.errors", "TraceError"),
          ("kvtune.store", "StoreError"), ("kvtune.search.space", "SpaceError"),
          ("kvtune.search.study", "StudyError"), ("kvtune.search.report_data", "ReportError"))


def _reported(err: BaseException) -> bool:
    return any(isinstance(err, getattr(sys.modules[module], name))
               for module, name in ERRORS if module in sys.modules)


def _run(args) -> int:
    try:
        return args.func(args)
    except BaseException as err:
        signum = signal_number(err)  # first: an error raised while a signal unwound is the signal's
        if signum is not None:
            return _stopped(signum)
        if _reported(err):
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
