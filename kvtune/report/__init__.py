"""The tuning report: Markdown (with PNG figures beside it) and one self-contained HTML file.

`write_report(db_url, study, out_dir) -> (report.md, report.html)`; `kvtune report`
is in kvtune/cli/report.py.
"""
from ..lazy import exports_of, lazy_face

EXPORTS = exports_of({
    "..search.report_data": ("ReportError",),
    ".writer": ("write_report",),
})
__getattr__, __dir__ = lazy_face(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
