"""Atomic file writes: a reader (or a second writer) sees the old file or the whole new one.

Every file ``partir-emu`` writes for the user — JSON reports, PNG plots, Perfetto traces,
saved programs, the validate cache — goes through :func:`atomic_path`: the writer fills a
temp file in the target's own directory (same file system, so the rename is atomic) and
``os.replace`` puts it in place only when the writer returned. Two concurrent writers then
leave one of the two complete files, never an interleaving, and a crash leaves the old file.
A symlink is followed (its target is replaced, the link stays); a target that exists and is not a
regular file (a device, a FIFO) is refused, since the rename would replace the node itself
(:mod:`partir_emu.app.outputs` refuses those, and outputs that are inputs, before any work).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from partir_emu.app.outputs import check_output_target


def _umask() -> int:
    mask = os.umask(0o022)      # why set-and-restore: the only portable way to read the umask
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temp path next to ``path`` (same suffix, so writers that pick a format from it still
    work); on a normal exit it replaces ``path`` (a symlink's target), on an exception it is removed."""
    check_output_target(str(path), "output")
    target = Path(os.path.realpath(path))
    fd, tmp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".",
                               prefix=f".{target.name}.", suffix=f".tmp{target.suffix}")
    os.close(fd)
    try:
        yield tmp
        # mkstemp makes the file 0600; a report should get the mode a plain open() would give it
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float as the string JSON parsers cannot choke on (``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``): Python would write the bare tokens, which are not JSON. Said,
    not dropped: a reader sees which value it was."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ("NaN" if obj != obj else "Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as sorted, indented JSON (with a final newline) to ``path`` atomically; strict
    JSON: non-finite numbers as strings (:func:`finite_json`)."""
    write_text_atomic(path, json.dumps(finite_json(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")


__all__ = ["atomic_path", "finite_json", "write_json_atomic", "write_text_atomic"]
