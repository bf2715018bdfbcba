"""Text tables of at most ``WIDTH`` columns, as ``tritonspec check`` prints them, and their reader.

A cell wider than its column continues on the next lines, in its column; ``parse_tables`` reads a
table back (for tests and scripts).
"""

from __future__ import annotations

import re
import textwrap

WIDTH = 100  # every line check prints fits in this many columns
_GAP = "  "  # between columns (a cell never holds two spaces in a row)


def _widths(rows, header, width, keep=()) -> list[int]:
    """Column widths: each column's longest cell, then the widest column narrowed one at a time until the
    table fits in ``width``: never below its header, and the columns in ``keep`` (names a reader scans
    for) only when narrowing the others is not enough."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    floors = [max(len(h), 6) for h in header]
    budget = width - len(_GAP) * (len(header) - 1)
    while sum(widths) > budget:
        wide = (
            [i for i, w in enumerate(widths) if w > floors[i] and i not in keep]
            or [i for i, w in enumerate(widths) if w > floors[i]]
            or [i for i, w in enumerate(widths) if w > 1]
        )
        if not wide:
            break
        widths[max(wide, key=lambda i: (widths[i], i))] -= 1
    return widths


class _Wrapper(textwrap.TextWrapper):
    """textwrap's, but a name too long for its column breaks after a ``.``, ``_`` or ``/`` where it can."""

    def _handle_long_word(self, reversed_chunks, cur_line, cur_len, width):
        space = max(width - cur_len, 1)
        chunk = reversed_chunks[-1]
        cut = max(chunk.rfind(c, 0, space) for c in "._/") + 1
        if cut > 0 and len(chunk) > space:
            cur_line.append(chunk[:cut])
            reversed_chunks[-1] = chunk[cut:]
        else:
            super()._handle_long_word(reversed_chunks, cur_line, cur_len, width)


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``: broken at spaces, inside a word only when the word alone is wider."""
    return _Wrapper(width, break_on_hyphens=False).wrap(text) or [""]


def table(rows, header, width: int = WIDTH, keep=(0,)) -> str:
    """A table: header, dashes, one row per entry; a cell wider than its column continues on the next
    lines, in its column (the other columns blank there). ``parse_tables`` reads it back."""
    widths = _widths(rows, header, width, keep)
    out = []
    for r in [header, ["-" * w for w in widths]] + rows:
        cells = [wrap(str(c), w) for c, w in zip(r, widths)]
        for k in range(max(len(c) for c in cells)):
            out.append(_GAP.join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(out)


def section(title: str, rows, header, keep=(0,)) -> None:
    """Print ``title`` and its table after a blank line."""
    print(f"\n{title}\n{table(rows, header, keep=keep)}")


def parse_tables(text: str) -> dict[str, list[list[str]]]:
    """The tables of check's output read back: title -> rows of cells, a continuation line joined to its
    row (with a space, none after a line ending in ``_``, ``/`` or ``.``: a name broken there). For tests
    and scripts; the columns are found from the dashes under the header."""
    tables = {}
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if len(lines) < 3 or not re.fullmatch(r"-+(  -+)*", lines[2]):
            continue
        starts = [m.start() for m in re.finditer(r"-+", lines[2])]
        rows = []
        for line in lines[3:]:
            cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
            if rows and not cells[0]:
                rows[-1] = [
                    old + ("" if old.endswith(("_", "/", ".")) else " ") + new if new else old
                    for old, new in zip(rows[-1], cells)
                ]
            else:
                rows.append(cells)
        tables[lines[0]] = rows
    return tables
