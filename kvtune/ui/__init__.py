"""`kvtune ui`: a Streamlit app over the run store and the Optuna studies beside it.

app.py is the entry point Streamlit runs; each page is one module (runs,
search, diagnoses, planner, live) that Streamlit executes as a script; data.py
is the only one that reads the database; tables.py draws every table (figures
rounded to their unit, a missing one as the report's dash). `add_ui_command(subparsers)` in cli.py
wires the command. Importing this package does not import Streamlit.
"""
