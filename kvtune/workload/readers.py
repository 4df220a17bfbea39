"""`read_workload`: any supported trace file into a `Workload`."""
from __future__ import annotations

import os

from .azure_csv import read_azure_csv
from .burstgpt_csv import read_burstgpt_csv
from .context import ReadContext
from .detect import FORMATS, TIMED_FORMATS, detect_format
from .errors import TraceError
from .kvtune_jsonl import read_kvtune_jsonl
from .model import DEFAULT_HASH_BLOCK_SIZE, Workload
from .sharegpt_json import read_sharegpt_json
from .transforms import retime
from .vllm_custom import read_vllm_custom

_READERS = {
    "azure": read_azure_csv,
    "burstgpt": read_burstgpt_csv,
    "sharegpt": read_sharegpt_json,
    "vllm-custom": read_vllm_custom,
}


def read_workload(path: str | os.PathLike, format: str | None = None, skip_bad: bool = False,
                  hash_block_size: int | None = None, rate: float | None = None,
                  burstiness: float = 1.0, seed: int = 0) -> Workload:
    """Read a trace file of any supported format into a Workload sorted by arrival.

    format: one of FORMATS, or None to tell from the content.
    skip_bad: skip (and count in `Workload.skipped`) records that fail to
        parse instead of raising TraceError.
    hash_block_size: tokens per hash id; None means what the file states
        (kvtune JSONL written with finer blocks says so), else 512.
    rate, burstiness, seed: only for formats without timestamps (ShareGPT,
        vLLM custom), whose requests otherwise all arrive at t=0: arrivals
        from a gamma process at `rate` requests/s (see `retime`).
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"unknown trace format {format!r}; expected one of {', '.join(FORMATS)}")
    name = os.fspath(path)
    text = _read_text(name)
    if not text.strip():
        raise TraceError(name, None, "empty file: expected a trace with at least one request")
    fmt = format or detect_format(text, name)
    if rate is not None and fmt in TIMED_FORMATS:
        raise ValueError(f"rate= would replace the {fmt} trace's timestamps; use retime() to do that on purpose")
    ctx = ReadContext(name, skip_bad)
    if fmt in ("kvtune", "mooncake"):
        workload = read_kvtune_jsonl(text, ctx, hash_block_size)
    else:
        workload = _READERS[fmt](text, ctx, hash_block_size or DEFAULT_HASH_BLOCK_SIZE)
    return workload if rate is None else retime(workload, rate, burstiness, seed)


def _read_text(name: str) -> str:
    try:
        with open(name, encoding="utf-8-sig", newline="") as file:
            return file.read()
    except UnicodeDecodeError as err:
        raise TraceError(name, None, f"not a trace: not UTF-8 text (byte {err.start})") from None
