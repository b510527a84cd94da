"""Where a rank is: op descriptions for error messages, and the progress record.

A rank of an MPI run (:class:`partir_emu.mpi.ranks.guard.RankGuard`) keeps a
fixed-size JSON record ``rank-NNNNN.json`` up to date in the run's progress
directory: ``rank``, ``pid``, ``host``, ``job``, ``phase`` (startup, inputs,
barrier, step, gather, ..., ``done`` or ``failed``), ``devices``, ``shm`` (its
MPICH segments), ``t`` (wall time) and, inside the step, ``op``/``prim``/
``source``/``state`` of the collective it is in (inside a loop body also ``loops``, the
``[equation index, iteration]`` of each enclosing loop, outermost first; and ``seq``, the
collective's number in the run, which orders positions across iterations), plus ``error`` once it failed
and ``stopped_by`` (``SIGTERM`` …) once a stop signal ended it.
The launcher's supervisor (:mod:`partir_emu.mpi.procs.supervise`), or under a
user's mpirun the host's :mod:`partir_emu.mpi.procs.sentinel`, reads these
records to say which rank died first, in which op. Neither side imports mpi4py
for this.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partir_emu.core.ir import Eqn

PROGRESS_BYTES = 4096      # each write overwrites the whole record: a reader never sees half of two


def short_source(source: str) -> str:
    """``'... at /x/y/transformer.py:164:12 (fn)'`` → ``'transformer.py:164'``."""
    m = re.findall(r"([^\s/]+\.py):(\d+)", source or "")
    return f"{m[-1][0]}:{m[-1][1]}" if m else (source or "?")


def describe_op(index: int | None, eqn: Eqn | None, loops: Sequence[Sequence[int]] = ()) -> str:
    """``'op 12 (all_reduce at mlp.py:103)'`` for error messages; inside a loop body
    ``'op 2 of the loop body at op 5, iteration 3 (all_reduce at mlp.py:103)'``."""
    if index is None or eqn is None:
        return "op -"
    return f"{op_position(index, loops)} ({eqn.prim} at {short_source(eqn.source)})"


def op_position(index: int, loops: Sequence[Sequence[int]] = ()) -> str:
    """``'op 12'``, or inside loop bodies (``loops``: ``(eqn index, iteration)`` outermost first)
    ``'op 2 of the loop body at op 7, iteration 1, of the loop body at op 5, iteration 3'``."""
    return ", ".join([f"op {index}"] + [f"of the loop body at op {int(i)}, iteration {int(it)}"
                                        for i, it in reversed(loops)]).replace(", of", " of", 1)


def device_str(devices: Sequence[int]) -> str:
    """``'device 3'``, ``'devices 4-7'`` or ``'devices 1,5'``."""
    devices = list(devices)
    if len(devices) == 1:
        return f"device {devices[0]}"
    if devices == list(range(devices[0], devices[0] + len(devices))):
        return f"devices {devices[0]}-{devices[-1]}"
    return "devices " + ",".join(map(str, devices))


@dataclass
class OpContext:
    """What a rank is doing, for error messages and progress reports."""

    index: int | None = None
    eqn: Eqn | None = None
    devices: tuple[int, ...] = ()
    seq: int = -1
    state: str = ""     # 'waiting for the other ranks' | 'moving data' | 'computing' (after the op)
    loops: tuple[tuple[int, int], ...] = ()     # enclosing loops: (eqn index, iteration), outermost first

    def describe(self) -> str:
        op = describe_op(self.index, self.eqn, self.loops)
        return f"{device_str(self.devices)} {op}" if self.devices else op


@dataclass(frozen=True)
class EngineSpot:
    """Where :func:`engine.run_spmd` was when an exception left it (Nones: not in an equation)."""

    index: int | None = None
    eqn: Eqn | None = None
    device: int | None = None
    loops: tuple[tuple[int, int], ...] = ()   # enclosing loops: (eqn index, iteration), outermost first

    def describe(self) -> str:
        return describe_op(self.index, self.eqn, self.loops)


_SPOT = "partir_engine_spot"      # the attribute an exception leaving the engine carries


def mark_spot(exc: BaseException, spot: EngineSpot) -> None:
    """Attach where the engine was (:class:`partir_emu.runtime.engine.Position`) to ``exc``, once:
    the innermost run that saw it knows best."""
    if getattr(exc, _SPOT, None) is None:
        setattr(exc, _SPOT, spot)


def engine_spot(exc: BaseException) -> EngineSpot:
    """Where :func:`partir_emu.runtime.engine.run_spmd` was when ``exc`` left it (all None: it did not
    come from the engine)."""
    spot = getattr(exc, _SPOT, None)
    return spot if isinstance(spot, EngineSpot) else EngineSpot()


def progress_path(progress_dir: str | os.PathLike, rank: int) -> Path:
    return Path(progress_dir) / f"rank-{rank:05d}.json"


def encode_record(rec: dict[str, Any]) -> bytes:
    """The record as the fixed-size block a rank writes at offset 0 of its file."""
    return json.dumps(rec).encode()[:PROGRESS_BYTES].ljust(PROGRESS_BYTES)


def read_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """A rank's last record, or None if it has written none (or it is unreadable)."""
    try:
        text = Path(path).read_bytes().rstrip(b" \0\n")
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def read_records(progress_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every rank's last record, by rank file name."""
    return [r for f in sorted(Path(progress_dir).glob("rank-*.json")) if (r := read_record(f)) is not None]
