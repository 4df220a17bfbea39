"""`kvtune trace stats | convert | synth`: the workload commands.

`add_trace_commands(subparsers)` adds them to the kvtune parser; each handler
is `func(args) -> int`. A failure prints `error: <message>` to stderr, writes
nothing and returns 2; reader warnings (skipped records, reordering) are
printed to stderr as `warning: ...`.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from collections.abc import Callable

from .commands import COMMANDS
from .args import checked, non_negative_float, non_negative_int, positive_float, positive_int
from ..workload.detect import FORMATS
from ..workload.dist import parse_dist
from ..workload.errors import TraceError
from ..workload.model import Workload
from ..workload.readers import read_workload
from ..workload.stats import workload_stats
from ..workload.synth import ARRIVALS, SynthSpec, synthesize
from ..workload.transforms import head, length_scale, rate_scale, retime, sample, time_scale
from ..workload.writers import write_workload

FORMAT_HELP = ("trace format; default: told from the content. kvtune and mooncake: JSONL with "
               "timestamp (ms), input_length, output_length[, hash_ids]; azure: CSV "
               "TIMESTAMP,ContextTokens,GeneratedTokens; burstgpt: CSV; sharegpt: JSON conversations; "
               "vllm-custom: JSONL with prompt, output_tokens")

CONVERT_EPILOG = """\
transforms run in this order: --head, --sample, --length-scale/--max-input/
--max-output, --retime-rate, --time-scale, --rate-scale.

examples:
  kvtune trace convert AzureLLMInferenceTrace_conv.csv conv.jsonl --rate-scale 2
  kvtune trace convert sharegpt.json chat.jsonl --sample 1000 --retime-rate 5
  kvtune trace convert mooncake.jsonl small.jsonl --length-scale 0.25 --max-input 4096
"""

SYNTH_EPILOG = """\
length distributions (--input-len, --output-len, --turns):
  512                 fixed
  100-2000            uniform over [100, 2000]
  lognormal:1000,0.8  lognormal, mean 1000 tokens, sigma 0.8 (of the log)
  empirical:FILE      resampled from a trace file's lengths

sessions start at --rate per second; turn k+1 of a session resends turn k's
prompt and answer plus a new --input-len message, --think-time seconds (mean,
exponential) after turn k. Shared system prompts and earlier turns are written
as shared hash_ids, in blocks of --hash-block-size tokens.

examples:
  kvtune trace synth -o chat.jsonl --num-requests 2000 --rate 8 \\
      --input-len lognormal:800,0.9 --output-len 50-400 --turns 1-6 --think-time 20
  kvtune trace synth -o rag.jsonl --duration 600 --rate 4 --system-prompts 3 \\
      --system-prompt-len 2000 --system-prompt-shares 0.5,0.3,0.2
