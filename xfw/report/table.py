"""The one table model, and the one place reports become markdown, CSV and HTML.

Every report (the contrast table, each seed layout, max-batch, the memory estimate, parity, the
nightly page) builds :class:`Table` objects and arranges them on a :class:`Page` with headings,
paragraphs, bullet lists and images; :func:`to_markdown`, :func:`to_csv` and :func:`to_html`
render any page, so the three formats always carry the same rows::

    page = Page(title="Training benchmark", blocks=[
        Table(header=["Model", "paddle ips"], cells=[["Tiny LLaVA", Strong("crashed")]],
              records=[{"paddle_ips": None}], numeric=(1,)),
        Paragraph("Contrast = (paddle − torch) / torch ..."),
    ])
    to_markdown(page)   # ## Training benchmark / | Model | paddle ips | / ... | **crashed** |
    to_csv(page)        # Model,paddle ips,paddle_ips / Tiny LLaVA,crashed,
    to_html(page)       # one self-contained file: styles inline, images embedded, no script

A cell is a plain string; a :class:`Strong` cell (a status in place of a number) is emphasised
in markdown and HTML and plain in CSV. ``records`` keep each row's raw numbers (bytes, seconds,
samples/s, units in the key) for programs reading the CSV.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import re
from dataclasses import dataclass, field
from pathlib import Path


class Strong(str):
    """A cell shown with emphasis: ``**oom**`` in markdown, ``<strong>`` in HTML, plain in CSV."""


@dataclass(kw_only=True)
class Table:
    header: list[str]
    cells: list[list[str]]
    title: str = ""
    """Shown above the table; the CSV's ``section`` column when a page has several tables."""
    records: list[dict] = field(default_factory=list)
    """Per row, raw numbers with units in their keys, appended to the CSV after the shown columns."""
    numeric: tuple[int, ...] = ()
    """Column indices aligned right."""
    notes: list[str] = field(default_factory=list)
    """Paragraphs under the table."""
    row_classes: list[str] = field(default_factory=list)
    """HTML only: a CSS class per row (``regression``, ``improvement``) to colour it."""
    name: str = ""
    """HTML only: the table's CSS class (tests and style sheets find it by this)."""
    seed_columns: bool = False
    """The shown columns are a seed table's own (xfw.report.layouts): in the CSV they keep their names and a
    raw key differing from one only in case becomes ``<key>_value`` (see :func:`_csv_shown`)."""
    csv: bool = True
    """Whether the page's CSV carries this table (the main numbers do; a settings or provenance table
    beside them would mix another schema into the same columns)."""


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Paragraph:
    text: str
    muted: bool = False
    """HTML only: shown smaller and grey (an explanation, not a finding)."""


@dataclass
class Bullets:
    items: list[str]
    box: str = ""
    """HTML only: ``bad`` (red) or ``good`` (green) frames the list; ``title`` is its bold first line."""
    title: str = ""
    name: str = ""
    """HTML only: the section's id."""


@dataclass
class Image:
    path: Path
    alt: str


Block = Table | Heading | Paragraph | Bullets | Image


@dataclass
class Page:
    title: str
    blocks: list[Block] = field(default_factory=list)
    subtitle: str = ""
    footer: str = ""
    level: int = 2
    """The markdown heading level of the title (a page inside another document uses 2)."""

    def tables(self) -> list[Table]:
        return [b for b in self.blocks if isinstance(b, Table)]


def plain(cell: str) -> str:
    """The cell's text without emphasis."""
    return str(cell)


# --- markdown -------------------------------------------------------------------------------------

def _md_text(text: str) -> str:
    """Text as markdown shows it, never as markup: ``<`` and ``>`` escaped (a recipe name or a
    crash message like ``<img onerror=...>`` must not become HTML in a markdown viewer)."""
    return str(text).replace("<", "&lt;").replace(">", "&gt;")


