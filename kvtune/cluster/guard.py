"""`python -m kvtune.cluster.guard WORKER_PID`: ends the servers a Ray worker started once the worker is gone.

A force-cancelled Ray task (`ray.cancel(force=True)`, what `pool.RayPool.cancel` does on Ctrl-C) and a
worker whose node is lost die by SIGKILL: no `finally` of ours runs, and `targets.process.ManagedServer`
starts each server in a process group of its own, which outlives the worker. This process, started
by `rounds.guarded` as the worker's child, remembers each of the worker's children that leads a
process group (a server); once the worker is gone (this process is no longer its child) it kills
each remembered group. A task that ends normally stops the guard first.
"""
from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.2


def children(pid: int) -> set[int]:
    """The pids whose parent is `pid`, from each process's /proc/PID/stat (every Linux kernel has
    it; /proc/PID/task/TID/children needs a kernel option)."""
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.add(int(name))
    return found


def watch(worker: int) -> None:
    me, groups = os.getpid(), set()
    while os.getppid() == worker:
        for child in children(worker) - {me}:
            try:
                if os.getpgid(child) == child:
                    groups.add(child)
            except ProcessLookupError:
                continue
        groups = {g for g in groups if _exists(g)}  # an ended server's number may be reused
        time.sleep(POLL_S)
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _exists(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the worker's end or the task's own stop ends it
    watch(int(sys.argv[1]))
