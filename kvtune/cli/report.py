"""`kvtune report STUDY [--db URL] [--out DIR]`: write a study's report and say where it is."""
from __future__ import annotations

import sys

from .commands import COMMANDS
from .args import add_db_argument


def add_report_command(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help=COMMANDS["report"].help,
        description="Write the report of a `kvtune search` study: the recommended config and its launch "
                    "commands, stage 1 vs stage 2, the search's figures, the KV cache over time, diagnoses, "
                    "the capacity plan and every trial. Exits 2 for an unknown or empty study.")
    p.add_argument("study", help="the study's name (as given to or printed by kvtune search)")
    add_db_argument(p)
    p.add_argument("--out", metavar="DIR", help="where to write it (default: reports/<study>/)")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from ..search.report_data import ReportError
    from ..report.writer import write_report
    from ..store import StoreError, resolve_db_url

    try:
        md, html = write_report(resolve_db_url(args.db), args.study, args.out or f"reports/{args.study}")
    except (ReportError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report: {md}")
    print(f"        {html} (self-contained: open it in any browser or attach it)")
    return 0
