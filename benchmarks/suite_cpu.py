#!/usr/bin/env python3
"""Where the test suite's CPU goes: pytest run under a sampler of /proc, its processes' CPU by component.

On a 2-core host the suite is bound by CPU (docs/architecture.md): its wall time follows the CPU
time of everything it starts, so a faster suite needs less CPU, and this says where it goes. It
runs `python -m pytest` with the arguments after `--` (default: `make test`'s), reads each process's
user + system time from /proc/PID/stat every SAMPLE_S while pytest runs, and sums the processes
pytest started by component: a vLLM start's API server and engine core, kvengine's server and
engine core, each kvtune command, Locust, Chromium, Ray, PostgreSQL, Prometheus, the pytest
processes themselves. A process that lives less than SAMPLE_S may be missed; the host's own total
(/proc/stat, every process of the machine, this sampler included) bounds what was missed.

    .venv/bin/python benchmarks/suite_cpu.py [--json] [-- PYTEST ARGS]

`--json` ends with one object: wall_s, pytest_rc, host_cpu_s, busy (host CPU over wall x cores),
sampled_cpu_s, sampler_cpu_s and by_component ({name: {cpu_s, processes}}).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

SAMPLE_S = 0.25
# `make test`'s pytest line (the Makefile's test target), the default run.
MAKE_TEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
MAKE_TEST_ARGS = ["-p", "xdist.plugin", "-p", "_hypothesis_pytestplugin", "-n", "3", "--dist", "loadfile",
                  "--no-loadscope-reorder"]
TICKS = os.sysconf("SC_CLK_TCK")
# A child whose own command line says only how it was started takes its parent's component.
CHILD_WORDS = ("multiprocessing.spawn", "multiprocessing.resource_tracker", "VLLM::")
CHILD_NAME = {"vLLM API server": "vLLM engine core", "kvengine serve": "kvengine engine core"}


@dataclass
class Process:
    pid: int
    parent: int
    command: str
    cpu_s: float
    component: str = ""


def _stat(pid: str) -> tuple[int, float, int] | None:
    """(parent pid, user + system seconds, start time in ticks) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, int(fields[19])


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _host_cpu_s() -> float:
    """Busy seconds of every CPU since boot: /proc/stat's user, nice, system, irq, softirq, steal."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICKS


class Sampler:
    """Every process that starts after it, by (pid, start time): its command line and latest CPU."""

    def __init__(self):
        self.seen: dict[tuple[int, int], Process] = {}
        self.before = {(int(p), s[2]) for p in os.listdir("/proc") if p.isdigit() and (s := _stat(p))}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(SAMPLE_S)
        self.sample()

    def sample(self) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or not (stat := _stat(pid)):
                continue
            parent, cpu_s, start = stat
            key = (int(pid), start)
            if key in self.before:
                continue
            known = self.seen.get(key)
            if known is None:
                self.seen[key] = Process(int(pid), parent, _command(pid), cpu_s)
            else:
                known.cpu_s = cpu_s
                if not known.command or _is_child(known.command):  # it may have exec'd since
                    known.command = _command(pid) or known.command


def _is_child(command: str) -> bool:
    return any(w in command for w in CHILD_WORDS)


def classify(processes: list[Process]) -> None:
    """Each process's component: its command line's, or a spawned child's parent's."""
    by_pid = {p.pid: p for p in processes}

    def component(p: Process, depth: int = 0) -> str:
        if not p.component:
            parent = by_pid.get(p.parent)
            if _is_child(p.command) and parent is not None and depth < 8:
                of = component(parent, depth + 1)
                p.component = CHILD_NAME.get(of, of)
            else:
                p.component = _named(p.command)
        return p.component

    for p in processes:
        component(p)


def _named(command: str) -> str:
    """The component a command line names, by the program it runs (not by its arguments, which
    hold test folders named after anything)."""
    words = command.split()
    if not words:
        return "other"
    if "exec(eval(sys.stdin.readline()))" in command:  # a pytest-xdist worker (execnet)
        return "pytest"
    exe = os.path.basename(words[0])
    program, after = _program(words)
    if program in ("kvtune", "kvengine"):
        return f"{program} {after}".strip()
    if "/.venv-vllm/" in words[0]:
        return "vLLM API server" if program.startswith("vllm.entrypoints") else "vLLM (other)"
    if program.startswith(("pytest", "xdist")):
        return "pytest"
    if exe.startswith("chrom"):
        return "Chromium"
    if exe.startswith(("ray::", "raylet", "gcs_server")) or "/ray/" in command.split(" -")[0] or program == "ray":
        return "Ray"
    if exe.startswith("postgres"):
        return "PostgreSQL"
    if exe in ("prometheus", "promtool"):
        return "Prometheus"
    if program in ("locust", "streamlit"):
        return program.capitalize()
    return "other Python" if exe.startswith("python") else f"other ({exe[:24]})"


def _program(words: list[str]) -> tuple[str, str]:
    """What a command line runs and its first argument: a Python's module (`-m`), `-c` or script (the
    first of these ends the interpreter's own options), else the executable."""
    exe = os.path.basename(words[0])
    if exe.startswith("python"):
        for i, w in enumerate(words[1:], 1):
            if w in ("-m", "-c") or not w.startswith("-"):
                if w == "-c":
                    return "-c", ""
                at = i + 1 if w == "-m" else i
                name = words[at] if at < len(words) else ""
                return (name if w == "-m" else os.path.basename(name)), (words[at + 1] if at + 1 < len(words) else "")
    return exe, (words[1] if len(words) > 1 else "")


