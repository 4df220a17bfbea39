"""How busy the host's CPUs were over a run, and how much of that was neither the server
under test nor the load generator: other work on the host times itself into every latency,
so runs beside it compare badly. (A CPU server saturating the host is the server working.)"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class CpuReading:
    wall_s: float
    busy_s: float | None  # CPU-seconds all CPUs spent busy since boot (None without /proc/stat)
    ours_s: float  # this process and its reaped children (the load generator, once it exited)
    server_s: float | None  # the server's process tree, where kvtune started it


def read(server_pid: int | None = None) -> CpuReading:
    ours = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
    return CpuReading(time.monotonic(), _host_busy_s(), ours, _tree_cpu_s(server_pid))


def host_shares(start: CpuReading, end: CpuReading) -> tuple[float | None, float | None]:
    """(busy, others): the share of all CPUs' time busy over the interval, and the share taken by
    anything but kvtune, its load generator and the server's process tree (None where unknown)."""
    span = (end.wall_s - start.wall_s) * (os.cpu_count() or 1)
    if start.busy_s is None or end.busy_s is None or span <= 0:
        return None, None
    busy = (end.busy_s - start.busy_s) / span
    if start.server_s is None or end.server_s is None:
        return busy, None
    mine = (end.ours_s - start.ours_s) + (end.server_s - start.server_s)
    return busy, max(0.0, busy - mine / span)


def _host_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [float(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                continue
        return total
    except psutil.Error:
        return None
