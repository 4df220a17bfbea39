"""Render the report's blocks as GitHub-flavoured Markdown; images are linked files beside it."""
from __future__ import annotations

from .document import Block, Bullets, Callout, Code, Heading, Image, Paragraph, Table


def render_markdown(title: str, blocks: list[Block]) -> str:
    parts = [f"# {title}"]
    for block in blocks:
        parts.append(_render(block))
    return "\n\n".join(parts) + "\n"


def _render(block: Block) -> str:
    if isinstance(block, Heading):
        return f"{'#' * block.level} {block.text}"
    if isinstance(block, Paragraph):
        return block.text
    if isinstance(block, Callout):
        icon = "✅" if block.kind == "ok" else "⚠️"
        return "\n".join([f"> {icon} **{block.title}**", *(f">\n> {line}" for line in block.lines)])
    if isinstance(block, Bullets):
        return "\n".join(f"- {item}" for item in block.items)
    if isinstance(block, Code):
        head = f"{block.title}:\n\n" if block.title else ""
        return f"{head}```{block.language}\n{block.text}\n```"
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Image):
        return f"![{block.alt}]({block.filename})"
    raise TypeError(f"unknown block {type(block).__name__}")


def _table(table: Table) -> str:
    numeric = table.numeric or [False] * len(table.header)
    align = ["---:" if n else "---" for n in numeric]
    lines = [_row(table.header), _row(align)]
    lines += [_row(row) for row in table.rows]
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
