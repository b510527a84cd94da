"""Progress of a long command on stderr: which phase it is in, once it has taken a while.

A run that ends within :data:`DELAY_S` prints nothing. After that, :class:`Phases` prints one
line when it first shows itself and one per phase change (``partir-emu run: step and verify …
(7.1 s)``). It stays silent when stderr is not a terminal (logs and pipes stay clean) or the
user gave ``--quiet``. Code deep in a command can report a phase without holding the object:
:func:`announce` goes to the active one, if any.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

DELAY_S = 5.0
_active: list[Phases] = []


class Phases:
    """``with Phases("run", quiet=args.quiet) as ph: ph.phase("lowering"); ...``"""

    def __init__(self, cmd: str, *, quiet: bool = False, delay_s: float = DELAY_S,
                 stream: TextIO | None = None, force: bool = False) -> None:
        self.cmd = cmd
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = force or (not quiet and _isatty(self.stream))
        self.delay_s = delay_s
        self.t0 = time.perf_counter()
        self.current = ""
        self._shown = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._timer: threading.Thread | None = None

    def __enter__(self) -> Phases:
        _active.append(self)
        if self.enabled:
            # why a thread: the phase that crosses the delay is a long call we cannot interrupt to print
            self._timer = threading.Thread(target=self._wait, name="partir-emu-progress", daemon=True)
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._timer is not None:
            self._timer.join()
        if self in _active:
            _active.remove(self)

    def phase(self, name: str) -> None:
        """Enter phase ``name`` (printed at once if progress is already showing)."""
        with self._lock:
            self.current = name
            if self._shown:
                self._print()

    def _wait(self) -> None:
        if self._done.wait(self.delay_s):
            return
        with self._lock:
            self._shown = True
            if self.current:
                self._print()

    def _print(self) -> None:
        print(f"partir-emu {self.cmd}: {self.current} … ({time.perf_counter() - self.t0:.1f} s)",
              file=self.stream, flush=True)


def announce(name: str) -> None:
    """Report phase ``name`` to the innermost active :class:`Phases` (nothing if there is none)."""
    if _active:
        _active[-1].phase(name)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


__all__ = ["DELAY_S", "Phases", "announce"]
