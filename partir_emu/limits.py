"""Bounded reading of user files: JSON and TOML whose size, nesting and numbers are checked.

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

Every TOML file (hardware specs, the fidelity data) is read by :func:`load_toml`, with the same
limits (``TOML_MAX_BYTES``, 4 MiB, is ~100x the largest file we ship): size checked on the open file
before it is read, nesting, and integers outside the int64 range (Python's own 4,300-digit limit
is a ValueError inside the parser).

Only the standard library (and ``tomli`` on Python 3.10): MPI ranks and the hardware models read
files too.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10: the same parser, from PyPI
    import tomli as tomllib  # type: ignore[no-redef, unused-ignore]  # why: redef only where tomllib exists

from partir_emu.errors import PartirError

MAX_INT_DIGITS = 19
MAX_BYTES = 256 << 20
TOML_MAX_BYTES = 4 << 20
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


def load_toml(path: str | os.PathLike, error: type[PartirError], what: str = "TOML file",
              max_bytes: int = TOML_MAX_BYTES) -> dict[str, Any]:
    """The parsed TOML file ``path`` within the limits of the module docstring; ``error(message)``
    naming ``path`` and ``what`` it should be when it cannot be read, breaks a limit or is not TOML."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise error(f"{path}: {max(size, len(data)):,} bytes, more than the {max_bytes:,} a {what} may have")
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:     # TOML is UTF-8: a binary or Latin-1 file fails here
        raise error(f"{path}: not a TOML file (byte {exc.start} is not UTF-8 text); expected a {what}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path}: not valid TOML ({exc})") from None
    except RecursionError:
        raise error(f"{path}: nested too deeply; not a {what}") from None
    except ValueError as exc:             # an integer of more than 4,300 digits
        raise error(f"{path}: {str(exc).split(';')[0]}; a {what} holds integers below 2**63") from None
    _check_ints(doc, path, error, what)
    return doc


def _check_ints(value: Any, path: str | os.PathLike, error: type[PartirError], what: str, key: str = "") -> None:
    """Every integer of a parsed TOML document lies in the int64 range (the parser is not nested
    deeper than the recursion limit, so neither is this walk)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_ints(v, path, error, what, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_ints(v, path, error, what, f"{key}[{i}]")
    elif isinstance(value, int) and not isinstance(value, bool) and not INT_RANGE[0] <= value < INT_RANGE[1]:
        raise error(f"{path}: field {key} = {str(value)[:24]}{'…' if len(str(value)) > 24 else ''} is outside "
                    f"[-2**63, 2**63); a {what} holds integers below 2**63")
