"""kvtune JSONL, a superset of Mooncake's: one request object per line.

Fields: `timestamp` (ms from the start), `input_length`, `output_length`, and
optionally `hash_ids`, `prompt`, `session_id`, `prompt_token_ids` (the exact
tokens, input_length of them: a workload built with them replays live with the
very tokens the sim was given). kvtune also writes `hash_block_size` on every
record with hash ids when it is not Mooncake's 512, so a trace with finer (or
length-scaled) blocks reads back without being told its block size.
"""
from __future__ import annotations

from . import fields
from .context import ReadContext, finish
from .errors import RecordError
from .jsonl import json_object, numbered_lines
from .model import DEFAULT_HASH_BLOCK_SIZE, TraceRequest, Workload


def read_kvtune_jsonl(text: str, ctx: ReadContext, hash_block_size: int | None) -> Workload:
    size = hash_block_size  # None until a record with hash ids settles it
    requests = []
    for line, raw in numbered_lines(text):
        record = ctx.parse(line, json_object, raw)
        if record is None:
            continue
        if size is None and ("hash_ids" in record or "hash_block_size" in record):
            size = _stated_block_size(record)
        request = ctx.parse(line, parse_record, record, size or DEFAULT_HASH_BLOCK_SIZE)
        if request is not None:
            requests.append(request)
    return finish(requests, ctx, size or DEFAULT_HASH_BLOCK_SIZE)


def parse_record(record: dict, hash_block_size: int) -> TraceRequest:
    _check_block_size(record, hash_block_size)
    timestamp_ms = fields.timestamp(
        fields.require(record, "timestamp", "a number of milliseconds >= 0"), "timestamp", "milliseconds")
    input_length = fields.token_count(
        fields.require(record, "input_length", "an integer >= 1"), "input_length")
    output_length = fields.token_count(
        fields.require(record, "output_length", "an integer >= 1"), "output_length")
    fields.request_size(input_length, output_length, "output_length")
    raw_ids = record.get("hash_ids")
    hash_ids = None if raw_ids is None else fields.hash_ids(raw_ids, input_length, hash_block_size)
    prompt = fields.optional_text(record, "prompt")
    raw_tokens = record.get("prompt_token_ids")
    tokens = None if raw_tokens is None else fields.token_ids(raw_tokens, input_length)
    return TraceRequest(timestamp_ms / 1000.0, input_length, output_length, hash_ids, prompt,
                        fields.optional_text(record, "session_id", numbers_ok=True), tokens)


def record_of(request: TraceRequest, hash_block_size: int) -> dict:
    """The JSONL object for one request (the writer's half of the format)."""
    record: dict = {
        "timestamp": request.arrival_s * 1000.0,
        "input_length": request.input_length,
        "output_length": request.output_length,
    }
    if request.hash_ids is not None:
        record["hash_ids"] = list(request.hash_ids)
        if hash_block_size != DEFAULT_HASH_BLOCK_SIZE:
            record["hash_block_size"] = hash_block_size
    if request.prompt is not None:
        record["prompt"] = request.prompt
    if request.session_id is not None:
        record["session_id"] = request.session_id
    if request.prompt_token_ids is not None:
        record["prompt_token_ids"] = list(request.prompt_token_ids)
    return record


def _check_block_size(record: dict, hash_block_size: int) -> None:
    if "hash_block_size" in record:
        stated = fields.positive_int(record["hash_block_size"], "hash_block_size")
        if stated != hash_block_size:
            raise RecordError("hash_block_size", f"{hash_block_size}, the trace's hash block size", stated)


def _stated_block_size(record: dict) -> int:
    """The block size a record states, else Mooncake's: the first record with hash ids sets the trace's
    (records before it have no blocks to size; a bad value is reported by _check_block_size)."""
    value = record.get("hash_block_size")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return DEFAULT_HASH_BLOCK_SIZE
