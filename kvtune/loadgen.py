"""Open-loop trace replay with Locust, driven from the agent as a subprocess.

The agent never imports locust (its gevent monkey-patching breaks threads,
ssl and clean exits in the importing process). This module holds what both
sides share — the replay plan, SSE parsing, the per-request sample — and the
agent's launcher; `kvtune/locustfile.py` holds the Locust users.

Each request is sent at its arrival time, however the server is doing (or, in a
closed loop, once one of its slots is free); its lateness (sent - scheduled) is
recorded, so a load generator that cannot keep up is caught instead of silently
turning into a closed loop.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .results import RequestRecord
from .stopping import spawn
from .targets.process import free_port
from .workload import read_workload, workload_prompt_token_ids

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
LATE_WARN_S = 1.0  # a request sent this late means the generator did not keep up


@dataclass(frozen=True, slots=True)
class ReplayItem:
    index: int
    arrival_s: float
    prompt: list[int] | str
    max_tokens: int


def load_plan(path: str, shard: int = 0, shards: int = 1, use_text: bool = False) -> list[ReplayItem]:
    """This shard's requests (index % shards == shard), with their prompt tokens."""
    workload = read_workload(path)
    plan = []
    for i, (req, tokens) in enumerate(zip(workload.requests, workload_prompt_token_ids(workload))):
        if i % shards != shard:
            continue
        prompt = req.prompt if use_text and req.prompt is not None else tokens
        plan.append(ReplayItem(i, req.arrival_s, prompt, req.output_length))
    return plan


def sse_payload(line: str):
    """One SSE line of an OpenAI-style stream -> its JSON payload, "DONE" for `data: [DONE]`, or None
    for blank, comment and other non-`data:` lines. kvtune's one parser of these lines: the locustfile's
    replay and calibrate's probes (kvtune.calibrate.stream.stream_request) both read streams with it."""
    if not line or not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "DONE"
    return json.loads(data)


def record_from_sample(s: dict) -> RequestRecord:
    """A raw sample line (written by the locustfile) as the RunResult's request record."""
    return RequestRecord(
        request_id=str(s["index"]), arrival_s=s["scheduled_s"], prompt_tokens=s.get("prompt_tokens") or 0,
        output_tokens=s.get("output_tokens") or 0, ttft_s=s.get("ttft_s"), tpot_s=s.get("tpot_s"),
        e2e_s=s.get("e2e_s"), queue_s=None, itl_s=s.get("itl_s") or [], finish_reason=s.get("finish_reason"),
        error=s.get("error"))


@dataclass
class LoadResult:
    samples: list[dict]
    returncode: int
    log: str
    max_lateness_s: float

    @property
    def kept_up(self) -> bool:
        return self.max_lateness_s < LATE_WARN_S

    @property
    def records(self) -> list[RequestRecord]:
        return sorted((record_from_sample(s) for s in self.samples), key=lambda r: int(r.request_id))


def _locust_cmd(host: str, workload: str, samples: str, model: str | None, users: int, run_time_s: int,
                shards: int, max_concurrency: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
           "-u", str(users), "-r", str(users), "--run-time", f"{run_time_s}s", "--stop-timeout", "10",
           "--only-summary", "--loglevel", "WARNING",
           "--kvtune-workload", workload, "--kvtune-samples", samples, "--kvtune-shards", str(shards)]
    if model:
        cmd += ["--kvtune-model", model]
    if max_concurrency:
        cmd += ["--kvtune-max-concurrency", str(max_concurrency)]
    return cmd


def run_load(host: str, workload_path: str, model: str | None = None, users: int = 256,
             run_time_s: int = 600, workers: int = 0, timeout_s: float | None = None,
             watch=None, watch_interval_s: float = 1.0, max_concurrency: int | None = None) -> LoadResult:
    """Replay `workload_path` against `host` with Locust in subprocesses; `workers` > 0
    runs a master and that many workers on loopback, each replaying its shard.
    `max_concurrency`: a closed loop with at most that many requests in flight (locustfile.py).

    `watch()` is called every `watch_interval_s` while the replay runs; whatever it raises
    (the server died) ends the replay at once and is raised from here."""
    out = tempfile.mkdtemp(prefix="kvtune-load-")
    samples = os.path.join(out, "samples")
    shards = max(workers, 1)
    users = max(users, max_concurrency or 0)  # one user per request in flight
    base = _locust_cmd(host, workload_path, samples, model, users, run_time_s, shards, max_concurrency)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    timeout_s = timeout_s or run_time_s + 60
    procs = []
    try:
        with open(os.path.join(out, "master.log"), "w+") as log_file:  # a file: no pipe to fill up
            master = _start_locust(base, workers, log_file, env, procs)
            rc = _wait_locust(master, procs, timeout_s, watch, watch_interval_s)
            log_file.seek(0)
            log = log_file.read() + ("" if rc is not None else f"\nkilled after {timeout_s:.0f} s")
    except BaseException:  # a signal, Ctrl-C, or the watch: the load generator ends with kvtune
        _kill(procs)
        shutil.rmtree(out, ignore_errors=True)
        raise
    try:
        return _collect(out, samples, rc if rc is not None else -9, log)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _start_locust(base: list[str], workers: int, log_file, env: dict, procs: list) -> subprocess.Popen:
    """The master (and its workers), appended to `procs` as each starts: the master first."""
    if not workers:
        spawn(base, procs.append, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
        return procs[0]
    port = free_port()
    spawn(base + ["--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                  "--expect-workers", str(workers)],
          procs.append, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
    worker_cmd = [a for a in base if a not in ("--headless",)]
    for _ in range(workers):
        spawn(worker_cmd + ["--worker", "--master-host", "127.0.0.1", "--master-port", str(port)],
              procs.append, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return procs[0]


def _wait_locust(master: subprocess.Popen, procs: list, timeout_s: float, watch,
                 interval_s: float) -> int | None:
    """The master's exit status once it (and its workers) ended; None when killed at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            master.wait(timeout=max(0.0, min(interval_s, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                _kill(procs)
                return None
            if watch is not None:
                watch()
    for p in procs[1:]:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a worker the master could not stop
            _kill([p])
    return master.returncode


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def _collect(out: str, samples_prefix: str, rc: int, log: str) -> LoadResult:
    samples = []
    for name in sorted(os.listdir(out)):
        if name.startswith(os.path.basename(samples_prefix)):
            with open(os.path.join(out, name)) as f:
                samples += [json.loads(line) for line in f if line.strip()]
    lateness = max((s["lateness_s"] for s in samples), default=0.0)
    return LoadResult(samples, rc, log, lateness)
