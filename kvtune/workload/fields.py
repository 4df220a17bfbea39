"""Checks for one field of one record; each raises `RecordError` naming the field.

JSON values must already have the right type (a string "3" is not a length);
CSV cells are converted by `cell` first, so both kinds of reader share one
wording for what was expected.
"""
from __future__ import annotations

import math
from typing import Any

from .errors import RecordError
from .model import blocks_for

MISSING = "nothing (the field is missing)"
# Prompt plus output tokens of one request. Its prompt's token ids are made in memory (8 bytes a
# token, several copies): past this a trace line exhausts memory long before a server refuses it.
MAX_REQUEST_TOKENS = 10**7


def cell(raw: str) -> int | float | str:
    """A CSV cell as a number where it reads as one, else the text itself."""
    raw = raw.strip()
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        return raw


def require(record: dict, key: str, expected: str) -> Any:
    if key not in record:
        raise RecordError(key, expected, raw=MISSING)
    return record[key]


def positive_int(value: Any, field: str) -> int:
    """An integer >= 1; an integral float (3.0) is accepted."""
    number = _integer(value)
    if number is None or number < 1:
        raise RecordError(field, "an integer >= 1", value)
    return number


def token_count(value: Any, field: str) -> int:
    """A length in tokens: an integer from 1 to MAX_REQUEST_TOKENS."""
    number = positive_int(value, field)
    if number > MAX_REQUEST_TOKENS:
        raise RecordError(field, f"an integer from 1 to {MAX_REQUEST_TOKENS} (the most tokens kvtune "
                                 "replays in one request)", value)
    return number


def request_size(input_length: int, output_length: int, field: str) -> None:
    """Prompt and output together within MAX_REQUEST_TOKENS; `field` is the one blamed."""
    if input_length + output_length > MAX_REQUEST_TOKENS:
        raise RecordError(field, f"prompt ({input_length}) and output ({output_length}) tokens within "
                                 f"{MAX_REQUEST_TOKENS} (the most kvtune replays in one request)",
                          raw=str(input_length + output_length))


def non_negative_int(value: Any, field: str) -> int:
    number = _integer(value)
    if number is None or number < 0:
        raise RecordError(field, "an integer >= 0", value)
    return number


def timestamp(value: Any, field: str, unit: str) -> float:
    """A finite number >= 0."""
    number = _number(value)
    if number is None or number < 0:
        raise RecordError(field, f"a number of {unit} >= 0", value)
    return number


def text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise RecordError(field, "a string", value)
    return value


def optional_text(record: dict, key: str, numbers_ok: bool = False) -> str | None:
    """A string field that may be absent or null; with `numbers_ok`, an integer
    (an id, say) is taken as its text."""
    value = record.get(key)
    if value is None:
        return None
    if numbers_ok and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return text(value, key)


def hash_ids(value: Any, input_length: int, hash_block_size: int) -> tuple[int, ...]:
    """A list of ids >= 0, one per `hash_block_size` tokens of the prompt."""
    expected = blocks_for(input_length, hash_block_size)
    return _id_list(value, "hash_ids", expected,
                    f"ceil(input_length {input_length} / hash_block_size {hash_block_size})")


def token_ids(value: Any, input_length: int) -> tuple[int, ...]:
    """The prompt's exact tokens: a list of integers >= 0, input_length of them."""
    return _id_list(value, "prompt_token_ids", input_length, "input_length")


def _id_list(value: Any, field: str, count: int, why: str) -> tuple[int, ...]:
    """`count` integers >= 0 (`why` says where the count comes from)."""
    if not isinstance(value, list) or not all(_is_id(v) for v in value):
        raise RecordError(field, "a list of integers >= 0", value)
    if len(value) != count:
        raise RecordError(field, f"{count} ids ({why})", raw=f"{len(value)}")
    return tuple(value)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    number = _number(value)
    if number is not None and number.is_integer():
        return int(number)
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None
