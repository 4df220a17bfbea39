"""ShareGPT: a JSON array of `{"id", "conversations": [{"from", "value"}, ...]}`.

Each human turn answered by the next turn is one request. Its prompt is the
conversation so far, turns joined by newlines, ending with that human turn, as
a chat client would send it, so later turns extend earlier ones and prefix
sharing within a conversation is real; its output length is the reply's.
Lengths come from the bundled byte-level tokenizer. `session_id` is the
conversation's id. A human turn with no (or an empty) reply is left out and
counted in `Workload.failed`.

No timestamps: every request arrives at t=0 until re-timed (`read_workload`'s
`rate`, or `retime`).
"""
from __future__ import annotations

import json
from collections.abc import Iterator

from . import fields
from .context import ReadContext, finish
from .errors import RecordError, describe
from .jsonl import TOO_DEEP
from .model import TraceRequest, Workload
from .tokens import count_tokens

HUMAN = {"human", "user"}
ANSWER = {"gpt", "chatgpt", "assistant", "bard", "bing", "model"}
SYSTEM = {"system"}
FAILED_REASON = "human turns without a reply"


def read_sharegpt_json(text: str, ctx: ReadContext, hash_block_size: int) -> Workload:
    ctx.failed_reason = FAILED_REASON
    requests = []
    for index, (line, item) in enumerate(array_items(text, ctx)):
        parsed = ctx.parse(line, parse_conversation, item, index)
        if parsed is not None:
            answered, unanswered = parsed
            requests.extend(answered)
            ctx.failed += unanswered
    return finish(requests, ctx, hash_block_size)


def parse_conversation(item: object, index: int) -> tuple[list[TraceRequest], int]:
    """The conversation's requests, and how many human turns had no reply."""
    if not isinstance(item, dict):
        raise RecordError(None, "a conversation object", item)
    turns = fields.require(item, "conversations", "a list of turns")
    if not isinstance(turns, list):
        raise RecordError("conversations", "a list of turns", turns)
    session = fields.optional_text(item, "id", numbers_ok=True) or f"conversation-{index}"
    roles, texts = zip(*(_turn(turn, i) for i, turn in enumerate(turns))) if turns else ((), ())
    requests, unanswered = [], 0
    for i, role in enumerate(roles):
        if role != "human":
            continue
        prompt = "\n".join(texts[: i + 1])
        reply = texts[i + 1] if i + 1 < len(roles) and roles[i + 1] == "answer" else ""
        input_length, output_length = count_tokens(prompt), count_tokens(reply)
        fields.request_size(input_length, output_length, f"conversations[{i}].value")
        if input_length and output_length:
            requests.append(TraceRequest(0.0, input_length, output_length,
                                         prompt=prompt, session_id=session))
        else:
            unanswered += 1
    return requests, unanswered


def _turn(turn: object, i: int) -> tuple[str, str]:
    if not isinstance(turn, dict):
        raise RecordError(f"conversations[{i}]", 'a turn object {"from", "value"}', turn)
    role = turn.get("from")
    value = turn.get("value")
    if not isinstance(value, str):
        raise RecordError(f"conversations[{i}].value", "a string", raw=_got(turn, "value"))
    if not isinstance(role, str):
        raise RecordError(f"conversations[{i}].from", "human, gpt or system", raw=_got(turn, "from"))
    if role in HUMAN:
        return "human", value
    if role in ANSWER:
        return "answer", value
    if role in SYSTEM:
        return "system", value
    raise RecordError(f"conversations[{i}].from", "human, gpt or system", role)


def _got(turn: dict, key: str) -> str:
    return describe(turn[key]) if key in turn else fields.MISSING


def array_items(text: str, ctx: ReadContext) -> Iterator[tuple[int, object]]:
    """The items of a top-level JSON array, each with the line it starts on.

    Decoding item by item keeps line numbers for error messages; a syntax error
    cannot be skipped, since the rest of the array cannot be found after it.
    """
    decoder = json.JSONDecoder()
    pos, line, counted = _skip_space(text, 0), 1, 0

    def line_at(at: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, at)
        counted = at
        return line

    if not text.startswith("[", pos):
        raise ctx.error(line_at(pos), "expected a JSON array of ShareGPT conversations")
    pos = _skip_space(text, pos + 1)
    if text.startswith("]", pos):
        return
    while True:
        start = line_at(pos)
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise ctx.error(err.lineno, f"invalid JSON ({err.msg} at column {err.colno})") from None
        except RecursionError:
            raise ctx.error(start, TOO_DEEP) from None
        yield start, item
        pos = _skip_space(text, pos)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
        elif text.startswith("]", pos):
            break
        else:
            raise ctx.error(line_at(pos), "invalid JSON (expected ',' or ']' after an item)")
    if text[pos + 1:].strip():
        raise ctx.error(line_at(pos + 1), "unexpected text after the JSON array")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