"""


def add_trace_commands(subparsers) -> argparse.ArgumentParser:
    """Add `trace` (with stats, convert, synth) to an argparse subparsers object."""
    trace = subparsers.add_parser(
        "trace", help=COMMANDS["trace"].help,
        description="Inspect, convert and synthesize workload traces.")
    trace.set_defaults(func=lambda args: _usage(trace))
    commands = trace.add_subparsers(dest="trace_command", metavar="{stats,convert,synth}")
    _add_stats(commands)
    _add_convert(commands)
    _add_synth(commands)
    return trace


def _add_stats(commands) -> None:
    parser = commands.add_parser(
        "stats", help="summarise a trace: rate, lengths, ideal prefix-cache hit rate",
        description="Summarise a trace: request count, duration, rate, input/output length "
                    "percentiles, and the share of prompt tokens an unbounded prefix cache with "
                    "--block-size blocks would serve (the ideal prefix hit rate).")
    parser.add_argument("file", help="trace file")
    _add_read_options(parser)
    parser.add_argument("--block-size", type=positive_int, default=16,
                        help="KV cache block size in tokens for the ideal hit rate (default: 16)")
    parser.add_argument("--json", action="store_true",
                        help="also print the statistics as one JSON object, on the last line")
    parser.set_defaults(func=stats_command)


def _add_convert(commands) -> None:
    parser = commands.add_parser(
        "convert", help="read any trace, transform it, write kvtune JSONL",
        description="Read a trace in any supported format, optionally transform it, and write it "
                    "as kvtune JSONL (atomically: OUT appears complete or not at all).",
        epilog=CONVERT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="trace file to read")
    parser.add_argument("output", help="kvtune JSONL file to write")
    _add_read_options(parser)
    parser.add_argument("--head", type=non_negative_int, metavar="N", help="keep the first N requests")
    parser.add_argument("--sample", type=_count_or_fraction, metavar="N|F",
                        help="keep a random N requests, or a fraction F in (0, 1] (e.g. 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed for --sample and --retime-rate (default: 0)")
    parser.add_argument("--length-scale", type=positive_float, metavar="X",
                        help="multiply input and output lengths by X, and the trace's hash block size "
                             "with them (a 512-token block at 0.25 is a 128-token one), so prompts share "
                             "what they shared")
    parser.add_argument("--max-input", type=positive_int, metavar="N", help="cap input lengths at N tokens")
    parser.add_argument("--max-output", type=positive_int, metavar="N", help="cap output lengths at N tokens")
    parser.add_argument("--retime-rate", type=positive_float, metavar="R",
                        help="replace arrivals with a gamma process at R requests/s")
    parser.add_argument("--burstiness", type=positive_float, metavar="B",
                        help="gamma shape for --retime-rate: 1 Poisson (default), <1 burstier, "
                             "inf constant gaps (as vllm bench serve --burstiness)")
    parser.add_argument("--time-scale", type=positive_float, metavar="X",
                        help="multiply arrival times by X (2 = half speed)")
    parser.add_argument("--rate-scale", type=positive_float, metavar="X",
                        help="divide arrival times by X (2 = twice the request rate)")
    parser.set_defaults(func=convert_command)


def _add_synth(commands) -> None:
    parser = commands.add_parser(
        "synth", help="generate a synthetic trace (arrivals, lengths, shared prefixes, sessions)",
        description="Generate a synthetic workload and write it as kvtune JSONL.",
        epilog=SYNTH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", required=True, help="kvtune JSONL file to write")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=positive_int, metavar="N",
                      help="number of requests (default: 100)")
    size.add_argument("--duration", type=positive_float, metavar="S",
                      help="generate sessions for S seconds instead of a fixed count")
    parser.add_argument("--rate", type=positive_float, default=1.0,
                        help="new sessions per second (= requests/s for single-turn; inf: all at t=0, as "
                             "vllm bench serve --request-rate inf; default: 1)")
    parser.add_argument("--arrival", choices=sorted(ARRIVALS), default="poisson",
                        help="arrival process (default: poisson)")
    parser.add_argument("--burstiness", type=positive_float, default=1.0,
                        help="gamma shape for --arrival gamma (default: 1)")
    parser.add_argument("--input-len", default="512", metavar="DIST",
                        help="user message length per turn (default: 512)")
    parser.add_argument("--output-len", default="128", metavar="DIST", help="answer length (default: 128)")
    parser.add_argument("--system-prompts", type=non_negative_int, default=0, metavar="N",
                        help="number of shared system prompts (default: 0)")
    parser.add_argument("--system-prompt-len", type=non_negative_int, default=0, metavar="L",
                        help="tokens per system prompt")
    parser.add_argument("--system-prompt-shares", type=_shares, metavar="S1,S2,...",
                        help="share of sessions using each system prompt (default: all, split evenly)")
    parser.add_argument("--turns", default="1", metavar="DIST", help="turns per session (default: 1)")
    parser.add_argument("--think-time", type=non_negative_float, default=0.0, metavar="S",
                        help="mean seconds between a session's turns (exponential; default: 0)")
    parser.add_argument("--max-input", type=positive_int, metavar="N",
                        help="cap prompts at N tokens; a session ends when its next turn would not fit")
    parser.add_argument("--hash-block-size", type=positive_int, default=16,
                        help="tokens per hash id (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.set_defaults(func=synth_command)


def _add_read_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS, help=FORMAT_HELP)
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip bad records (and say how many) instead of stopping at the first")
    parser.add_argument("--hash-block-size", type=positive_int,
                        help="tokens per hash id (default: as the file states, else 512)")


def _guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Print warnings and turn expected failures into `error: ...` and exit code 2."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                code = handler(args)
            except (TraceError, ValueError, OSError) as err:
                _print_warnings(caught)
                print(f"error: {err}", file=sys.stderr)
                return 2
        _print_warnings(caught)
        return code

    return run


@_guarded
def stats_command(args: argparse.Namespace) -> int:
    workload = _read(args)
    stats = workload_stats(workload, args.block_size)
    print(format_stats(stats))
    if args.json:
        print(json.dumps(stats))
    return 0


@_guarded
def convert_command(args: argparse.Namespace) -> int:
    if args.burstiness is not None and args.retime_rate is None:
        raise ValueError("--burstiness needs --retime-rate")
    workload = _read(args)
    if args.head is not None:
        workload = head(workload, args.head)
    if args.sample is not None:
        workload = sample(workload, args.sample, args.seed)
    if args.length_scale is not None or args.max_input is not None or args.max_output is not None:
        workload = length_scale(workload, args.length_scale or 1.0, args.max_input, args.max_output)
    if args.retime_rate is not None:
        burstiness = 1.0 if args.burstiness is None else args.burstiness
        workload = retime(workload, args.retime_rate, burstiness, args.seed)
    if args.time_scale is not None:
        workload = time_scale(workload, args.time_scale)
    if args.rate_scale is not None:
        workload = rate_scale(workload, args.rate_scale)
    if not workload.requests:
        raise ValueError("no requests left to write after the transforms")
    write_workload(workload, args.output)
    print(f"wrote {len(workload)} requests ({workload.duration_s:.1f} s, "
          f"{workload.rate_rps:.2f} req/s) to {args.output}")
    return 0


@_guarded
def synth_command(args: argparse.Namespace) -> int:
    default_count = 100 if args.duration is None else None
    spec = SynthSpec(
        num_requests=default_count if args.num_requests is None else args.num_requests,
        duration_s=args.duration,
        rate=args.rate,
        arrival=args.arrival,
        burstiness=args.burstiness,
        input_len=parse_dist(args.input_len, "input"),
        output_len=parse_dist(args.output_len, "output"),
        system_prompts=args.system_prompts,
        system_prompt_len=args.system_prompt_len,
        system_prompt_shares=args.system_prompt_shares,
        turns=parse_dist(args.turns, "input"),
        think_time_s=args.think_time,
        max_input=args.max_input,
        hash_block_size=args.hash_block_size,
        seed=args.seed,
    )
    workload = synthesize(spec)
    write_workload(workload, args.output)
    print(f"wrote {len(workload)} requests ({workload.duration_s:.1f} s, "
          f"{workload.rate_rps:.2f} req/s) to {args.output}")
    return 0


def format_stats(stats: dict) -> str:
    """The human-readable table `kvtune trace stats` prints."""
    left_out = f"  ({stats['skipped']} bad records skipped)" if stats["skipped"] else ""
    if stats["failed"]:
        left_out += f"  ({stats['failed']} failed requests left out)"
    rows = [
        f"trace                  {stats['source']}",
        f"requests               {stats['requests']}{left_out}",
        f"duration               {stats['duration_s']:.1f} s",
        f"rate                   {stats['rate_rps']:.3f} req/s",
        f"{'':22} {'p50':>9} {'p95':>9} {'p99':>9} {'max':>9} {'mean':>9}",
        _length_row("input tokens", stats["input_len"]),
        _length_row("output tokens", stats["output_len"]),
    ]
    if stats["sessions"]:
        rows.append(f"sessions               {stats['sessions']}")
    if stats["hash_block_size"] is not None:
        rows.append(f"hash block size        {stats['hash_block_size']} tokens per hash id")
    rows += [
        f"distinct prefix blocks {stats['distinct_prefix_blocks']} (block size {stats['block_size']})",
        f"ideal prefix hit rate  {100 * stats['ideal_prefix_hit_rate']:.1f} % of "
        f"{stats['prompt_tokens']} prompt tokens",
    ]
    return "\n".join(rows)


def _length_row(name: str, lengths: dict) -> str:
    values = " ".join(f"{lengths[key]:>9.0f}" for key in ("p50", "p95", "p99", "max", "mean"))
    return f"{name:<22} {values}"


def _read(args: argparse.Namespace) -> Workload:
    """The trace named on the command line; how many records were skipped is
    reported by the reader's warning."""
    return read_workload(getattr(args, "file", None) or args.input, args.format,
                         skip_bad=args.skip_bad, hash_block_size=args.hash_block_size)


def _print_warnings(caught: list[warnings.WarningMessage]) -> None:
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _count_or_fraction(text: str) -> int | float:
    if any(c in text for c in ".eE"):
        return checked(float, text, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
    return non_negative_int(text)


def _shares(text: str) -> tuple[float, ...]:
    return tuple(checked(float, part, lambda v: v >= 0, "shares >= 0") for part in text.split(","))


