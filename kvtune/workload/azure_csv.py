"""Azure LLM inference traces (2023, 2024): `TIMESTAMP,ContextTokens,GeneratedTokens`.

TIMESTAMP is wall-clock time like `2023-11-16 18:17:03.9799600` (7 fractional
digits; the 2024 release adds a UTC offset). It is parsed into exact integer
nanoseconds, and a request's arrival is its offset from the earliest row, which
is the first row of a sorted trace.
"""
from __future__ import annotations

import csv
import datetime as dt
import re

from . import fields
from .context import ReadContext, finish
from .errors import RecordError
from .model import TraceRequest, Workload

HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
EXPECTED_TIME = "a time like 2023-11-16 18:17:03.9799600"

_TIME = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?\s*(Z|[+-]\d{2}:?\d{2})?")


def read_azure_csv(text: str, ctx: ReadContext, hash_block_size: int) -> Workload:
    rows = csv.reader(text.split("\n"))
    columns = _columns(next(rows, []), ctx)
    timed = []
    for row in rows:
        if not any(cell.strip() for cell in row):
            continue
        parsed = ctx.parse(rows.line_num, parse_row, row, columns)
        if parsed is not None:
            timed.append(parsed)
    start = min((ns for ns, _, _ in timed), default=0)
    requests = [TraceRequest((ns - start) / 1e9, inp, out) for ns, inp, out in timed]
    return finish(requests, ctx, hash_block_size)


def parse_row(row: list[str], columns: list[int]) -> tuple[int, int, int]:
    if len(row) < len(HEADER):
        raise RecordError(None, f"{len(HEADER)} columns ({','.join(HEADER)})", raw=f"{len(row)}")
    stamp, context, generated = (row[i] for i in columns)
    arrival = wall_clock_ns(stamp)
    input_length = fields.token_count(fields.cell(context), "ContextTokens")
    output_length = fields.token_count(fields.cell(generated), "GeneratedTokens")
    fields.request_size(input_length, output_length, "GeneratedTokens")
    return arrival, input_length, output_length


def wall_clock_ns(stamp: str) -> int:
    """Nanoseconds since the epoch, exactly (floats would lose the 100 ns digits)."""
    match = _TIME.fullmatch(stamp.strip())
    if match is None:
        raise RecordError("TIMESTAMP", EXPECTED_TIME, stamp)
    day, hours, minutes, seconds, fraction, zone = match.groups()
    try:
        days = dt.date.fromisoformat(day).toordinal()
    except ValueError:
        raise RecordError("TIMESTAMP", EXPECTED_TIME, stamp) from None
    total_s = days * 86400 + int(hours) * 3600 + int(minutes) * 60 + int(seconds) - _zone_s(zone)
    return total_s * 10**9 + int((fraction or "").ljust(9, "0"))


def _zone_s(zone: str | None) -> int:
    if zone is None or zone == "Z":
        return 0
    digits = zone[1:].replace(":", "")
    offset = int(digits[:2]) * 3600 + int(digits[2:]) * 60
    return offset if zone[0] == "+" else -offset


def _columns(header: list[str], ctx: ReadContext) -> list[int]:
    names = [name.strip() for name in header]
    missing = [name for name in HEADER if name not in names]
    if missing:
        raise ctx.error(1, f"expected the Azure header {','.join(HEADER)}, got {','.join(names) or 'nothing'}")
    return [names.index(name) for name in HEADER]
