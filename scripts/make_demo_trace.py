"""Write kvtune/data/demo_pressure.jsonl, the trace `make demo` tunes the real engine on.

A burst of chat traffic for the bundled engine's tiny Llama on a 2-core CPU: two
shared system prompts, a few hundred tokens of user message each, short answers,
arriving faster than the server drains them, so many requests are in flight at
once. With a small fixed KV pool (`make demo` gives the server one), the default
config cannot hold them all: the KV cache decides the outcome. Deterministic:
the same seed writes the same file.

    .venv/bin/python scripts/make_demo_trace.py [--out FILE] [--seed N] ...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtune.workload import IntDist, SynthSpec, synthesize, workload_stats, write_workload  # noqa: E402

DEFAULT_OUT = ROOT / "kvtune" / "data" / "demo_pressure.jsonl"


def spec(args) -> SynthSpec:
    return SynthSpec(
        num_requests=args.requests,
        rate=args.rate,
        arrival="poisson",
        input_len=IntDist.uniform(args.input_min, args.input_max),
        output_len=IntDist.uniform(args.output_min, args.output_max),
        system_prompts=2,
        system_prompt_len=args.system_len,
        system_prompt_shares=(0.5, 0.5),
        hash_block_size=16,
        seed=args.seed,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=12.0, help="requests per second (Poisson)")
    p.add_argument("--input-min", type=int, default=48)
    p.add_argument("--input-max", type=int, default=128)
    p.add_argument("--output-min", type=int, default=32)
    p.add_argument("--output-max", type=int, default=64)
    p.add_argument("--system-len", type=int, default=200)
    p.add_argument("--seed", type=int, default=22)
    args = p.parse_args(argv)
    workload = synthesize(spec(args))
    write_workload(workload, args.out)
    stats = workload_stats(workload)
    print(f"wrote {args.out}: {len(workload)} requests over {workload.duration_s:.1f} s")
    print({k: stats[k] for k in list(stats)[:8]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
