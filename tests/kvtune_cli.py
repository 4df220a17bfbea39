"""kvtune's command line as the tests run it: `kvtune` runs the real entry point in a subprocess (what
an operator's shell runs: exit code, stdout, stderr); `kvtune_main` runs `kvtune.cli.main` in this
process (the same parser, dispatch and error handling; capsys sees its output)."""
from __future__ import annotations

import subprocess
import sys


def kvtune(*args, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """`python -m kvtune ARGS` to its end (at most `timeout` s), its output captured as text."""
    return subprocess.run([sys.executable, "-m", "kvtune", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def kvtune_main(*argv) -> int:
    """`kvtune ARGV` in this process; its exit code."""
    from kvtune.cli import main

    return main([str(a) for a in argv])
