"""How pplab's reports show themselves: aligned text tables, HTML tables and byte sizes.

One look for every report: a terminal, a repr and a notebook read the same rows, and
bytes read "512 B", "16.0 KiB", "6.0 MiB" wherever they appear. Floor 1: pure Python.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence


class ShownAsText:
    """Reports read the same in a terminal, in a repr and (as a table) in a notebook."""

    def __repr__(self) -> str:
        return str(self)


# --- text -----------------------------------------------------------------------------------


def text_table(header: Sequence[str], rows: Iterable[Sequence], right: bool | Iterable[int] = False) -> str:
    """Rows as aligned plain-text columns under `header`: left-aligned, or right-aligned where
    `right` says (True for every column, or the indices of the columns that hold numbers)."""
    table = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    to_right = set(range(len(header))) if right is True else set() if right is False else set(right)
    return "\n".join("  ".join(c.rjust(w) if i in to_right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths)))
                     for row in table)


def wrapped(text: str, width: int = 100) -> str:
    """`text` with every line longer than `width` broken between words, each continuation indented
    two spaces more than its line: a notebook's output area would break it anywhere, mid-word too."""
    import textwrap

    out = []
    for line in text.splitlines():
        indent = line[:len(line) - len(line.lstrip())]
        out += textwrap.wrap(line, width, subsequent_indent=indent + "  ", break_long_words=False,
                             break_on_hyphens=False) if len(line) > width else [line]
    return "\n".join(out)


# --- HTML -----------------------------------------------------------------------------------

# Widget panels lack the notebook's table style: the compact look brings its own.
_COMPACT_TABLE = ' style="border-collapse:collapse;font-size:12px;font-family:sans-serif"'
_COMPACT_HEADER = ' style="text-align:left;padding:0 8px"'
_COMPACT_CELL = ' style="padding:0 8px"'
_COMPACT_CAPTION = "text-align:left;font-weight:bold"


def html_table(header: Sequence[str], rows: Iterable[Sequence], caption: str | Sequence[str] = "",
               row_styles: Sequence[str] | None = None, compact: bool = False) -> str:
    """An HTML table under `header`, with a caption of one line or several (each on its own line).

    `row_styles` gives each row's CSS (e.g. 'color:#c00000'; '' for none); `compact` is the
    widget panels' look: small sans-serif text, padded cells, a bold caption.
    """
    lines = [caption] if isinstance(caption, str) else list(caption)
    header_style, cell_style = (_COMPACT_HEADER, _COMPACT_CELL) if compact else ("", "")
    head = "".join(f"<th{header_style}>{html.escape(str(h))}</th>" for h in header)
    body = []
    for index, row in enumerate(rows):
        style = row_styles[index] if row_styles else ""
        cells = "".join(f"<td{cell_style}>{html.escape(str(c))}</td>" for c in row)
        body.append(f'<tr style="{style}">{cells}</tr>' if style else f"<tr>{cells}</tr>")
    caption_html = ""
    if any(lines):
        caption_style = _COMPACT_CAPTION if compact else "text-align: left"
        caption_html = (f'<caption style="{caption_style}">'
                        f'{"<br>".join(html.escape(line) for line in lines)}</caption>')
    return (f"<table{_COMPACT_TABLE if compact else ''}>{caption_html}"
            f"<tr>{head}</tr>{''.join(body)}</table>")


# --- bytes ----------------------------------------------------------------------------------

_BYTE_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))


def byte_unit(nbytes: float) -> tuple[int, str]:
    """The largest binary unit that `nbytes` fills at least once, e.g. (1 << 20, "MiB")."""
    return next(((size, name) for size, name in _BYTE_UNITS if nbytes >= size), (1, "B"))


def format_bytes(nbytes: float) -> str:
    """Bytes as a person reads them: "512 B", "16.0 KiB", "6.0 MiB"."""
    size, name = byte_unit(nbytes)
    return f"{nbytes:.0f} B" if size == 1 else f"{nbytes / size:.1f} {name}"
