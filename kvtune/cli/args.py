"""What every command's flags share: argparse types, `--db`, and nothing heavy.

The CLI modules import this at parser-build time, so it imports only the standard
library: `kvtune --help` must not load what the commands run on.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from ..dburl import DB_ENV, DEFAULT_DB_URL


def add_db_argument(parser) -> None:
    """`--db URL` on an argparse parser; pass its value to `store.resolve_db_url`."""
    parser.add_argument("--db", metavar="URL", default=None,
                        help=f"database URL (default: ${DB_ENV}, else {DEFAULT_DB_URL} in the working "
                             "directory); e.g. sqlite:///runs.db, postgresql://user:pass@host:5432/kvtune")


def add_max_concurrency(parser) -> None:
    """`--max-concurrency N`, vLLM's name for a closed loop; read it with Workload.closed_loop."""
    parser.add_argument("--max-concurrency", type=positive_int, metavar="N",
                        help="a closed loop: at most N requests in flight, the next in trace order sent when "
                             "one finishes (vllm bench serve --max-concurrency); default: open loop, each "
                             "request at its arrival time")


def name_or_url(names: tuple[str, ...]):
    """An argparse type: one of `names`, or a server URL (http://host:port)."""
    def parse(text: str) -> str:
        if text in names or text.startswith(("http://", "https://")):
            return text
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)} or a server URL "
                                         f"(http://host:port), got {text!r}")
    return parse


def positive_int(text: str) -> int:
    return checked(int, text, lambda v: v >= 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    return checked(int, text, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return checked(float, text, lambda v: v > 0, "a number > 0")


def non_negative_float(text: str) -> float:
    return checked(float, text, lambda v: v >= 0, "a number >= 0")


def checked(kind: type, text: str, ok: Callable, expected: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value
