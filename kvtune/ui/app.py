"""The Streamlit entry point: `streamlit run kvtune/ui/app.py` (which `kvtune ui` does), the database in $KVTUNE_DB."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before anything imports torch

import streamlit as st

from kvtune.ui import data

PAGES = (("runs.py", "Runs", ":material/monitoring:"), ("search.py", "Search", ":material/tune:"),
         ("diagnoses.py", "Diagnoses", ":material/stethoscope:"), ("planner.py", "Planner", ":material/calculate:"),
         ("live.py", "Live", ":material/sensors:"))


def main() -> None:
    st.set_page_config(page_title="kvtune", page_icon=":material/memory:", layout="wide")
    pages = [st.Page(path, title=title, icon=icon, default=i == 0) for i, (path, title, icon) in enumerate(PAGES)]
    # The pages along the top, not in a sidebar: the tables get the page's whole width.
    page = st.navigation(pages, position="top")
    db = data.database()
    page.run()
    st.divider()
    st.caption(f"**kvtune**: the KV cache of LLM servers, measured, explained and tuned. "
               f"Database: `{db.display_url}` (read only).")


main()
