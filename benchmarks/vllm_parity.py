#!/usr/bin/env python3
"""kvengine's scheduler + KV cache manager against vLLM's, on the same step trace.

One token per step, no model: each step is schedule(), then every request whose
prefill is done gets one token (ignore_eos), then update_from_output(). This is
exactly what ../shared/tools/vllm_core/driver.py does with vLLM's real V1
Scheduler, so with --vllm-python the two run the same trace and are printed side
by side.

    python benchmarks/vllm_parity.py --scenario hot256
    python benchmarks/vllm_parity.py --scenario tight --vllm-python ~/kvtune-peers/vllm-lite-venv/bin/python --json
    python benchmarks/vllm_parity.py --trace t.jsonl --num-blocks 3000 --max-num-seqs 256

Trace format (driver.py --dump-trace): one JSON object per line with
request_id, prompt_token_ids, max_tokens, arrival_step.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvengine.core.kv_cache_manager import KVCacheManager
from kvengine.config import EngineConfig
from kvengine.core.request import Request, SamplingParams
from kvengine.core.scheduler import Scheduler

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DRIVER = REPO.parent / "shared" / "tools" / "vllm_core" / "driver.py"
KEYS = ("steps", "preemptions", "prefix_hit_tokens", "prefix_query_tokens", "max_running",
        "schedule_us_p50")

# driver.py's SCENARIOS and its defaults for the rest.
SCENARIOS = {
    "hot256": dict(n=1024, num_blocks=20000, max_num_seqs=256, out_min=128, out_max=256),
    "tight": dict(n=512, num_blocks=3000, max_num_seqs=256, out_min=256, out_max=512),
}
SYNTH_DEFAULTS = dict(prefix_len=512, suffix_min=32, suffix_max=256, num_prefixes=1, seed=0)


def synthetic_trace(n, prefix_len, suffix_min, suffix_max, out_min, out_max,
                    num_prefixes=1, seed=0):
    """The same random draws, in the same order, as driver.py's synthetic_trace, so
    a scenario here is token-for-token the trace the driver dumps."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 31000) for _ in range(prefix_len)]
                for _ in range(num_prefixes)]
    trace = []
    for i in range(n):
        suffix = [rng.randrange(100, 31000) for _ in range(rng.randint(suffix_min, suffix_max))]
        trace.append({"request_id": f"r{i}", "prompt_token_ids": prefixes[i % num_prefixes] + suffix,
                      "max_tokens": rng.randint(out_min, out_max), "arrival_step": 0})
    return trace


def load_trace(path: str) -> list[dict]:
    trace = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                trace.append({"request_id": str(item["request_id"]),
                              "prompt_token_ids": [int(t) for t in item["prompt_token_ids"]],
                              "max_tokens": int(item["max_tokens"]),
                              "arrival_step": int(item.get("arrival_step", 0))})
            except (ValueError, KeyError, TypeError) as err:
                sys.exit(f"error: {path}:{lineno}: not a step-trace record ({err!r}); expected "
                         "request_id, prompt_token_ids, max_tokens[, arrival_step]")
    if not trace:
        sys.exit(f"error: {path}: empty trace")
    return trace


def percentile(xs, q):
    """driver.py's nearest-rank percentile, so both columns use one definition."""
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100.0 * (len(xs) - 1)))))
    return xs[k]


