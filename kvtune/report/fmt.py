"""Numbers with their units, the way an ops reader wants them: short, never 'None'."""
from __future__ import annotations

import math
from datetime import UTC

from ..results import bound_text, quantile_bound

GiB = 1 << 30
KiB = 1 << 10
MISSING = "–"


def on_gpus(device, tensor_parallel_size: int | None) -> str:
    """Where a config runs: the device, or "T × device (tensor parallel)" for one replica over T GPUs."""
    tp = tensor_parallel_size or 1
    return f"{tp} × {device} (tensor parallel)" if tp > 1 else str(device)


def _known(value) -> bool:
    return value is not None and not (isinstance(value, float) and not math.isfinite(value))


def ms(seconds: float | None) -> str:
    if not _known(seconds):
        return MISSING
    value = seconds * 1000
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def quantile(summary: dict, key: str) -> str:
    """A latency quantile of a run's summary: '150 ms', or where a server histogram only bounds it
    (its first bucket (0, b] or its +Inf bucket) '< 300 ms' / '> 80 s', never an interpolated guess."""
    bound = quantile_bound(summary, key)
    return bound_text(*bound) if bound is not None else ms(summary.get(key))


def rps(value: float | None) -> str:
    return f"{value:.2f} req/s" if _known(value) else MISSING


def tok_s(value: float | None) -> str:
    return f"{value:,.0f} tok/s" if _known(value) else MISSING


def pct(fraction: float | None, digits: int = 1) -> str:
    return f"{fraction * 100:.{digits}f} %" if _known(fraction) else MISSING


def gib(nbytes: float | None) -> str:
    return f"{nbytes / GiB:.2f} GiB" if _known(nbytes) else MISSING


def kib(nbytes: float | None) -> str:
    return f"{nbytes / KiB:g} KiB" if _known(nbytes) else MISSING


def count(value) -> str:
    return f"{int(value):,}" if _known(value) else MISSING


def number(value, digits: int = 3) -> str:
    if not _known(value):
        return MISSING
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.{digits}g}"


def change(new: float | None, old: float | None) -> str:
    """'+12 %' relative to old; empty when either side is unknown or old is zero."""
    if not (_known(new) and _known(old)) or old == 0:
        return ""
    return f"{(new - old) / abs(old) * 100:+.0f} %"


def param(name: str, value) -> str:
    if name == "gpu_memory_utilization" and isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def tokens(value) -> str:
    """'1,234 tokens'; a percentile between two lengths keeps its half: '666.5 tokens'."""
    if not _known(value):
        return MISSING
    return f"{int(value):,} tokens" if float(value).is_integer() else f"{value:,.1f} tokens"


def seconds(value: float | None) -> str:
    """A span in seconds: '1.91 s', '86.4 s', '3,600 s (1.0 h)'."""
    if not _known(value):
        return MISSING
    text = f"{value:.3g} s" if value < 100 else f"{value:,.0f} s"
    if value >= 3600:
        return f"{text} ({value / 3600:.1f} h)"
    return f"{text} ({value / 60:.1f} min)" if value >= 120 else text


def utc(moment) -> str:
    """An aware datetime as '2026-12-01 12:49:58 UTC' (ISO date and time)."""
    if moment is None:
        return MISSING
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
