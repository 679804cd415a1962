"""The lab's status table: one row per rank, readable as text and as HTML in a notebook."""

from __future__ import annotations

import html
from dataclasses import astuple, dataclass, fields


@dataclass(frozen=True)
class RankInfo:
    """One rank: which engine and process it is, where it runs and what it runs on."""

    rank: int
    engine_id: int
    host: str
    pid: int
    local_rank: int
    device: str
    backend: str
    state: str  # "idle", "busy" or "dead"


class RankTable(tuple):
    """Rows of RankInfo ordered by rank; prints as a table (text or HTML)."""

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        headers = [field.name for field in fields(RankInfo)]
        return headers, [[str(value) for value in astuple(row)] for row in self]

    def __str__(self) -> str:
        headers, rows = self._cells()
        widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths))
                 for line in [headers, *rows]]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        headers, rows = self._cells()
        head = "".join(f"<th>{html.escape(cell)}</th>" for cell in headers)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
                       for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