def run_kvengine(trace: list[dict], args) -> dict:
    config = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len)
    config.validate()
    kv = KVCacheManager(args.num_blocks, args.block_size, args.max_model_len, enable_caching=True)
    sched = Scheduler(config, kv)
    pending = sorted(trace, key=lambda r: r["arrival_step"])
    pi, step, preemptions, max_running = 0, 0, 0, 0
    schedule_ns = []
    while True:
        while pi < len(pending) and pending[pi]["arrival_step"] <= step:
            item = pending[pi]
            sp = SamplingParams(max_tokens=item["max_tokens"], ignore_eos=True, temperature=0.0)
            sched.add_request(Request(item["request_id"], list(item["prompt_token_ids"]), sp))
            pi += 1
        if pi >= len(pending) and not sched.has_unfinished():
            break
        if step >= args.max_steps:
            print(f"[warn] stopping at max_steps={args.max_steps}", file=sys.stderr)
            break
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        schedule_ns.append(time.perf_counter_ns() - t0)
        preemptions += len(out.preempted)
        max_running = max(max_running, len(sched.running))
        sampled = [7 if r.num_computed_tokens >= r.num_tokens else None for r in out.scheduled]
        sched.update_from_output(out, sampled)
        step += 1
    stats = kv.prefix_stats
    return {"steps": step, "preemptions": preemptions, "prefix_hit_tokens": stats.hits,
            "prefix_query_tokens": stats.queries, "max_running": max_running,
            "schedule_us_p50": round(percentile(schedule_ns, 50) / 1000, 1)}


def run_vllm(trace_path: str, args) -> dict:
    driver = Path(args.driver)
    if not driver.exists():
        sys.exit(f"error: --driver {driver}: no such file")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "vllm.json")
        cmd = [args.vllm_python, str(driver), "--trace", trace_path, "--out", out,
               "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
               "--max-steps", str(args.max_steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: vLLM driver failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
        run = json.load(open(out))["runs"][0]
    return {"steps": run["steps"], "preemptions": run["preemptions"],
            "prefix_hit_tokens": run["prefix_cache"]["hits"],
            "prefix_query_tokens": run["prefix_cache"]["queries"],
            "max_running": run["max_running"],
            "schedule_us_p50": run["schedule_us_all_steps"]["p50"]}


def print_table(ours: dict, theirs: dict | None) -> None:
    print(f"{'':22}{'kvengine':>14}" + (f"{'vLLM':>14}{'kvengine/vLLM':>16}" if theirs else ""))
    for k in KEYS:
        line = f"{k:22}{ours[k]:>14,}"
        if theirs:
            ratio = ours[k] / theirs[k] if theirs[k] else float("nan")
            line += f"{theirs[k]:>14,}{ratio:>16.3f}"
        print(line)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="step trace JSONL (driver.py --dump-trace format)")
    src.add_argument("--scenario", choices=list(SCENARIOS), help="driver.py's built-in scenario")
    ap.add_argument("--num-blocks", type=int, help="KV pool size in blocks, the null block included")
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-steps", type=int, default=200000)
    ap.add_argument("--vllm-python", help="python of a venv with vllm installed: also run vLLM's scheduler")
    ap.add_argument("--driver", default=str(DEFAULT_DRIVER), help="path to vllm_core/driver.py")
    ap.add_argument("--dump-trace", help="write the trace used here as JSONL")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args(argv)
    scenario = SCENARIOS.get(args.scenario, {})
    args.num_blocks = args.num_blocks or scenario.get("num_blocks", 20000)
    args.max_num_seqs = args.max_num_seqs or scenario.get("max_num_seqs", 256)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trace:
        trace_path, trace = args.trace, load_trace(args.trace)
    else:
        sc = SCENARIOS[args.scenario]
        trace = synthetic_trace(sc["n"], out_min=sc["out_min"], out_max=sc["out_max"], **SYNTH_DEFAULTS)
        trace_path = args.dump_trace or os.path.join(tempfile.mkdtemp(prefix="kvparity_"), "trace.jsonl")
        with open(trace_path, "w") as f:
            for item in trace:
                f.write(json.dumps(item) + "\n")
    ours = run_kvengine(trace, args)
    theirs = run_vllm(trace_path, args) if args.vllm_python else None
    label = args.scenario or args.trace
    print(f"# {label}: {len(trace)} requests, {args.num_blocks} blocks of {args.block_size}, "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}")
    print_table(ours, theirs)
    if args.json:
        print(json.dumps({"kvengine": ours, "vllm": theirs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