def by_component(processes: list[Process]) -> dict[str, dict]:
    table: dict[str, dict] = defaultdict(lambda: {"cpu_s": 0.0, "processes": 0})
    for p in processes:
        table[p.component]["cpu_s"] += p.cpu_s
        table[p.component]["processes"] += 1
    return {k: {"cpu_s": round(v["cpu_s"], 1), "processes": v["processes"]}
            for k, v in sorted(table.items(), key=lambda kv: -kv[1]["cpu_s"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    ap.add_argument("pytest_args", nargs="*", help="pytest's arguments, after `--` (default: make test's)")
    args = ap.parse_args(argv)
    if not os.path.isdir("/proc/self"):
        print("error: suite_cpu.py reads /proc: Linux only", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "pytest", *(args.pytest_args or MAKE_TEST_ARGS)]
    env = os.environ if args.pytest_args else {**os.environ, **MAKE_TEST_ENV}
    host0, t0 = _host_cpu_s(), time.monotonic()
    with Sampler() as sampler:
        rc = subprocess.call(command, env=env)
    wall_s, host_s = time.monotonic() - t0, _host_cpu_s() - host0
    processes = list(sampler.seen.values())
    classify(processes)
    own = resource.getrusage(resource.RUSAGE_SELF)
    out = {"wall_s": round(wall_s, 1), "pytest_rc": rc, "host_cpu_s": round(host_s, 1),
           "busy": round(host_s / (wall_s * os.cpu_count()), 3),
           "sampled_cpu_s": round(sum(p.cpu_s for p in processes), 1),
           "sampler_cpu_s": round(own.ru_utime + own.ru_stime, 1), "by_component": by_component(processes)}
    print(f"\n# {' '.join(command[1:])}: {wall_s:.0f} s wall, pytest exit status {rc}")
    print(f"host CPU {host_s:,.0f} s over {os.cpu_count()} CPUs ({out['busy']:.0%} busy); sampled from "
          f"{len(processes)} processes {out['sampled_cpu_s']:,.0f} s; this sampler {out['sampler_cpu_s']} s")
    print(f"{'component':<28} {'CPU s':>8} {'share':>6} {'processes':>9}")
    for name, row in out["by_component"].items():
        share = row["cpu_s"] / out["sampled_cpu_s"] if out["sampled_cpu_s"] else 0.0
        print(f"{name:<28} {row['cpu_s']:>8,.1f} {share:>6.0%} {row['processes']:>9}")
    if args.json:
        print(json.dumps(out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
