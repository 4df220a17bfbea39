"""The two windows in which a stop signal used to be lost: inside a child's start (the child
outlived kvtune) and inside a destructor (Python dropped the exception; kvtune ran to the end)."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kvtune.stopping import spawn


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt


def test_a_signal_during_a_child_start_unwinds_with_the_child_in_hand():
    previous = signal.signal(signal.SIGINT, _raise_interrupt)
    started = []

    def keep(proc):
        started.append(proc)
        os.kill(os.getpid(), signal.SIGINT)  # the child exists, spawn has not returned: the old window
        for _ in range(1000):  # where the handler would run, were the signal not held
            pass

    try:
        with pytest.raises(KeyboardInterrupt):
            spawn([sys.executable, "-c", "import time; time.sleep(30)"], keep)
    finally:
        signal.signal(signal.SIGINT, previous)
        for proc in started:
            proc.kill()
            proc.wait()
    assert len(started) == 1 and started[0].returncode == -signal.SIGKILL  # the caller could stop it


DROPPED_IN_A_DESTRUCTOR = textwrap.dedent("""
    import argparse, os, signal, sys, time
    from kvtune import cli

    class Collected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler raises here, where Python drops the exception
                pass

    def job(_args):
        Collected()
        for _ in range(300):
            time.sleep(0.01)
        print("ran to the end")
        return 0

    def parser(only=None):
        p = argparse.ArgumentParser(prog="kvtune")
        p.add_subparsers().add_parser("job").set_defaults(func=job)
        return p

    cli.build_parser = parser  # a command of the test's own, under kvtune's real signal handling
    sys.exit(cli.main(["job"]))
""")


def test_a_signal_dropped_in_a_destructor_still_stops_kvtune():
    p = subprocess.run([sys.executable, "-c", DROPPED_IN_A_DESTRUCTOR], capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, (p.stdout, p.stderr)
    assert "ran to the end" not in p.stdout
    assert p.stderr.strip().splitlines() == ["kvtune: stopped by signal 15 (SIGTERM); the servers it started are stopped"]
