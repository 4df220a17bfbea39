"""Render the report's blocks as one self-contained HTML file: inline CSS, images as data URIs,
and a few lines of inline JavaScript that sort a table by the clicked column."""
from __future__ import annotations

import base64
import html
import re

from .document import Block, Bullets, Callout, Code, Heading, Image, Paragraph, Table

_CODE = re.compile(r"`([^`]+)`")
_BOLD = re.compile(r"\*\*(.+?)\*\*")

STYLE = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; } h3 { margin-top: 1.5em; }
code, pre { font-family: ui-monospace, monospace; background: #f5f5f5; border-radius: 4px; }
code { padding: 0 .25em; } pre { padding: .8em 1em; overflow-x: auto; }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: .3em .6em; text-align: left; vertical-align: top; }
td.num, th.num { text-align: right; } th { background: #fafafa; }
table.sortable th { cursor: pointer; user-select: none; } table.sortable th:after { content: " ⇅"; color: #aaa; }
tr.ok td:first-child { border-left: 4px solid #2ca02c; } tr.bad td:first-child { border-left: 4px solid #d62728; }
tr.failed { color: #777; } tr.failed td:first-child { border-left: 4px solid #999; }
.callout { padding: .8em 1.2em; border-radius: 6px; margin: 1em 0; }
.callout.ok { background: #eef8ee; border: 1px solid #2ca02c; } .callout.warn { background: #fff4e5; border: 1px solid #e67e00; }
.callout p { margin: .3em 0; } img { max-width: 100%; }
"""

SORT_SCRIPT = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, col) {
    th.addEventListener("click", function () {
      var body = table.tBodies[0], rows = Array.from(body.rows);
      var up = th.dataset.dir !== "asc"; th.dataset.dir = up ? "asc" : "desc";
      function key(row) {
        var text = row.cells[col].textContent.trim(), n = parseFloat(text.replace(/,/g, ""));
        return isNaN(n) ? text.toLowerCase() : n;
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (typeof x !== typeof y) { return typeof x === "number" ? -1 : 1; }
        return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1);
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
"""


def render_html(title: str, blocks: list[Block]) -> str:
    body = "\n".join(_render(b) for b in blocks)
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            f"<h1>{html.escape(title)}</h1>\n{body}\n<script>{SORT_SCRIPT}</script>\n</body>\n</html>\n")


def inline(text: str) -> str:
    """Escape, then turn `code` and **bold** into tags."""
    out = html.escape(str(text), quote=False)
    out = _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", out)
    return _BOLD.sub(lambda m: f"<strong>{m.group(1)}</strong>", out)


def _render(block: Block) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{inline(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p>{inline(block.text)}</p>"
    if isinstance(block, Callout):
        lines = "".join(f"<p>{inline(line)}</p>" for line in block.lines)
        return f'<div class="callout {block.kind}"><p><strong>{inline(block.title)}</strong></p>{lines}</div>'
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{inline(item)}</li>" for item in block.items) + "</ul>"
    if isinstance(block, Code):
        head = f"<p>{inline(block.title)}:</p>" if block.title else ""
        return f"{head}<pre><code>{html.escape(block.text, quote=False)}</code></pre>"
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Image):
        data = base64.b64encode(block.png).decode("ascii")
        return f'<p><img alt="{html.escape(block.alt)}" src="data:image/png;base64,{data}"></p>'
    raise TypeError(f"unknown block {type(block).__name__}")


def _table(table: Table) -> str:
    numeric = table.numeric or [False] * len(table.header)
    kinds = table.row_kinds or [""] * len(table.rows)
    head = "".join(_cell("th", h, n) for h, n in zip(table.header, numeric))
    rows = []
    for row, kind in zip(table.rows, kinds):
        cells = "".join(_cell("td", c, n) for c, n in zip(row, numeric))
        rows.append(f'<tr class="{kind}">{cells}</tr>' if kind else f"<tr>{cells}</tr>")
    opening = '<table class="sortable">' if table.sortable else "<table>"
    return f"{opening}<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _cell(tag: str, text: str, numeric: bool) -> str:
    attrs = ' class="num"' if numeric else ""
    return f"<{tag}{attrs}>{inline(text)}</{tag}>"
