"""The MPI message-trace file: one format, its writer and its reader.

The MPI emulator (``partir-emu run --backend mpi --trace-messages FILE``) records
every point-to-point transfer its schedule executor made; the DES replays the
file and checks it against the schedules (:mod:`partir_emu.hwmodels.validation.replay`).
The file is JSON Lines. Line 1 is the header::

    {"format": "partir-emu-message-trace", "version": 2,
     "mesh": [["batch", 4], ...], "devices": N, "ranks": R, "devices_per_rank": k,
     "devices_per_node": null | int, "algorithm": "ring",
     "collectives": {"<coll>": {"prim": "all_reduce", "axes": ["batch"],
                                "bytes": full-buffer bytes, "itemsize": element bytes}}}
                                (a collective_permute adds "pairs": [[src, dst], ...], group positions)

then one line per transfer, sorted by ``(coll, step, src, dst)``::

    {"coll": 12, "step": 0, "src": 3, "dst": 4, "bytes": 256}

``coll`` is the equation index of the collective in the SPMD program (in the program as
:func:`partir_emu.core.loops.unroll` expands it if it has loops: each iteration's run of a body
collective is its own ``coll``, in execution order; without loops, its own index), ``step``
the schedule step (transfers of one ``(coll, step)`` run concurrently),
``src``/``dst`` global device ids, ``bytes`` the payload. Transfers between
devices of one rank (memory copies) are included; a hardware model tells them
apart with ``src // devices_per_rank == dst // devices_per_rank``. Native
collectives (``--algorithm native``) move data inside MPI and leave no lines.

``itemsize`` (the element size of the collective's operand) is recorded because
a schedule splits a buffer into whole elements: without it a reader would have to
guess. Version 1 traces lacked it; they are refused with a request to re-record.
The reader raises :class:`~partir_emu.errors.ArtifactError` naming the file and
the line of anything malformed.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from partir_emu.core.ir import itemsize
from partir_emu.core.loops import unroll
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import COMM_PRIMS, SpmdProgram, collective_bytes, permute_pairs
from partir_emu.errors import ArtifactError, PartirError
from partir_emu.limits import loads

FORMAT = "partir-emu-message-trace"
VERSION = 2
COLUMNS = ("coll", "step", "src", "dst", "bytes")
_RECORD = "`partir-emu run … --backend mpi --trace-messages FILE`"


def _pairs(e, mesh: Mesh) -> dict[str, Any]:
    """A collective_permute's pairs (group positions) for its header entry; nothing for the others."""
    if e.prim != "collective_permute":
        return {}
    return {"pairs": [list(x) for x in permute_pairs(e.params, mesh.group_size(e.params["axes"]))]}


def trace_header(spmd: SpmdProgram, *, ranks: int, devices_per_rank: int, algorithm: str,
                 devices_per_node: int | None = None) -> dict[str, Any]:
    """The header of a trace of ``spmd`` run on ``ranks`` × ``devices_per_rank`` devices."""
    colls = {str(i): {"prim": e.prim, "axes": list(e.params["axes"]), "bytes": collective_bytes(e),
                      "itemsize": itemsize(e.inputs[0].dtype), **_pairs(e, spmd.mesh)}
             for i, e in enumerate(unroll(spmd.program).eqns) if e.prim in COMM_PRIMS}
    return {"format": FORMAT, "version": VERSION, "mesh": spmd.mesh.to_json(), "devices": spmd.mesh.size,
            "ranks": ranks, "devices_per_rank": devices_per_rank, "devices_per_node": devices_per_node,
            "algorithm": algorithm, "collectives": colls}


def write_message_trace(path: str | os.PathLike, head: Mapping[str, Any], rows: np.ndarray) -> None:
    """Write ``head`` (checked as the reader would) and ``rows`` (int ``[coll, step, src, dst, bytes]``)."""
    check_header(dict(head), f"{path}: line 1")
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, len(COLUMNS))
    with open(path, "w") as f:
        f.write(json.dumps(dict(head), separators=(",", ":")) + "\n")
        f.writelines(f'{{"coll":{c},"step":{s},"src":{a},"dst":{b},"bytes":{n}}}\n' for c, s, a, b, n in rows.tolist())


def read_message_trace(path: str | os.PathLike) -> tuple[dict[str, Any], np.ndarray]:
    """``(header, rows)`` of a trace file; rows are int64 ``[coll, step, src, dst, bytes]``."""
    try:
        with open(path, encoding="utf-8") as f:
            head = check_header(_json_line(f.readline(), f"{path}: line 1", "the message-trace header"),
                                f"{path}: line 1")
            rows = [_row(line, f"{path}: line {i}") for i, line in enumerate(f, start=2) if line.strip()]
    except OSError as exc:
        raise ArtifactError(f"cannot read message trace {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:       # a binary file: JSON lines are UTF-8 text
        raise ArtifactError(f"{path}: not a message trace (byte {exc.start} is not UTF-8 text); "
                            f"{_RECORD} writes one") from None
    arr = np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))
    _check_rows(arr, Mesh.from_json(head["mesh"]).size, str(path))
    return head, arr


