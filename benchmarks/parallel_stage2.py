#!/usr/bin/env python3
"""Stage 2 on 2 Ray slots against stage 2 run serially (issue 44, point 6): the wall-time ratio
(goal: at most 0.6 with 2 slots) and whether the two verdicts agree.

The same race both ways (`search.stage2.run_stage2`, the bundled engine with its sim executor as
the live server): the default serving 2 sequences at a time against 8 and 64, --repeats 2
--max-repeats 4, 40 short requests at 10/s (more than 2 sequences at a time keep up with). Serially, one run after another on this machine;
in parallel, on a local Ray cluster this script starts (`ray start --head` with 2 fake GPUs, in a
temporary folder and a session of its own, so that stopping it ends only its processes), 2 rounds
at a time, one slot each (`cluster.pool.RayPool`). Wall time is stage 2's alone (the cluster's
start is not in it; joining it is).

Two verdicts each way: the one ranking's on the stored runs (`ranking.choose`, as `kvtune search`
reports it), and the same on the runs' figures with their doubts set aside: on a machine with
fewer cores than slots × (server + load generator) the parallel runs time each other, which
their doubts rightly say, and which turns a change of flags "inconclusive". `agree` compares the
figures' verdicts (kind and recommended config); `agree_as_reported` the reported ones.

    python benchmarks/parallel_stage2.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from kvengine.config import EngineConfig
from kvtune.cluster.pool import connect
from kvtune.cluster.target import RayTarget
from kvtune.search.live_runs import live_runs
from kvtune.search.objective import Objective
from kvtune.search.ranking import choose
from kvtune.search.space import load_space
from kvtune.search.stage2 import LiveConfig, LivePlan, run_stage2
from kvtune.store import Store
from kvtune.targets import EngineTarget, LiveOptions
from kvtune.workload import TraceRequest, Workload

SPACE = load_space(None, ["block_size=16", "max_num_seqs=2,8,64", "kv_cache_dtype=auto"])
DEFAULT = {"block_size": 16, "max_num_seqs": 2, "kv_cache_dtype": "auto"}
CANDIDATES = [LiveConfig("default", -1, DEFAULT), LiveConfig("trial 1", 1, DEFAULT | {"max_num_seqs": 8}),
              LiveConfig("trial 2", 2, DEFAULT | {"max_num_seqs": 64})]
SLOTS = 2


def workload() -> Workload:
    return Workload([TraceRequest(i / 10.0, 200, 16) for i in range(40)])


def target() -> EngineTarget:
    return EngineTarget(options=LiveOptions(scrape_interval_s=0.25, watch_interval_s=0.25, device="l4-24gb"),
                        executor="sim", preset="llama-3-8b", device="l4-24gb", extra_args="--max-model-len 4096")


def race(db: str, run, pool=None) -> float:
    """Stage 2's wall time."""
    started = time.monotonic()
    run_stage2(run, [LiveConfig(c.label, c.number, dict(c.params)) for c in CANDIDATES], SPACE, EngineConfig(),
               workload(), Objective("throughput", ()), Store(db), "bench", LivePlan(2, 4), pool=pool)
    return time.monotonic() - started


def timeline(db: str, since: float) -> list[str]:
    """Each parallel run: its config, round, slot's GPUs and its start and end in seconds from `since`."""
    store, lines = Store(db), []
    for m in live_runs(store, "bench", ()):
        slot = store.load_run(m.run_id).summary.get("slot") if m.ok else None
        if slot:
            lines.append(f"trial {m.number} #{m.repeat} GPU {','.join(slot['gpus'])}: "
                         f"{slot['started'] - since:.1f}-{slot['ended'] - since:.1f} s")
    return lines


def verdicts(db: str) -> tuple[dict, dict, int]:
    """The reported verdict, the figures' verdict (doubts aside), and how many runs completed."""
    runs = [m for m in live_runs(Store(db), "bench", ()) if m.ok]
    reported = choose([], runs, [], DEFAULT, 3)[0]
    for m in runs:
        m.doubts = []
    figures = choose([], runs, [], DEFAULT, 3)[0]
    return _said(reported), _said(figures), len(runs)


def _said(v) -> dict:
    return {"kind": v.kind, "recommended": v.recommended.params if v.recommended else None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """`ray start --head` with SLOTS fake GPUs, in its own temporary folder and session."""

    def __enter__(self) -> str:
        self.temp = tempfile.mkdtemp(prefix="kvray-")
        port = _free_port()
        self.head = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
                                      "--num-cpus", str(SLOTS), "--num-gpus", str(SLOTS), "--port", str(port),
                                      "--include-dashboard=false", "--dashboard-port", str(_free_port()),
                                      "--temp-dir", self.temp, "--disable-usage-stats"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        out, _ = self.head.communicate(timeout=120)
        if self.head.returncode != 0:
            raise SystemExit(f"ray start failed:\n{out}")
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self._pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 3
            while self._pids() and time.monotonic() < deadline:
                time.sleep(0.1)
        shutil.rmtree(self.temp, ignore_errors=True)

    def _pids(self) -> list[int]:
        """Its live processes: the session `ray start` began, or a command line naming its folder."""
        found = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and (int(fields[3]) == self.head.pid or self.temp.encode() in cmdline):
                found.append(int(name))
        return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="kvtune-parallel-")
    try:
        serial_db, parallel_db = f"sqlite:///{work}/serial.db", f"sqlite:///{work}/parallel.db"
        live = target()
        wall_serial = race(serial_db, live.run)
        with LocalCluster() as address:
            started, since = time.monotonic(), time.time()
            pooled = RayTarget(live, connect(address, 1))
            joined = time.monotonic() - started
            try:
                wall_parallel = race(parallel_db, pooled.run, pooled) + joined
            finally:
                pooled.pool.close()
        (rep_s, fig_s, n_s), (rep_p, fig_p, n_p) = verdicts(serial_db), verdicts(parallel_db)
        runs = timeline(parallel_db, since)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = wall_parallel / wall_serial
    out = {"slots": SLOTS, "wall_serial_s": round(wall_serial, 2), "wall_parallel_s": round(wall_parallel, 2),
           "ratio": round(ratio, 3), "goal_ratio": 0.6, "runs_serial": n_s, "runs_parallel": n_p,
           "verdict_serial": fig_s, "verdict_parallel": fig_p, "agree": fig_s == fig_p,
           "reported_serial": rep_s, "reported_parallel": rep_p, "agree_as_reported": rep_s == rep_p,
           "cpus": os.cpu_count()}
    print(f"stage 2 serially: {wall_serial:.1f} s ({n_s} runs completed); on {SLOTS} Ray slots: {wall_parallel:.1f} s "
          f"({n_p} runs, joining the cluster included): ratio {ratio:.2f} (goal <= 0.6)")
    print(f"verdict on the figures: serial {fig_s['kind']} {fig_s['recommended']}, parallel {fig_p['kind']} "
          f"{fig_p['recommended']}: {'agree' if out['agree'] else 'DISAGREE'}")
    print("parallel runs (from joining the cluster):\n  " + "\n  ".join(runs))
    print(f"verdict as reported (doubts count): serial {rep_s['kind']}, parallel {rep_p['kind']}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
