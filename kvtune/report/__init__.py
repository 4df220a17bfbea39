"""The tuning report: Markdown (with PNG figures beside it) and one self-contained HTML file.

`write_report(db_url, study, out_dir) -> (report.md, report.html)`;
`add_report_command(subparsers)` wires `kvtune report STUDY`.
"""
from .cli import add_report_command
from .data import ReportError
from .writer import write_report

__all__ = ["ReportError", "add_report_command", "write_report"]
