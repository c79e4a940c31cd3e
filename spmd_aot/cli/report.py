"""What commands print: exit statuses, aligned tables, escaped stored strings, errors on stderr."""

from __future__ import annotations

import sys



EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR, EXIT_BUG = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_PIPE = 130, 141  # 128 + SIGINT, 128 + SIGPIPE: what a shell reports


class Failed(Exception):
    """A subcommand failed after reporting why; carries the exit status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def say(*parts) -> None:
    """``print`` for lines made of stored data: escaped (``safe``)."""
    print(safe(" ".join(str(p) for p in parts)))


def safe(text, keep: str = "") -> str:
    """``text`` fit for a terminal: control and format characters (escape sequences, bidi
    overrides, ...) other than those in ``keep`` are shown escaped (``\\x1b``), never sent raw.
    Stored strings come from whoever wrote the cache."""
    import unicodedata

    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c in keep or c.isprintable() or unicodedata.category(c) == "Zs"
                   else c.encode("unicode_escape").decode("ascii") for c in text)


def human_bytes(n) -> str:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


def print_table(headers: list[str], rows: list[list], right: set[int] = frozenset()) -> None:
    """Print aligned columns; a row shorter than the header has its last cell unpadded. Cells
    are escaped (``safe``): many hold stored strings."""
    rows = [[safe(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        cells = r if len(r) == len(headers) else r[:-1]
        for i, c in enumerate(cells):
            widths[i] = max(widths[i], len(c))

    def fmt(r):
        out = []
        for i, c in enumerate(r):
            last = i == len(r) - 1
            if last and len(r) < len(headers):
                out.append(c)
            elif i in right:
                out.append(c.rjust(widths[i]))
            else:
                out.append(c if i == len(headers) - 1 else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    print(fmt(headers))
    for r in rows:
        print(fmt(r))


def error(message: str) -> None:
    print(f"error: {safe(message, keep=chr(10))}", file=sys.stderr)  # messages quote stored strings
