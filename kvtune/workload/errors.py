"""What goes wrong when reading a trace, and how it is reported.

A `RecordError` is raised by the field checks, which know the field but not
where the record sits; the reader adds the file and line and turns it into a
`TraceError`, whose message reads like a compiler's:

    traces.jsonl:7: field "input_length": expected an integer >= 1, got -3
"""
from __future__ import annotations

import json


class TraceWarning(UserWarning):
    """Something the reader fixed or left out, e.g. out-of-order timestamps."""


class RecordError(ValueError):
    """One record is bad; `field` is None when the record as a whole is."""

    def __init__(self, field: str | None, expected: str, got: object = None, *, raw: str | None = None):
        self.field = field
        self.expected = expected
        self.got = raw if raw is not None else describe(got)
        super().__init__(self.problem)

    @property
    def problem(self) -> str:
        where = f'field "{self.field}": ' if self.field else ""
        return f"{where}expected {self.expected}, got {self.got}"


class TraceError(ValueError):
    """A trace file cannot be read; the message names file, line and field."""

    def __init__(self, path: str, line: int | None, problem: str, field: str | None = None):
        self.path = path
        self.line = line
        self.field = field
        self.problem = problem
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {problem}")

    @classmethod
    def at(cls, path: str, line: int | None, error: RecordError) -> TraceError:
        return cls(path, line, error.problem, error.field)


def describe(value: object, limit: int = 40) -> str:
    """A short JSON-ish rendering of a bad value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    except RecursionError:
        # JSON the decoder just managed can be too deep to encode again from further down the stack.
        return "a value nested too deeply to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."
