"""Figures for the commands that draw (``fidelity --plot``, ``study --plot``): matplotlib's
object-oriented ``Figure`` (no pyplot, no global state, no display needed), imported only when a
plot is asked for."""
from __future__ import annotations

from typing import Any

from partir_emu.errors import UsageError


def new_figure(figsize: tuple[float, float], flag: str = "--plot") -> Any:
    """A matplotlib ``Figure``; a clear error naming ``flag`` when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure  # why: a heavy optional import, needed only to draw
    except ImportError:
        raise UsageError(f"{flag} needs matplotlib: pip install matplotlib (or drop {flag})") from None
    return Figure(figsize=figsize)


__all__ = ["new_figure"]
