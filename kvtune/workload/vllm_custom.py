"""vLLM bench's "custom" dataset: `{"prompt": text, "output_tokens": int}` per line.

No timestamps: every request arrives at t=0 until re-timed. The input length
is the prompt's length under the bundled byte-level tokenizer.
"""
from __future__ import annotations

from . import fields
from .context import ReadContext, finish
from .errors import RecordError
from .jsonl import json_object, numbered_lines
from .model import TraceRequest, Workload
from .tokens import count_tokens


def read_vllm_custom(text: str, ctx: ReadContext, hash_block_size: int) -> Workload:
    requests = []
    for line, raw in numbered_lines(text):
        request = ctx.parse(line, parse_line, raw)
        if request is not None:
            requests.append(request)
    return finish(requests, ctx, hash_block_size)


def parse_line(line: str) -> TraceRequest:
    record = json_object(line)
    prompt = fields.text(fields.require(record, "prompt", "a string"), "prompt")
    input_length = count_tokens(prompt)
    if input_length < 1:
        raise RecordError("prompt", "a non-empty prompt", prompt)
    output_length = fields.token_count(
        fields.require(record, "output_tokens", "an integer >= 1"), "output_tokens")
    fields.request_size(input_length, output_length, "prompt")
    return TraceRequest(0.0, input_length, output_length, prompt=prompt)
