"""Which trace format a file holds, judged from its content, not its name."""
from __future__ import annotations

from .errors import RecordError, TraceError
from .jsonl import json_object

FORMATS = ("kvtune", "mooncake", "azure", "burstgpt", "sharegpt", "vllm-custom")
TIMED_FORMATS = ("kvtune", "mooncake", "azure", "burstgpt")

_LOOK_AHEAD = 64  # lines

_KNOWN = ("kvtune/Mooncake JSONL, Azure CSV, BurstGPT CSV, ShareGPT JSON "
          "or vLLM custom JSONL")


def detect_format(text: str, path: str) -> str:
    """One of FORMATS, or a TraceError saying why the file is not a trace."""
    line_number, line = _first_line(text)
    if line is None:
        raise TraceError(path, None, "empty file: expected a trace with at least one request")
    if line.startswith("["):
        return "sharegpt"
    if line.startswith("{"):
        return _jsonl_format(text, path, line_number)
    cells = {cell.strip() for cell in line.split(",")}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= cells:
        return "azure"
    if {"Timestamp", "Request tokens", "Response tokens"} <= cells:
        return "burstgpt"
    raise TraceError(path, line_number, f"not a recognised trace (expected {_KNOWN}); "
                                        f"it starts with {line[:40]!r}")


def _jsonl_format(text: str, path: str, first_line: int) -> str:
    """Judged by the first record that parses, so one corrupt line (which
    skip_bad may skip) does not hide the format."""
    first_problem = None
    for line in text.split("\n", _LOOK_AHEAD)[:_LOOK_AHEAD]:
        if not line.strip():
            continue
        try:
            record = json_object(line)
        except RecordError as err:
            first_problem = first_problem or err.problem
            continue
        if "timestamp" in record or "input_length" in record:
            return "kvtune"
        if "prompt" in record and "output_tokens" in record:
            return "vllm-custom"
        break
    else:
        if first_problem:  # no line read as a JSON object: say why the first one did not
            raise TraceError(path, first_line, f"not a recognised trace: {first_problem}")
    raise TraceError(path, first_line, f"not a recognised trace (expected {_KNOWN}); the first record "
                                       "is not a JSON object with timestamp/input_length or "
                                       "prompt/output_tokens")


def _first_line(text: str) -> tuple[int, str | None]:
    for number, line in enumerate(text.split("\n", _LOOK_AHEAD)[:_LOOK_AHEAD], start=1):
        if line.strip():
            return number, line.strip()
    return 0, None
