"""The report as plain blocks, written once and rendered twice (Markdown and HTML).

Text may use two inline marks, which both renderers understand: `code` and **bold**.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Paragraph:
    text: str


@dataclass
class Callout:
    """A boxed message at the top: kind ok (a recommendation) or warn (nothing met the SLOs)."""
    kind: str
    title: str
    lines: list[str] = field(default_factory=list)


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Code:
    text: str
    title: str = ""
    language: str = "bash"  # "text" for figures that are not commands


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    sortable: bool = False
    row_kinds: list[str] | None = None  # per row: ok, bad, failed or "" (colours in HTML)
    numeric: list[bool] | None = None  # per column: right-aligned, sorted as numbers


@dataclass
class Image:
    filename: str  # beside report.md; embedded in report.html
    alt: str
    png: bytes


Block = Heading | Paragraph | Callout | Bullets | Code | Table | Image
