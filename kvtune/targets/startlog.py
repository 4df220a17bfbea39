"""The line of a server's log that says why it failed to start.

vLLM prints the real cause of a failed start (a `ValueError` raised in its
EngineCore or worker process) early, then the API server's wrapper tracebacks
(`RuntimeError: Engine core initialization failed. See root cause above`,
`KeyboardInterrupt: terminated`) after it, so the last lines of the log show
only the wrappers. `root_cause(text)` finds the cause:

1. the last Python exception line (`ValueError: No common block size ...`) or
   command-line error line (argparse's `prog: error: argument --x: ...`,
   kvengine's `error: engine cannot start: ...`) that is not a wrapper;
2. else the last `ERROR`/`CRITICAL` log message that is not a wrapper.

Log prefixes (vLLM's `(Worker pid=5944) ERROR 12-01 09:44:48 [file.py:1063] `)
are taken off before a line is judged and are not part of the line returned.
"""
from __future__ import annotations

import re

# `(EngineCore_DP0 pid=123) ` in front of every line a vLLM process prints
_PROCESS = r"(?:\([\w.\-]+ pid=\d+\)\s+)?"
# `ERROR 12-01 09:44:48 [core.py:1510] ` (vLLM) or `ERROR kvengine.entrypoints.serve: ` (kvengine, logging's basicConfig)
_LEVEL = (r"(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)"
          r"(?:\s+\d\d-\d\d\s+\d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?|\s+[\w.]+:\s|:\s+)")
_PREFIX = re.compile(rf"^{_PROCESS}(?:{_LEVEL})?")
# `ValueError: ...`, `torch.OutOfMemoryError: ...`, `pydantic_core._pydantic_core.ValidationError: ...`
_EXCEPTION = re.compile(r"^(?:\|\s+)?(?P<type>(?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception|Exit|Interrupt|"
                        r"Failure|Fault))(?::\s*(?P<message>.*))?$")
# argparse: `api_server.py: error: argument --kv-cache-dtype: invalid choice: ...`; kvengine: `error: ...`
_CLI_ERROR = re.compile(r"^(?:[\w.\- ]+:\s)?error:\s+\S")
# Lines that only point at a cause printed elsewhere (vLLM's API server, EngineCore and worker wrappers; ours)
WRAPPERS = (
    "engine core initialization failed", "root cause above", "for root cause", "for the root cause",
    "failed core proc", "check the stack trace above", "enginecore failed to start", "workerproc hit an exception",
    "workerproc failed to start", "exception in a background process", "worker failed with error",
    "the server exited", "before it was healthy", "traceback (most recent call last)",
    "during handling of the above exception", "the above exception was the direct cause",
    "process manager: send sigterm",
)
WRAPPER_TYPES = ("KeyboardInterrupt", "SystemExit", "GeneratorExit", "BrokenPipeError", "ConnectionResetError",
                 "CancelledError")


def strip_prefix(line: str) -> tuple[str, str | None]:
    """The line without its process and log-level prefix, and that level (None when it has none)."""
    line = line.rstrip("\r\n")
    match = _PREFIX.match(line)
    if not match or not match.group(0):
        return line, None
    return line[match.end():], match.group("level")


def is_wrapper(text: str) -> bool:
    """A line that only says that something failed elsewhere (see the cause above)."""
    lowered = text.lower()
    if any(w in lowered for w in WRAPPERS):
        return True
    match = _EXCEPTION.match(text.strip())
    return bool(match) and match.group("type").rsplit(".", 1)[-1] in WRAPPER_TYPES


def _kind(text: str, level: str | None) -> str | None:
    """'error' for an exception or command-line error line, 'log' for an ERROR log message, else None."""
    if not text.strip() or text[:1].isspace() or text.lstrip().startswith(("^", "~", "File \"")):
        return None  # blank, a traceback frame, its source line or its carets
    if _EXCEPTION.match(text) or _CLI_ERROR.match(text):
        return "error"
    if level in ("ERROR", "CRITICAL"):
        return "log"
    return None


# pydantic: "ValidationError: 1 validation error for CacheConfig", then the field and what it should be below
_VALIDATION = re.compile(r"\d+ validation errors? for \w+$")
_VALIDATION_LINES = 6


def root_cause(text: str | None) -> str | None:
    """The line of `text` (a server's log, or an error message that quotes it) that says why it failed.

    A pydantic ValidationError's line takes its field and message lines along, joined by ': '."""
    if not text:
        return None
    lines = [strip_prefix(raw) for raw in text.splitlines()]
    best: dict[str, str] = {}
    for i, (line, level) in enumerate(lines):
        kind = _kind(line, level)
        if kind and not is_wrapper(line):
            best[kind] = line.strip()
            if kind == "error" and _VALIDATION.search(line.rstrip()):
                best[kind] = ": ".join([line.strip()] + _validation_details(lines[i + 1:i + 1 + _VALIDATION_LINES]))
    return best.get("error") or best.get("log")


def _validation_details(lines: list[tuple[str, str | None]]) -> list[str]:
    """pydantic's lines under its ValidationError: a field (`gpu_memory_utilization`) at the margin, then
    what it should be, indented; anything else ends them."""
    out = []
    for line, _ in lines:
        text = line.strip()
        if not text or not (line[:1].isspace() or re.fullmatch(r"[\w.\[\]]+", text)):
            break
        if not text.startswith("For further information"):
            out.append(text)
    return out


def log_tail(path: str, lines: int = 10) -> str:
    """The last `lines` lines of the file at `path` ('' when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def read_log(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
