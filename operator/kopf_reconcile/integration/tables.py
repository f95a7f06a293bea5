"""Plain-text tables for terminals and logs (the CLI's listings, the demo's views), and the
escaping and time format of what the CLI prints."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

__all__ = ["escape_terminal", "format_table", "format_when", "terminal_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Left-aligned columns, two spaces apart; one string per line, header first."""
    cells = [[str(cell) for cell in row] for row in (header, *rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    ]


def terminal_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """:func:`format_table` of cells that may come from anyone (a Lease's holder, an
    error's text): each escaped for a terminal first (:func:`escape_terminal`)."""
    return format_table(header, [tuple(map(escape_terminal, row)) for row in rows])


def format_when(moment: Any) -> str:
    """A timestamp as the CLI shows them all (``-`` when there is none)."""
    if not isinstance(moment, datetime.datetime):
        return "-"
    from kopf_reconcile.leader.kubernetes import format_micro_time  # one time format for all

    return format_micro_time(moment)


def escape_terminal(text: str) -> str:
    """``text`` safe to print on a terminal: no escape sequence or control character survives.

    ESC becomes ``^[`` and CR ``\\r``, as kubectl's printers write them; every other
    character that is not printable (other controls, bidirectional overrides, ...) is
    written as its Python escape (``\\x07``, ``\\u202e``).
    """
    if text.isprintable():
        return text
    out: list[str] = []
    for char in text:
        if char == "\x1b":
            out.append("^[")
        elif char == "\r":
            out.append("\\r")
        elif char.isprintable():
            out.append(char)
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    return "".join(out)
