#!/usr/bin/env python3
"""The torch engine's memory on the CPU against its --device-memory budget, under a full pool.

Starts `kvengine serve --executor torch --preset tiny --device cpu --device-memory BUDGET`,
sends distinct prompts (so every KV block gets written: never-used blocks are handed out
first) 32 at a time, samples the engine core's RSS, and prints the peak against the budget
and against utilisation x budget (what the pool was sized to leave the process within).

    python benchmarks/cpu_memory.py [--budget 1GiB] [--requests 400] [--json]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from kvengine.entrypoints.flags import parse_size
from kvtune.targets.process import free_port

UTILISATION = 0.92  # kvengine's default --gpu-memory-utilization


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: the server exited with status {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit(f"error: the server was not healthy at {url}/health after {timeout_s:.0f} s")


def fill(url: str, core: psutil.Process, requests: int, prompt_len: int, deadline_s: float) -> int:
    """Send the prompts; the peak RSS of the engine core seen meanwhile."""
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 30000) for _ in range(prompt_len)] for _ in range(requests)]

    def one(ids):
        httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 64, "ignore_eos": True},
                   timeout=300)

    peak, start = core.memory_info().rss, time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(one, ids) for ids in prompts]
        while not all(f.done() for f in futures) and time.monotonic() - start < deadline_s:
            peak = max(peak, core.memory_info().rss)
            time.sleep(0.2)
        for f in futures:
            f.cancel()
    return max(peak, core.memory_info().rss)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="1GiB", help="--device-memory of the server (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=400, help="distinct prompts sent (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=1000, help="tokens per prompt (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args()
    budget = parse_size(args.budget)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="kvengine-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "kvengine", "serve", "--port", str(port), "--executor", "torch",
                             "--preset", "tiny", "--device", "cpu", "--device-memory", args.budget],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            start_new_session=True)
    try:
        wait_healthy(url, proc)
        core = max(psutil.Process(proc.pid).children(recursive=True), key=lambda p: p.memory_info().rss)
        idle = core.memory_info().rss
        peak = fill(url, core, args.requests, args.prompt_len, deadline_s=600)
    finally:
        proc.terminate()
        proc.wait(30)
    lines = open(log.name).read().splitlines()
    pool = next((line.strip() for line in lines if "Available KV cache memory" in line), "")
    profile = next((line.strip() for line in lines if "Memory profiling" in line), "")
    out = {"budget_mib": budget / 2**20, "core_rss_idle_mib": round(idle / 2**20),
           "core_rss_peak_mib": round(peak / 2**20), "peak_over_budget": round(peak / budget, 3),
           "peak_over_utilised_budget": round(peak / (UTILISATION * budget), 3), "pool": pool,
           "profile": profile}
    print(f"engine core RSS: idle {out['core_rss_idle_mib']} MiB, peak {out['core_rss_peak_mib']} MiB "
          f"= {out['peak_over_budget']:.1%} of the {args.budget} budget ({pool})")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
