"""JSON that survives NaN: what every backend's JSON columns are written and read with."""
from __future__ import annotations

import json
import math


# Strict JSON (PostgreSQL's json type) has no NaN or Infinity, and summaries hold NaN
# (a rate over a zero duration); tag non-finite floats so every backend reads back the same.
_FLOAT_TAG = "$float"


def json_dumps(value) -> str:
    try:
        return json.dumps(value, allow_nan=False, default=_plain)
    except ValueError:
        return json.dumps(_tag_nonfinite(value), allow_nan=False, default=_plain)


def json_loads(text: str):
    return json.loads(text, object_hook=_untag_nonfinite)


def _plain(obj):
    if hasattr(obj, "tolist"):  # numpy scalars and arrays
        return obj.tolist()
    raise TypeError(f"cannot store {type(obj).__name__} as JSON")


def _tag_nonfinite(value):
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_TAG: repr(value).replace("inf", "Infinity").replace("nan", "NaN")}
    if isinstance(value, dict):
        return {k: _tag_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tag_nonfinite(v) for v in value]
    return value


def _untag_nonfinite(obj: dict):
    if len(obj) == 1 and _FLOAT_TAG in obj:
        return float(obj[_FLOAT_TAG])
    return obj