def _check_rows(rows: np.ndarray, devices: int, where: str) -> None:
    """Every field >= 0 and every device id < ``devices`` (ArtifactError naming the first bad line)."""
    ids = rows[:, [COLUMNS.index("src"), COLUMNS.index("dst")]]
    bad = np.flatnonzero((rows < 0).any(axis=1) | (ids >= devices).any(axis=1))
    if bad.size:
        c, s, a, b, n = rows[bad[0]].tolist()
        raise ArtifactError(f"{where}: line {int(bad[0]) + 2}: transfer coll={c} step={s} src={a} dst={b} bytes={n} "
                            f"has a negative field or a device outside 0..{devices - 1}")


def check_header(head: Any, where: str) -> dict[str, Any]:
    """``head`` if it is a version-``VERSION`` header; else ArtifactError naming ``where``."""
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ArtifactError(f"{where}: not a partir-emu message trace (no \"format\": \"{FORMAT}\"); {_RECORD} writes one")
    if head.get("version") != VERSION:
        raise ArtifactError(f"{where}: message-trace version {head.get('version')!r}, this reader needs "
                            f"{VERSION} (version 1 lacks the element sizes); re-record it with {_RECORD}")
    for key in ("mesh", "algorithm", "collectives"):
        if key not in head:
            raise ArtifactError(f"{where}: the header has no {key!r}")
    try:
        mesh = Mesh.from_json(head["mesh"])
    except (TypeError, ValueError, PartirError) as exc:    # MeshError on bad sizes
        raise ArtifactError(f"{where}: the header's mesh {head['mesh']!r} is not [[axis, size], ...] ({exc})") from None
    if not isinstance(head["algorithm"], str) or not isinstance(head["collectives"], dict):
        raise ArtifactError(f"{where}: the header's algorithm must be a string and collectives an object")
    _check_layout(head, mesh.size, where)
    for key, c in head["collectives"].items():
        _check_collective(key, c, where)
    return head


def _check_layout(head: dict[str, Any], devices: int, where: str) -> None:
    """``devices``, ``ranks``, ``devices_per_rank``, ``devices_per_node``: where present, consistent."""
    for key in ("devices", "ranks", "devices_per_rank", "devices_per_node"):
        v = head.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            raise ArtifactError(f"{where}: the header's {key!r} must be a positive integer, got {v!r}")
    if head.get("devices") is not None and head["devices"] != devices:
        raise ArtifactError(f"{where}: the header says {head['devices']} devices but its mesh has {devices}")
    k = head.get("devices_per_rank")
    if k is not None and devices % k:
        raise ArtifactError(f"{where}: the header's devices_per_rank {k} does not divide its {devices} devices")



def _check_collective(key: str, c: Any, where: str) -> None:
    what = f"{where}: collective {key!r}"
    if not key.isdigit():
        raise ArtifactError(f"{what}: keys of \"collectives\" are equation indices")
    if not isinstance(c, dict) or not {"prim", "axes", "bytes", "itemsize"} <= set(c):
        raise ArtifactError(f"{what} needs \"prim\", \"axes\", \"bytes\" and \"itemsize\"; got {c!r}")
    if not isinstance(c["prim"], str) or not isinstance(c["axes"], list) \
            or not all(isinstance(a, str) for a in c["axes"]):
        raise ArtifactError(f"{what}: \"prim\" must be a string and \"axes\" a list of axis names; got {c!r}")
    if not _is_int(c["bytes"]) or not _is_int(c["itemsize"]) or c["itemsize"] < 1 or c["bytes"] < 0 \
            or c["bytes"] % c["itemsize"]:
        raise ArtifactError(f"{what}: \"bytes\" must be a non-negative multiple of a positive \"itemsize\"; "
                            f"got bytes={c['bytes']!r}, itemsize={c['itemsize']!r}")


def _json_line(line: str, where: str, what: str) -> Any:
    return loads(line, where, ArtifactError, what)


def _row(line: str, where: str) -> tuple[int, ...]:
    d = _json_line(line, where, "a transfer {coll, step, src, dst, bytes}")
    if not isinstance(d, dict) or set(d) != set(COLUMNS) or not all(_is_int(d[k]) for k in COLUMNS):
        raise ArtifactError(f"{where} is not a transfer: expected exactly the integer fields "
                            f"{', '.join(COLUMNS)}; got {line.strip()[:200]}")
    return tuple(d[k] for k in COLUMNS)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
