"""The UI's charts are the report's (kvtune.report.plots): one matplotlib figure per chart, put on a page by `show`,
so a chart on screen and in report.html read the same."""
from __future__ import annotations

from typing import TYPE_CHECKING

import streamlit as st

from ..report.plots import binned, capacity, history, importance, lengths, pareto, png, timeline, tradeoff_points

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["binned", "capacity", "history", "importance", "lengths", "pareto", "show", "timeline",
           "tradeoff_points"]


def show(figure: Figure, width: int | str = "stretch") -> None:
    """The figure on the page as the report's PNG; `width` in pixels keeps a small chart from being stretched
    across a wide page.

    Not st.pyplot: it draws at 200 dpi and then resizes, slow enough on the Live page's reruns that a click on
    Stop was lost half the time; st.pyplot also imports pyplot into the server."""
    st.image(png(figure), width=width)
