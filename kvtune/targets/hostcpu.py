"""How busy the host's CPUs were over a run, from /proc/stat: a saturated host times
the server, the load generator and the clients' clocks alike, so its runs compare badly."""
from __future__ import annotations


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies over all CPUs since boot; None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [float(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def busy_fraction(start: tuple[float, float] | None, end: tuple[float, float] | None) -> float | None:
    """The share of all CPUs' time spent busy between two cpu_times() readings."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])
