"""`kvtune`: measure, explain and tune the KV cache of vLLM-style servers."""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before anything imports torch

from kvengine.config import ConfigError
from kvengine.flags import add_engine_flags, add_model_flags, config_from_args, specs_from_args

from .results import RunResult
from .targets import SimTarget, TargetStartError
from .workload import FORMATS, TraceError, add_trace_commands, head, rate_scale, read_workload
from .workload.cli import positive_float, positive_int

TARGETS = ("sim",)


def cmd_run(args) -> int:
    """Replay a workload on a target with one engine config and summarise the run."""
    model, device = specs_from_args(args)
    config = config_from_args(args)
    config.resolve(model, device)  # bad flags fail here, before any work
    workload = read_workload(args.workload, format=args.format, skip_bad=args.skip_bad)
    if args.skip_bad and workload.skipped:
        print(f"warning: {args.workload}: skipped {workload.skipped} bad records", file=sys.stderr)
    if args.rate_scale != 1.0:
        workload = rate_scale(workload, args.rate_scale)
    if args.head:
        workload = head(workload, args.head)
    if not workload.requests:
        print(f"error: {args.workload}: no requests to replay", file=sys.stderr)
        return 2
    target = SimTarget(model, device)
    try:
        result = target.run(config, workload)
    except TargetStartError as err:
        print(f"error: the engine cannot start with this config: {err}", file=sys.stderr)
        return 1
    if args.out:
        result.write_json(args.out)
    print(format_summary(result))
    if args.out:
        print(f"run written to {args.out}")
    if args.json:
        print(json.dumps(result.summary))
    return 0


def format_summary(result: RunResult) -> str:
    s = result.summary

    def ms(key):
        value = s.get(key)
        return "-" if value is None else f"{value * 1000:9.1f}"

    def pct(value):
        return "-" if value is None else f"{value:.1%}"

    cfg = result.config
    lines = [
        f"{result.target}: {result.model} on {result.device}, block_size {cfg['block_size']}, "
        f"gpu_memory_utilization {cfg['gpu_memory_utilization']}, max_num_seqs {cfg['max_num_seqs']}, "
        f"max_num_batched_tokens {cfg['max_num_batched_tokens']}, kv_cache_dtype {cfg['kv_cache_dtype']}",
        f"requests        {s['requests']:,} ({s['completed']:,} completed, {s['rejected']:,} rejected) "
        f"over {s['duration_s']:.1f} s",
        f"throughput      {s['throughput_rps']:.2f} req/s, {s['output_tok_s']:,.0f} output tok/s, "
        f"{s['input_tok_s']:,.0f} input tok/s",
        "latency (ms)         p50       p95       p99",
    ]
    for name in ("ttft", "tpot", "itl", "e2e", "queue"):
        lines.append(f"  {name:<10}{ms(name + '_p50')} {ms(name + '_p95')} {ms(name + '_p99')}")
    lines += [
        f"prefix hits     {pct(s['prefix_hit_rate'])} observed, {pct(s['ideal_prefix_hit_rate'])} ideal "
        "(unbounded cache)",
        f"preemptions     {s['preemptions']:,}",
        f"KV usage        peak {pct(s['kv_usage_peak'])}, mean {pct(s['kv_usage_mean'])}; "
        f"peak running {s['running_peak']}",
    ]
    if result.wall_s:
        lines.append(f"replayed in     {result.wall_s:.1f} s wall")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtune", description="Measure, explain and tune the KV cache of vLLM-style servers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_trace_commands(sub)
    p = sub.add_parser("run", help="replay a workload on a target and summarise it",
                       description=cmd_run.__doc__)
    p.add_argument("--target", choices=TARGETS, default="sim",
                   help="sim: the engine core in virtual time (default: %(default)s)")
    p.add_argument("--workload", required=True, metavar="FILE", help="the trace to replay")
    p.add_argument("--format", choices=FORMATS, help="trace format (default: detected from the content)")
    p.add_argument("--skip-bad", action="store_true", help="skip bad trace records, and say how many")
    p.add_argument("--rate-scale", type=positive_float, default=1.0, metavar="X",
                   help="replay at X times the trace's request rate (default: 1)")
    p.add_argument("--head", type=positive_int, metavar="N", help="only the first N requests")
    add_model_flags(p)
    add_engine_flags(p)
    p.add_argument("--out", metavar="FILE", help="write the whole run (requests, series, summary) as JSON")
    p.add_argument("--json", action="store_true", help="end with the summary as one JSON object")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, TraceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