_LINE_BREAKS = str.maketrans({c: " " for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def _md_line(text: str) -> str:
    """:func:`_md_text` on one line: a line break in a bullet or a heading (a published file's note, a
    crash message) cannot start a heading or a list of its own."""
    return _md_text(text).translate(_LINE_BREAKS)


def _md_cell(cell: str) -> str:
    text = _md_text(cell).replace("|", "\\|").replace("\n", " ")
    return f"**{text}**" if isinstance(cell, Strong) and text else text


def markdown_table(table: Table) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in table.header) + " |",
             "|" + "|".join("---:" if i in table.numeric else "---" for i in range(len(table.header))) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.cells]
    return "\n".join(lines)


def _md_block(block: Block, images: bool) -> list[str]:
    if isinstance(block, Table):
        return ([_md_text(block.title)] if block.title else []) + [markdown_table(block)] + \
            [_md_text(n) for n in block.notes]
    if isinstance(block, Heading):
        return [f"{'#' * block.level} {_md_line(block.text)}"]
    if isinstance(block, Paragraph):
        return [_md_text(block.text)]
    if isinstance(block, Bullets):
        return ([f"**{_md_line(block.title)}**"] if block.title else []) + \
            (["\n".join(f"- {_md_line(i)}" for i in block.items)] if block.items else [])
    if isinstance(block, Image):
        return [f"![{block.alt}]({block.path.name})"] if images else []
    raise TypeError(f"not a page block: {block!r}")


def to_markdown(page: Page, *, images: bool = True) -> str:
    """The page as markdown; ``images=False`` leaves out image links and shows ``<`` and ``>`` as
    themselves (for a terminal, where no viewer turns text into markup)."""
    parts = [f"{'#' * page.level} {_md_text(page.title)}"] + ([_md_text(page.subtitle)] if page.subtitle else [])
    for block in page.blocks:
        parts += _md_block(block, images)
    parts += [_md_text(page.footer)] if page.footer else []
    text = "\n\n".join(parts) + "\n"
    return text if images else text.replace("&lt;", "<").replace("&gt;", ">")


# --- CSV ------------------------------------------------------------------------------------------

FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")
"""What a spreadsheet may take for the start of a formula (OWASP's list, and the full-width forms)."""
_NUMBER = re.compile(r"[+-]?(\d[\d,]*)?\.?\d+([eE][+-]?\d+)?%?")


def csv_safe(value):
    """A CSV cell that cannot start a formula: text starting with ``= + - @``, a tab or a line break
    gets a leading ``'`` (shown by spreadsheets as text); numbers, and text that is a number
    (``-59%``, ``-1.5e-3``), stay as they are."""
    if not isinstance(value, str):
        return value
    value = value.replace("\r\n", "\n").replace("\r", "\n")  # a lone \r is left unquoted by the writer
    if not value.startswith(FORMULA_START) or _NUMBER.fullmatch(value):
        return value
    return "'" + value


def to_csv(page: Page | list[Table]) -> str:
    """One line per table row: the section (when there are several titled tables), the columns as
    shown (plain text), then the raw numbers of ``records`` under their own keys."""
    tables = [t for t in (page.tables() if isinstance(page, Page) else page) if t.csv]
    with_section = len(tables) > 1 and any(t.title for t in tables)
    rows, columns = [], {}
    for t in tables:
        for i, cells in enumerate(t.cells):
            row = {"section": csv_safe(t.title)} if with_section else {}
            raw = t.records[i] if i < len(t.records) else {}
            if t.seed_columns:
                shown = {str(col).lower() for col in t.header}
                raw = {(f"{k}_value" if str(k).lower() in shown and k not in t.header else k): v for k, v in raw.items()}
            row.update({csv_safe(col if t.seed_columns else _csv_shown(col, raw)): csv_safe(plain(cell))
                        for col, cell in zip(t.header, cells)})
            row.update({csv_safe(k): csv_safe(v) for k, v in raw.items() if csv_safe(k) not in row})
            rows.append(row)
            columns.update(dict.fromkeys(row))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _csv_shown(column: str, raw: dict) -> str:
    """A shown column's CSV name: itself, or ``NAME (as shown)`` where a raw key differs from it only in
    case (``Contrast`` "-52%" beside ``contrast`` -0.5169: a program must not be handed two look-alikes)."""
    lowered = {str(k).lower() for k in raw}
    return f"{column} (as shown)" if str(column).lower() in lowered and column not in raw else column


