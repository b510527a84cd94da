"""Progress of a long run on stderr: a one-line bar on a terminal, plain lines elsewhere.

``enabled=True`` shows it from the start; ``False`` never; ``None`` (auto) once the run has lasted
``delay_s`` (5 s): short runs stay silent, a long one (a 4096-chip step) says how far it is, on a
terminal as a bar redrawn in place, in a log (stderr not a terminal) as one line every ``line_every_s``.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

AUTO_DELAY_S = 5.0          # auto mode: silent until the run has lasted this long
LINE_EVERY_S = 5.0          # not a terminal: one line this often


class Progress:
    """``Progress(total, label)``; ``update(done, note)``; ``close()``. Redraws at most every ``every_s``."""

    def __init__(self, total: float, label: str = "", enabled: bool | None = None, stream: TextIO | None = None,
                 every_s: float = 0.2, width: int = 30, delay_s: float | None = None,
                 line_every_s: float | None = None, t0: float | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled is not False and total > 0
        self.delay_s = 0.0 if enabled else (AUTO_DELAY_S if delay_s is None else delay_s)
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = total
        self.label = label
        self.every_s = every_s if self.tty else (LINE_EVERY_S if line_every_s is None else line_every_s)
        self.width = width
        self.t0 = time.perf_counter() if t0 is None else t0
        self._last = -float("inf")
        self._shown = False

    @property
    def due(self) -> bool:
        """Whether an :meth:`update` now would draw (callers skip computing the note otherwise)."""
        if not self.enabled:
            return False
        now = time.perf_counter()
        return now - self.t0 >= self.delay_s and now - self._last >= self.every_s

    def update(self, done: float, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < self.delay_s or (not force and now - self._last < self.every_s):
            return
        self._last = now
        frac = min(1.0, done / self.total)
        fill = int(frac * self.width)
        shown = f"{done:g}" if float(done).is_integer() else f"{done:.2f}"
        text = (f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:5.1f}% {shown}/{self.total:g} "
                f"{note} {now - self.t0:6.1f}s")
        self.stream.write(f"\r{text} " if self.tty else text + "\n")
        self.stream.flush()
        self._shown = True

    def close(self, done: float | None = None, note: str = "") -> None:
        """The final state (in auto mode only if the run lasted past the delay)."""
        if self.enabled:
            self.update(self.total if done is None else done, note, force=True)
            if self._shown and self.tty:
                self.stream.write("\n")
                self.stream.flush()
