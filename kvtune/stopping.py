"""Start a child process with no window in which a signal can orphan it.

kvtune's stop signals (Ctrl-C, SIGTERM, SIGHUP) raise in the main thread. One that
lands inside subprocess.Popen after the child exists, but before Popen returns,
unwinds without the handle: nothing can stop that child any more. `spawn` holds
those signals for the few milliseconds of the start and handles them once the
child is in the caller's hands.
"""
from __future__ import annotations

import signal
import subprocess
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def spawn(command: list[str], keep: Callable[[subprocess.Popen], None], **popen_kwargs) -> subprocess.Popen:
    """Popen(`command`), handed to `keep` (which records it for the caller's cleanup) before any
    stop signal that came meanwhile is handled."""
    if threading.current_thread() is not threading.main_thread():  # signals only reach the main thread
        proc = subprocess.Popen(command, **popen_kwargs)
        keep(proc)
        return proc
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in STOP_SIGNALS}
    try:
        proc = subprocess.Popen(command, **popen_kwargs)
        keep(proc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if held:  # now the handler's exception unwinds through a caller that holds the child
            signal.raise_signal(held[0])
    return proc