# --- HTML -----------------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1200px;color:#1b1b1b}
h1{font-size:22px;margin-bottom:4px} h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
h3{font-size:16px;margin-top:20px} h4{font-size:14px;margin:14px 0 4px}
.sub{color:#555;margin-top:0}
.box{padding:10px 14px;border-radius:6px;margin:12px 0}
.bad{background:#fde8e8;border:2px solid #b00020} .good{background:#e6f4ea;border:2px solid #1e7b34}
.bad li{color:#7a0016;margin:3px 0}
table{border-collapse:collapse;margin:8px 0;font-size:14px}
th{background:#dde7f7;text-align:left;padding:5px 9px;border:1px solid #b9c6dd}
td{padding:4px 9px;border:1px solid #d5d5d5;overflow-wrap:anywhere} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.regression td{background:#fde8e8} tr.improvement td{background:#e6f4ea}
img{max-width:100%;border:1px solid #eee;margin:6px 0}
.wide{overflow-x:auto;max-width:100%} code{font-size:90%;background:#f3f3f3;padding:0 3px;border-radius:3px}
footer{color:#666;font-size:12px;margin-top:30px}
"""


def _esc(value) -> str:
    return html.escape("" if value is None else str(value))


_BOLD = re.compile(r"\*\*(.+?)\*\*")
_CODE = re.compile(r"`([^`]+)`")


def _inline(value) -> str:
    """Text as HTML, the markdown a report's text carries (``**bold**``, `` `code` ``) shown as such, never
    as raw asterisks and backticks; everything else escaped."""
    text = _esc(value)
    return _CODE.sub(r"<code>\1</code>", _BOLD.sub(r"<strong>\1</strong>", text))


def _html_cell(cell: str) -> str:
    return f"<strong>{_esc(cell)}</strong>" if isinstance(cell, Strong) else _inline(cell)


def html_table(table: Table) -> str:
    out = ['<div class=wide>' + (f'<table class="{_esc(table.name)}">' if table.name else "<table>"),
           "<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in table.header) + "</tr>"]
    for i, row in enumerate(table.cells):
        cls = table.row_classes[i] if i < len(table.row_classes) else ""
        out.append((f'<tr class="{_esc(cls)}">' if cls else "<tr>")
                   + "".join(f'<td{" class=num" if j in table.numeric else ""}>{_html_cell(c)}</td>'
                             for j, c in enumerate(row)) + "</tr>")
    return "\n".join(out + ["</table></div>"])


def _png_tag(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{data}">'


def _html_block(block: Block) -> str:
    if isinstance(block, Table):
        return "\n".join(([f"<h3>{_esc(block.title)}</h3>"] if block.title else []) + [html_table(block)]
                         + [f"<p>{_inline(n)}</p>" for n in block.notes])
    if isinstance(block, Heading):
        level = min(block.level, 4)
        return f"<h{level}>{_esc(block.text)}</h{level}>"
    if isinstance(block, Paragraph):
        return f"<p class=sub>{_inline(block.text)}</p>" if block.muted else f"<p>{_inline(block.text)}</p>"
    if isinstance(block, Bullets):
        title = f"<strong>{_inline(block.title)}</strong>" if block.title else ""
        items = "<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in block.items) + "</ul>" if block.items else ""
        attrs = (f" id={_esc(block.name)}" if block.name else "") + (f' class="box {_esc(block.box)}"' if block.box else "")
        return f"<section{attrs}>{title}{items}</section>"
    if isinstance(block, Image):
        return _png_tag(block.path, block.alt)
    raise TypeError(f"not a page block: {block!r}")


def to_html(page: Page) -> str:
    """One self-contained file: the style sheet inline, images embedded, no script, no link."""
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{_esc(page.title)}</title>"
             f"<style>{CSS}</style></head><body>", f"<h1>{_esc(page.title)}</h1>"]
    parts += [f"<p class=sub>{_inline(page.subtitle)}</p>"] if page.subtitle else []
    parts += [_html_block(b) for b in page.blocks]
    parts += [f"<footer>{_inline(page.footer)}</footer>"] if page.footer else []
    return "\n".join(parts + ["</body></html>"]) + "\n"
