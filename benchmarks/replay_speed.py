#!/usr/bin/env python3
"""How fast the sim target replays a real trace: simulated requests per wall second.

Replays the whole Azure 2023 conversation trace (19,366 requests) through the
engine core in virtual time on llama-3-8b / h100-80gb and prints requests and
engine steps per wall-clock second. Goal: >= 1,000 requests/s on one core. It also
times turning the trace's prompts into token ids (kvtune.workload.tokens, what every
live replay sends). Goal: >= 10 M tokens/s.

    python benchmarks/replay_speed.py [--trace FILE] [--preset M] [--device D] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvengine.config import EngineConfig, device_preset, model_preset
from kvtune.targets import SimTarget
from kvtune.workload import read_workload, workload_token_arrays

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--device", default="h100-80gb")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args(argv)
    if not Path(args.trace).exists():
        print(f"error: --trace {args.trace}: no such file", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    workload = read_workload(args.trace)
    read_s = time.perf_counter() - t0
    target = SimTarget(model_preset(args.preset), device_preset(args.device))
    t0 = time.perf_counter()
    tokens = sum(len(t) for t in workload_token_arrays(workload))
    tokenise_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = target.run(EngineConfig(), workload)
    wall = time.perf_counter() - t0
    steps = len(result.series["time"])
    out = {"requests": len(workload), "wall_s": round(wall, 2),
           "requests_per_s": round(len(workload) / wall, 1), "steps_per_s": round(steps / wall, 1),
           "tokenise_tokens_per_s": round(tokens / tokenise_s)}
    print(f"# {Path(args.trace).name} on {args.preset} / {args.device} (read in {read_s:.2f} s)")
    print(f"replayed {len(workload):,} requests, {steps:,} engine steps, "
          f"{result.duration_s:,.0f} s simulated, in {wall:.2f} s wall")
    print(f"{out['requests_per_s']:,.0f} simulated requests/s, {out['steps_per_s']:,.0f} steps/s "
          f"({out['requests_per_s'] / 1000:.2f}x the 1,000 req/s goal)")
    print(f"tokenised its {tokens:,} prompt tokens in {tokenise_s:.2f} s: {tokens / tokenise_s / 1e6:,.1f} M tokens/s "
          f"({tokens / tokenise_s / 1e7:.2f}x the 10 M tokens/s goal)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
