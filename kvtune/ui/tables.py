"""Tables as the report prints its figures: each number rounded to its unit's precision (the unit in its
column's header), a missing one as the report's dash, never `None` or `nan`.

The numbers are rounded in the data itself, not only in the column's format: the browser's grid draws the
format but reads the raw value out to screen readers and copies, and sorts by it.
"""
from __future__ import annotations

import pandas as pd
import streamlit as st

from ..report import fmt

# A figure's unit, as its column's header ends, and the decimals kvtune.report.fmt shows it with.
UNIT_DECIMALS = (("(ms)", 1), ("(req/s)", 2), ("(%)", 1), ("(GiB)", 2), ("(s)", 1), ("(tok/s)", 0),
                 ("(tokens)", 1), ("gpu_memory_utilization", 2))
OTHER_DECIMALS = 3  # a float whose header names no unit


def decimals(column: str) -> int:
    return next((d for suffix, d in UNIT_DECIMALS if str(column).endswith(suffix)), OTHER_DECIMALS)


def number_format(column: str) -> str:
    """The printf format of a float column: fixed decimals for a unit's figures, the shortest form otherwise."""
    d = decimals(column)
    return f"%.{d}f" if d != OTHER_DECIMALS else "%g"


def float_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if pd.api.types.is_float_dtype(frame[c])]


def rounded(frame: pd.DataFrame) -> pd.DataFrame:
    """Every float column rounded to its unit's decimals; a float column of whole numbers stays float."""
    out = frame.copy()
    for column in float_columns(out):
        out[column] = out[column].round(decimals(column))
    return out


def number_config(frame: pd.DataFrame) -> dict:
    return {c: st.column_config.NumberColumn(format=number_format(c)) for c in float_columns(frame)}


def table(frame: pd.DataFrame, key: str | None = None, column_config: dict | None = None,
          colour: tuple[str, object] | None = None) -> None:
    """`frame` on the page, rounded and formatted, missing values as fmt.MISSING. `colour`: (column, function
    from a cell to its CSS) colours that column's text, through a pandas Styler."""
    frame = rounded(frame)
    config = number_config(frame) | (column_config or {})
    data = frame
    if colour is not None:
        column, css = colour
        # A Styler's own formats replace st.column_config's, so the Styler gets them too.
        formats = {c: "{:" + number_format(c)[1:] + "}" for c in float_columns(frame)}
        data = (frame.style.map(css, subset=[column]).format(na_rep=fmt.MISSING)
                .format(formats, na_rep=fmt.MISSING))
    st.dataframe(data, hide_index=True, key=key, column_config=config, placeholder=fmt.MISSING)
