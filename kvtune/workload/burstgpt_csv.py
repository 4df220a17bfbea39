"""BurstGPT: `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`.

Newer releases add `Session ID,Elapsed time`. `Timestamp` is in seconds from
the start of the trace. A row with 0 response tokens is a failed request: it
is left out and counted (`Workload.failed`), with a warning.
"""
from __future__ import annotations

import csv

from . import fields
from .context import ReadContext, Unanswered, finish
from .errors import RecordError
from .model import TraceRequest, Workload

REQUIRED = ("Timestamp", "Request tokens", "Response tokens")
SESSION = "Session ID"
FAILED_REASON = "failed requests (rows with 0 response tokens)"


def read_burstgpt_csv(text: str, ctx: ReadContext, hash_block_size: int) -> Workload:
    ctx.failed_reason = FAILED_REASON
    rows = csv.reader(text.split("\n"))
    columns = _columns(next(rows, []), ctx)
    requests = []
    for row in rows:
        if not any(cell.strip() for cell in row):
            continue
        request = ctx.parse(rows.line_num, parse_row, row, columns)
        if request is not None:
            requests.append(request)
    return finish(requests, ctx, hash_block_size)


def parse_row(row: list[str], columns: dict[str, int]) -> TraceRequest:
    width = max(columns.values()) + 1
    if len(row) < width:
        raise RecordError(None, f"at least {width} columns", raw=f"{len(row)}")
    value = {name: fields.cell(row[columns[name]]) for name in REQUIRED}
    arrival = fields.timestamp(value["Timestamp"], "Timestamp", "seconds")
    input_length = fields.token_count(value["Request tokens"], "Request tokens")
    if value["Response tokens"] == 0:
        raise Unanswered()
    output_length = fields.token_count(value["Response tokens"], "Response tokens")
    fields.request_size(input_length, output_length, "Response tokens")
    session = row[columns[SESSION]].strip() if SESSION in columns else ""
    return TraceRequest(arrival, input_length, output_length, session_id=session or None)


def _columns(header: list[str], ctx: ReadContext) -> dict[str, int]:
    names = [name.strip() for name in header]
    if any(name not in names for name in REQUIRED):
        raise ctx.error(1, "expected the BurstGPT header "
                           "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type, "
                           f"got {','.join(names) or 'nothing'}")
    wanted = REQUIRED + ((SESSION,) if SESSION in names else ())
    return {name: names.index(name) for name in wanted}
