"""The host's CPU over a run: a busy process that is not the server counts as other work (a doubt
about every latency measured beside it); the same process as the server does not. Both are read
over the same interval, so whatever else the host runs counts alike in both."""
import os
import subprocess
import sys
import time

from kvtune.targets import hostcpu

BURN = "import time\nend = time.time() + 4\nwhile time.time() < end: pass\n"


def test_other_work_on_the_host_is_told_apart_from_the_servers_own():
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(6)"])
    burner = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        time.sleep(0.3)
        starts = {pid: hostcpu.read(pid) for pid in (idle.pid, burner.pid, None)}
        time.sleep(1.5)
        ends = {pid: hostcpu.read(pid) for pid in (idle.pid, burner.pid, None)}
    finally:
        for p in (burner, idle):
            p.kill()
            p.wait()
    busy, beside_idle = hostcpu.host_shares(starts[idle.pid], ends[idle.pid])
    _, beside_burner = hostcpu.host_shares(starts[burner.pid], ends[burner.pid])
    one_core = 1 / (os.cpu_count() or 1)
    span = (ends[None].wall_s - starts[None].wall_s) / one_core
    spun = (ends[burner.pid].server_s - starts[burner.pid].server_s) / span  # its share of all CPUs
    tick = 2 * 0.01 / span  # /proc/stat and a process's times count whole clock ticks
    assert spun >= 0.3 * one_core and busy >= spun - tick  # it spun (as much as a loaded host let it)
    # the spinner is other work unless it is the server: the two readings differ by its own share
    assert abs((beside_idle - beside_burner) - spun) <= 0.1 * one_core
    unnamed_busy, unnamed_others = hostcpu.host_shares(starts[None], ends[None])
    assert unnamed_busy >= spun - tick and unnamed_others is None  # no server named: its share is unknown
