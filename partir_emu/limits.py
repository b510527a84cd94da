"""Bounded reading of user files: JSON whose size, nesting and numbers are checked while it is parsed.

Every reader of a file a user hands us (a message trace, a cases file, a saved program, the
program cache, a job or stats file) parses JSON through :func:`loads`, which refuses, with the
caller's error class and a message naming the file (and line):

- text over ``max_bytes`` (default 256 MiB: larger than any program we write);
- nesting deeper than Python's recursion limit (a ``[[[[…`` bomb: the parser's RecursionError);
- integers of more than :data:`MAX_INT_DIGITS` digits or outside ``[-2**63, 2**63)`` (they would
  overflow an ``int64`` array: ``2**70`` bytes in a trace) — checked on the digits, before
  ``int()`` runs (a 5,000-digit literal costs quadratic time and, past 4,300 digits, a ValueError);
- ``NaN``, ``Infinity``, ``-Infinity`` (not JSON; Python's parser takes them by default) and
  numbers that overflow a float (``1e400``).

Only the standard library: MPI ranks and the hardware models read files too.
"""
from __future__ import annotations

import json
import math
from typing import Any

from partir_emu.errors import PartirError

MAX_INT_DIGITS = 19
MAX_BYTES = 256 << 20
INT_RANGE = (-(1 << 63), 1 << 63)


def loads(text: str | bytes, where: str, error: type[PartirError], what: str = "JSON",
          max_bytes: int = MAX_BYTES, finite: bool = True) -> Any:
    """``json.loads(text)`` within the limits of the module docstring; ``error(message)`` naming
    ``where`` (a file, with its line) and ``what`` was expected when the text breaks one or is
    not JSON. ``finite=False`` lets ``NaN``/``Infinity`` through (a saved program's literals: the
    writer's ``json.dumps`` emits them for ``-inf`` initial values)."""
    if len(text) > max_bytes:
        raise error(f"{where}: {len(text):,} bytes, more than the {max_bytes:,} a {what} may have")

    def parse_int(s: str) -> int:
        digits = len(s) - (s[0] == "-")
        if digits > MAX_INT_DIGITS:
            raise error(f"{where}: an integer of {digits} digits ({s[:12]}...); a {what} holds integers "
                        f"below 2**63")
        v = int(s)
        if not INT_RANGE[0] <= v < INT_RANGE[1]:
            raise error(f"{where}: the integer {v} is outside [-2**63, 2**63); not a {what}")
        return v

    def parse_float(s: str) -> float:
        v = float(s)
        if not math.isfinite(v):
            raise error(f"{where}: the number {s[:30]} overflows a float; a {what} holds finite numbers")
        return v

    def parse_constant(s: str) -> float:
        raise error(f"{where}: {s} is not a JSON number; a {what} holds finite numbers")

    try:
        if not finite:
            return json.loads(text, parse_int=parse_int)
        return json.loads(text, parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{where}: not JSON ({exc}); expected {what}") from None
    except RecursionError:
        raise error(f"{where}: nested too deeply; not a {what}") from None
