"""kvtune's stop signals: the exception each raises, what a run records of it, and children
started with no window in which a signal can orphan them.

The stop signals (Ctrl-C, SIGTERM, SIGHUP) raise in the main thread. One that
lands inside subprocess.Popen after the child exists, but before Popen returns,
unwinds without the handle: nothing can stop that child any more. `spawn` holds
those signals for the few milliseconds of the start and handles them once the
child is in the caller's hands.
"""
from __future__ import annotations

import contextlib
import gc
import signal
import subprocess
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_signals_held():
    """A block that no stop signal interrupts: one that comes meanwhile is handled as it ends, so
    that what the block made (a child, a trial in the store) is already in its caller's hands."""
    if threading.current_thread() is not threading.main_thread():  # signals only reach the main thread
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if held:  # now the handler's exception unwinds through a caller that holds what was made
            signal.raise_signal(held[0])


def spawn(command: list[str], keep: Callable[[subprocess.Popen], None], **popen_kwargs) -> subprocess.Popen:
    """Popen(`command`), handed to `keep` (which records it for the caller's cleanup) before any
    stop signal that came meanwhile is handled."""
    with stop_signals_held():
        proc = subprocess.Popen(command, **popen_kwargs)
        keep(proc)
    return proc


class Terminated(BaseException):
    """SIGTERM or SIGHUP (its number is args[0]): unwind, so every server and load generator
    kvtune started is stopped. Not an Exception, so no `except Exception` swallows it."""


def interruption(err: BaseException | None) -> str | None:
    """The signal that interrupted kvtune ("SIGTERM", "SIGINT"), or None when `err` is none.

    An error raised while the signal unwound counts too: a library's cleanup that failed on
    the way (Optuna's, cut short mid-`tell`, raises UnboundLocalError) hides the signal."""
    for each in _unwound(err):
        if isinstance(each, KeyboardInterrupt):
            return "SIGINT"
        if isinstance(each, Terminated) and each.args:
            return signal.Signals(each.args[0]).name
    return None


def _unwound(err: BaseException | None):
    """`err` and the exceptions it was raised while handling (`__context__`), each once."""
    seen = set()
    while err is not None and id(err) not in seen:
        yield err
        seen.add(id(err))
        err = err.__context__


def failure_reason(err: BaseException) -> str:
    """What a run or trial records when `err` ended it: 'interrupted by SIGTERM', or the error.
    Its callers write it to the store next: a stop signal's unwinding is let go of first (`_let_go`)."""
    signal_name = interruption(err)
    if signal_name is None:
        return f"{type(err).__name__}: {err}"
    _let_go(err)
    return f"interrupted by {signal_name}"


def _let_go(err: BaseException) -> None:
    """Drop what the calls a stop signal cut short still hold. The exception's traceback keeps
    every frame it unwound, and so what those calls had open: a SQLAlchemy connection inside a
    write transaction keeps SQLite's write lock, and the write that records the stop (the trial
    failed, the run marked) was refused as "database is locked", leaving the trial RUNNING. The
    tracebacks go (a stop is reported in one line, without one) and a collection ends the rest."""
    for each in _unwound(err):
        each.__traceback__ = None
    gc.collect()


def signal_number(err: BaseException) -> int | None:
    """The number of the signal `interruption` finds in `err`."""
    name = interruption(err)
    return None if name is None else int(signal.Signals[name])
