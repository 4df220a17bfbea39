"""The state one read of one trace file shares across its records.

Readers hand each record to `ReadContext.parse`, which turns a `RecordError`
into a `TraceError` at that line, or skips and counts it when the caller asked
to skip bad records. `finish` sorts the requests, reports what was left out
and builds the `Workload`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import RecordError, TraceError, TraceWarning
from .model import TraceRequest, Workload

T = TypeVar("T")


class Unanswered(Exception):
    """The trace records this request without an answer; it cannot be replayed."""


@dataclass
class ReadContext:
    path: str
    skip_bad: bool = False
    skipped: int = 0
    failed: int = 0
    first_skipped: str | None = None
    failed_reason: str = "requests without an answer"

    def parse(self, line: int, parse: Callable[..., T], *args) -> T | None:
        """`parse(*args)`, or None when the record was skipped or had no answer."""
        try:
            return parse(*args)
        except Unanswered:
            self.failed += 1
        except RecordError as err:
            error = TraceError.at(self.path, line, err)
            if not self.skip_bad:
                raise error from None
            self.skipped += 1
            self.first_skipped = self.first_skipped or str(error)
        return None

    def error(self, line: int | None, problem: str) -> TraceError:
        """A file-level problem (bad header, not a trace): never skippable."""
        return TraceError(self.path, line, problem)


def finish(requests: list[TraceRequest], ctx: ReadContext, hash_block_size: int) -> Workload:
    """Sort by arrival (warning how many were out of order) and report the left-outs."""
    out_of_order = sum(1 for a, b in zip(requests, requests[1:]) if b.arrival_s < a.arrival_s)
    if out_of_order:
        requests = sorted(requests, key=lambda r: r.arrival_s)
        _warn(f"{ctx.path}: {out_of_order} requests arrived earlier than the record before them; "
              "sorted the trace by arrival time")
    if ctx.skipped:
        _warn(f"{ctx.path}: skipped {ctx.skipped} bad records (first: {ctx.first_skipped})")
    if ctx.failed:
        _warn(f"{ctx.path}: left out {ctx.failed} {ctx.failed_reason}")
    if not requests:
        raise ctx.error(None, "no requests to replay" + _left_out(ctx))
    return Workload(requests, hash_block_size, ctx.path, ctx.skipped, ctx.failed)


def _left_out(ctx: ReadContext) -> str:
    parts = [f"{ctx.skipped} bad records skipped"] if ctx.skipped else []
    parts += [f"{ctx.failed} {ctx.failed_reason} left out"] if ctx.failed else []
    return f" ({', '.join(parts)})" if parts else ""


def _warn(message: str) -> None:
    warnings.warn(message, TraceWarning, stacklevel=5)
