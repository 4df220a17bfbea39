"""Line handling shared by the JSON-lines formats."""
from __future__ import annotations

import json
from collections.abc import Iterator

from .errors import RecordError

# Python's decoder recurses once per level of nesting: a line of thousands of "[" exhausts its stack.
TOO_DEEP = "JSON nested too deeply to read"


def numbered_lines(text: str) -> Iterator[tuple[int, str]]:
    """Non-blank lines with their 1-based line numbers.

    Splits on "\\n" only: str.splitlines would also split inside JSON strings
    that hold U+2028 or other Unicode line separators.
    """
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield number, line


def json_object(line: str) -> dict:
    """The line's JSON object; anything else, unreadable JSON included, is a RecordError."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        raise RecordError(None, "a JSON object", raw=f"invalid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise RecordError(None, "a JSON object", raw=TOO_DEEP) from None
    if not isinstance(value, dict):
        raise RecordError(None, "a JSON object", value)
    return value
