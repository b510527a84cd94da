"""A one-line progress bar on stderr (only on a terminal, or when asked for)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``Progress(total, label)``; ``update(done, note)``; ``close()``. Redraws at most every ``every_s``."""

    def __init__(self, total: int, label: str = "", enabled: bool | None = None, stream: TextIO | None = None,
                 every_s: float = 0.2, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.enabled = (self.stream.isatty() if enabled is None else enabled) and total > 0
        self.total = total
        self.label = label
        self.every_s = every_s
        self.width = width
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._shown = False

    def update(self, done: int, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        frac = min(1.0, done / self.total)
        fill = int(frac * self.width)
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:5.1f}% "
                          f"{done}/{self.total} {note} {now - self.t0:6.1f}s ")
        self.stream.flush()
        self._shown = True

    def close(self, done: int | None = None, note: str = "") -> None:
        if self.enabled:
            self.update(self.total if done is None else done, note, force=True)
            if self._shown:
                self.stream.write("\n")
                self.stream.flush()
