#!/usr/bin/env python3
"""Paged KV blocks vs a contiguous worst-case reservation, side by side.

Same model, device and memory budget, same requests (the lengths of the Azure
2023 conversation trace, all arriving at once so memory is what binds), replayed
in virtual time through the engine twice: once with the paged block manager,
once with the contiguous allocator (each request reserves max_model_len tokens
up front). Reports peak concurrent running requests, KV utilisation (tokens
actually stored / tokens held, averaged over time) and output throughput.

    python benchmarks/paged_vs_contiguous.py [--requests 2000] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.engine.llm_engine import LLMEngine
from kvengine.core.request import SamplingParams
from kvtune.workload import head, read_workload, workload_prompt_token_ids

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"


def build_requests(trace: str, n: int, max_model_len: int):
    """(arrival, id, prompt, params) at t=0; requests that cannot fit are left out."""
    workload = head(read_workload(trace), n)
    prompts = workload_prompt_token_ids(workload)
    arrivals, skipped = [], 0
    for i, (req, prompt) in enumerate(zip(workload.requests, prompts)):
        if req.input_length + req.output_length > max_model_len:
            skipped += 1
            continue
        sp = SamplingParams(max_tokens=req.output_length, ignore_eos=True)
        arrivals.append((0.0, f"r{i}", list(prompt), sp))
    return arrivals, skipped


def measure(allocator: str, arrivals, args) -> dict:
    engine = LLMEngine(
        EngineConfig(kv_allocator=allocator, max_model_len=args.max_model_len,
                     max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization),
        model_preset(args.preset), device_preset(args.device))
    t0 = time.perf_counter()
    engine.replay(arrivals)
    wall = time.perf_counter() - t0
    steps = engine.steps
    block_tokens = engine.kv.num_usable_blocks * engine.config.block_size
    stored = sum(c * d for c, d in zip(steps.context_tokens, steps.duration))
    held = sum(u * block_tokens * d for u, d in zip(steps.kv_usage, steps.duration))
    output_tokens = sum(r.num_output_tokens for r in engine.finished)
    return {"peak_running": max(steps.num_running),
            "kv_utilization": round(stored / held, 4),
            "throughput_tok_s": round(output_tokens / engine.clock.now, 1),
            "num_gpu_blocks": engine.memory.num_gpu_blocks,
            "makespan_s": round(engine.clock.now, 2), "steps": len(steps),
            "wall_s": round(wall, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace whose lengths to use (default: Azure conv)")
    ap.add_argument("--requests", type=int, default=2000, help="first N requests of the trace")
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--device", default="a100-80gb")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=1024,
                    help="high, so that KV memory, not this cap, limits concurrency")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args(argv)
    if not Path(args.trace).exists():
        print(f"error: --trace {args.trace}: no such file", file=sys.stderr)
        return 2
    arrivals, skipped = build_requests(args.trace, args.requests, args.max_model_len)
    paged = measure("paged", arrivals, args)
    contiguous = measure("contiguous", arrivals, args)
    ratio = {k: round(paged[k] / contiguous[k], 2) for k in ("peak_running", "throughput_tok_s")}
    print(f"# {args.preset} on {args.device}, util {args.gpu_memory_utilization}, max_model_len "
          f"{args.max_model_len}: {len(arrivals)} requests from {Path(args.trace).name} "
          f"({skipped} longer than max_model_len left out), all arriving at t=0")
    print(f"{'':20}{'paged':>12}{'contiguous':>12}{'ratio':>8}")
    for key in ("peak_running", "kv_utilization", "throughput_tok_s", "makespan_s", "steps"):
        r = paged[key] / contiguous[key] if contiguous[key] else float("nan")
        print(f"{key:20}{paged[key]:>12,}{contiguous[key]:>12,}{r:>8.2f}")
    if args.json:
        print(json.dumps({"paged": {k: paged[k] for k in ("peak_running", "kv_utilization", "throughput_tok_s")},
                          "contiguous": {k: contiguous[k] for k in ("peak_running", "kv_utilization", "throughput_tok_s")},
                          "ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
