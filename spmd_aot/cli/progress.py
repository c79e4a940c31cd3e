"""A tiny, dependency-free progress bar for the CLI, written to stderr.

On a terminal it redraws one line in place, refreshed a few times a second so the elapsed time
keeps moving during a long trace::

    [#########-----------] 2/4 world=2 mesh=2 replicate cpu  3.1s

Anywhere else (a pipe, a CI log, a file) redrawing would leave a mess of carriage returns, so
it prints one plain line per finished item instead::

    [2/4] world=2 mesh=2 replicate cpu: built in 1.2s (3.1s elapsed)
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import TextIO
from collections.abc import Callable

__all__ = ["Progress"]


class Progress:
    """Progress over ``total`` items: call ``start(label)`` then ``finish(status)`` per item.

    Use as a context manager (or call ``close()``) so a terminal line is ended properly, also
    when an item fails.
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, tty: bool | None = None,
                 width: int = 20, refresh: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self.width = width
        self.refresh = refresh
        self.clock = clock
        self.done = 0
        self.label = ""
        self._t0 = clock()
        self._item_t0 = self._t0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def elapsed(self) -> float:
        return self.clock() - self._t0

    def start(self, label: str) -> None:
        """Begin the next item, shown as ``label``."""
        with self._lock:
            self.label = label
            self._item_t0 = self.clock()
            if self.tty:
                self._draw()
        if self.tty and self._ticker is None and self.refresh > 0:
            self._ticker = threading.Thread(target=self._tick, name="spmd-aot-progress", daemon=True)
            self._ticker.start()

    def finish(self, status: str = "done") -> None:
        """End the current item with a short ``status`` (e.g. ``built``, ``cached``)."""
        with self._lock:
            self.done += 1
            if self.tty:
                self._draw()
            else:
                item = self.clock() - self._item_t0
                self._write(f"[{self.done}/{self.total}] {self.label}: {status} in {item:.1f}s "
                            f"({self.elapsed:.1f}s elapsed)\n")

    def close(self) -> None:
        """Stop refreshing and end the terminal line (idempotent)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        with self._lock:
            if self.tty and self._drawn:
                if self.done == self.total:
                    self.label = "done"
                    self._draw()
                self._write("\n")
                self._drawn = False

    # ------------------------------------------------------------------ internals

    def _tick(self) -> None:
        while not self._stop.wait(self.refresh):
            with self._lock:
                self._draw()

    def _draw(self) -> None:
        filled = self.width * self.done // self.total if self.total else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {self.done}/{self.total} {self.label}  {self.elapsed:.1f}s"
        columns = shutil.get_terminal_size(fallback=(80, 24)).columns
        self._write("\r" + line[: max(columns - 1, 10)] + "\x1b[K")
        self._drawn = True

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stderr must not fail the build


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
