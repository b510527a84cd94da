"""The lowered per-device program and its file format.

An :class:`SpmdProgram` is one :class:`~partir_emu.core.ir.Program` with
*local* shapes, run identically by every device of the mesh, in which the
communication is explicit. Collective primitives (vocabulary close to
``jax.lax``), all named by mesh axes; a group over several axes is ordered by
mesh coordinates, major→minor in the order the axes are listed:

``all_gather[axes, dim]``            concatenate the group's blocks along ``dim``
``all_reduce[axes, op]``             elementwise ``op`` (sum|max|min) over the group
``reduce_scatter[axes, dim]``        sum over the group, keep block ``group_index`` of ``dim``
``all_to_all[axes, split_dim, concat_dim]`` split ``split_dim`` into g blocks, send block j
                                     to member j, concatenate the received along ``concat_dim``
``collective_permute[axes, pairs]``  member ``d`` gets the input of member ``s`` for each pair ``(s, d)``
                                     (positions within the group), zeros if it is no target
``all_slice[axes, dim]``             keep block ``group_index`` of ``dim`` (local, no traffic)
``to_partial[axes]``                 keep the value on group member 0, zeros elsewhere (local)

**collective_permute params** (as XLA's collective-permute, within each group): the canonical
spelling is ``pairs=((src, dst), ...)``, each source and each target at most once; a pair
``(i, i)`` keeps the value in place without traffic. The shorthand ``shift=k, wrap=bool``
(what halo exchanges use) means the pairs ``(i, i + k)`` for every position ``i``, taken mod ``p``
when ``wrap`` and dropped where ``i + k`` leaves ``0..p-1`` otherwise; it is kept as written (it does
not depend on the group size) and every consumer reads :func:`permute_pairs`, which expands it.
Over several axes the positions are the group index (major→minor), so a shift moves along the
flattened group; a halo exchange along one mesh axis names that axis alone.

**Loops** (:mod:`partir_emu.core.loops`): a ``loop`` equation's body is a local program too and
may hold collectives, which every device runs once per iteration. :meth:`SpmdProgram.collectives`
and :meth:`SpmdProgram.stats` count what one run *executes* (a body collective counts ``length``
times, so the counts equal those of ``loops.unroll`` of the program);
:meth:`SpmdProgram.static_collectives` lists each collective of the text once, with its count.

**File format** (version 2): JSON; an equation is ``{"prim", "in", "out", "params", "source"}``, a
loop's ``params["body"]`` a nested ``{"inputs", "input_names", "consts", "eqns", "outputs",
"output_names"}`` in the same Var-id space. Version 1 files (no loops) are still read.

This module does not import jax: the MPI ranks and the hardware models load
SpmdPrograms from files written here.
"""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partir_emu.core.ir import Atom, Eqn, Program, nbytes
from partir_emu.core.loops import LOOP, iteration_order, walk
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import format as spmd_format
from partir_emu.errors import ArtifactError, CollectiveError, PartirError
from partir_emu.limits import loads

FORMAT = "partir-spmd"
VERSION = 2
READABLE_VERSIONS = (1, 2)     # version 1: the same format before loops

COMM_PRIMS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute")
LOCAL_COLLECTIVE_PRIMS = ("all_slice", "to_partial")
COLLECTIVE_PRIMS = COMM_PRIMS + LOCAL_COLLECTIVE_PRIMS


def collective_bytes(e: Eqn) -> int:
    """Size of the collective's full buffer (nccl-tests 'size'): the gathered output of an
    all_gather, the input of the others."""
    v = e.outputs[0] if e.prim == "all_gather" else e.inputs[0]
    return nbytes(v.shape, v.dtype)


def collective_wire_bytes(e: Eqn, group: int) -> float:
    """Bytes one device sends under a bandwidth-optimal algorithm (ring):
    (g-1)/g of the buffer, twice that for all_reduce; for collective_permute the mean over the
    group of what a device sends (its whole block if it is the source of a moving pair)."""
    n = collective_bytes(e)
    if e.prim == "collective_permute":
        return n * sum(s != d for s, d in permute_pairs(e.params, group)) / group
    f = 2 if e.prim == "all_reduce" else 1
    return f * n * (group - 1) / group


def shift_pairs(p: int, shift: int, wrap: bool) -> tuple[tuple[int, int], ...]:
    """The pairs of a shift by ``shift`` positions over a group of ``p`` (see the module docstring)."""
    if wrap:
        return tuple((i, (i + shift) % p) for i in range(p))
    return tuple((i, i + shift) for i in range(p) if 0 <= i + shift < p)


def permute_pairs(params: Mapping[str, Any], p: int) -> tuple[tuple[int, int], ...]:
    """The checked ``(src, dst)`` pairs of a collective_permute's ``params`` over a group of ``p``
    (``pairs``, or the ``shift``/``wrap`` shorthand expanded); CollectiveError if they are malformed."""
    has_pairs, has_shift = "pairs" in params, "shift" in params
    if has_pairs == has_shift:
        raise CollectiveError(f"collective_permute params {dict(params)!r} must give either pairs=((src, dst), ...) "
                              "or shift=k with wrap=True|False, not both or neither")
    if has_shift:
        shift, wrap = params["shift"], params.get("wrap")
        if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)) or not isinstance(wrap, bool):
            raise CollectiveError(f"collective_permute shift={shift!r}, wrap={wrap!r}: shift must be an int and "
                                  "wrap a bool")
        return shift_pairs(p, int(shift), wrap)
    return check_pairs(params["pairs"], p)


def permute_spec(params: Mapping[str, Any]) -> tuple:
    """A hashable key of a collective_permute's pairs as written (``pairs``, or ``shift`` and ``wrap``),
    for tables that do not know the group size; ``permute_pairs(dict(spec), p)`` expands it."""
    if "pairs" in params and params["pairs"] is not None:
        try:
            return (("pairs", tuple((int(s), int(d)) for s, d in params["pairs"])),)
        except (TypeError, ValueError) as e:
            raise CollectiveError(f"permutation {params['pairs']!r} must be a sequence of (src, dst) pairs") from e
    return tuple((k, params[k]) for k in ("pairs", "shift", "wrap") if k in params)


def check_pairs(pairs: Any, p: int) -> tuple[tuple[int, int], ...]:
    """``pairs`` as a tuple of int pairs within ``0..p-1``, each source and target once; else CollectiveError."""
    if pairs is None:
        raise CollectiveError("collective_permute needs permutation=((src, dst), ...); pass the pairs")
    try:
        out = tuple((int(s), int(d)) for s, d in pairs)
    except (TypeError, ValueError) as e:
        raise CollectiveError(f"permutation {pairs!r} must be a sequence of (src, dst) pairs") from e
    for s, d in out:
        if not (0 <= s < p and 0 <= d < p):
            raise CollectiveError(f"permutation pair {(s, d)} is outside the group positions 0..{p - 1}")
    srcs, dsts = [s for s, _ in out], [d for _, d in out]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise CollectiveError(f"permutation {out} repeats a source or a destination; each may appear once")
    return out


@dataclass(frozen=True)
class CollectiveStats:
    count: dict[str, int]
    bytes: dict[str, int]
    by_axes: dict[str, dict[str, int]]          # "batch,model" -> {"count", "bytes"}
    wire_bytes_per_device: float

    def to_json(self) -> dict:
        return {"count": self.count, "bytes": self.bytes, "by_axes": self.by_axes,
                "wire_bytes_per_device": self.wire_bytes_per_device}

    def __str__(self) -> str:
        lines = ["collective        count        bytes"]
        for k in sorted(self.count):
            lines.append(f"{k:<16}{self.count[k]:>6}{self.bytes[k]:>13}")
        lines.append("by axes:")
        for k in sorted(self.by_axes):
            lines.append(f"  ({k}){'':<10}{self.by_axes[k]['count']:>6}{self.by_axes[k]['bytes']:>13}")
        lines.append(f"wire bytes per device (ring): {self.wire_bytes_per_device:.0f}")
        return "\n".join(lines)


@dataclass(frozen=True)
class SpmdProgram:
    mesh: Mesh
    program: Program
    in_shardings: tuple[Sharding, ...]
    out_shardings: tuple[Sharding, ...]
    global_in_shapes: tuple[tuple[int, ...], ...]
    global_out_shapes: tuple[tuple[int, ...], ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.program.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.program.output_names

    def collectives(self) -> list[Eqn]:
        """The communicating collectives one run executes, in order: a collective in a loop body
        appears once per iteration (the collectives of ``loops.unroll`` of the program)."""
        return list(_executed(self.program))

    def static_collectives(self) -> list[tuple[Eqn, int]]:
        """Each communicating collective of the program text (bodies included) once, with how many
        times one run executes it."""
        return [(e, n) for e, n in walk(self.program) if e.prim in COMM_PRIMS]

    def stats(self) -> CollectiveStats:
        """Counts and bytes of what one run executes (see :meth:`collectives`)."""
        count: Counter = Counter()
        byts: Counter = Counter()
        by_axes: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
        wire = 0.0
        for e, times in self.static_collectives():
            if not times:           # in a loop that never runs
                continue
            n = collective_bytes(e)
            count[e.prim] += times
            byts[e.prim] += n * times
            key = ",".join(e.params["axes"])
            by_axes[key]["count"] += times
            by_axes[key]["bytes"] += n * times
            wire += times * collective_wire_bytes(e, self.mesh.group_size(e.params["axes"]))
        return CollectiveStats(dict(count), dict(byts), dict(by_axes), wire)

    def pretty(self) -> str:
        head = [f"# SPMD program for {self.mesh} ({self.mesh.size} devices), local shapes"]
        for n, s, g in zip(self.input_names, self.in_shardings, self.global_in_shapes):
            head.append(f"#   in  {n}: global {list(g)} {s}")
        for n, s, g in zip(self.output_names, self.out_shardings, self.global_out_shapes):
            head.append(f"#   out {n}: global {list(g)} {s}")
        return "\n".join(head) + "\n" + self.program.pretty()

    __str__ = pretty

    # -- file format ----------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "mesh": self.mesh.to_json(),
                **spmd_format.program_json(self.program, self.in_shardings, self.out_shardings,
                                           self.global_in_shapes, self.global_out_shapes),
                "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict, where: str = "<json>") -> SpmdProgram:
        if not isinstance(d, dict):
            raise ArtifactError(f"{where}: not a partir SPMD program (a JSON {type(d).__name__}, not an object)")
        if d.get("format") != FORMAT:
            raise ArtifactError(f"{where}: not a partir SPMD program (format {d.get('format')!r}, expected {FORMAT!r})")
        if d.get("version") not in READABLE_VERSIONS:
            raise ArtifactError(f"{where}: format version {d.get('version')!r}; this partir_emu reads version "
                                f"{' or '.join(map(str, READABLE_VERSIONS))}. Re-lower the program with this version.")
        try:
            spmd = cls(Mesh.from_json(d["mesh"]), *spmd_format.read_program(d, where), dict(d.get("meta", {})))
            spmd.check_layout(where)
            return spmd
        except (KeyError, TypeError, ValueError, IndexError, AssertionError, AttributeError, PartirError) as exc:
            if isinstance(exc, ArtifactError):
                raise
            raise ArtifactError(f"{where}: malformed SPMD program ({type(exc).__name__}: {exc})") from None

    def check_layout(self, where: str) -> None:
        """The program fits its mesh: each input's and output's local shape is its global shape under
        its sharding on this mesh, and every collective names axes of the mesh. A program edited to
        another mesh, or lowered for one, fails here (:class:`ArtifactError`) instead of running."""
        ends: list[tuple[str, str, Atom, Sharding, tuple[int, ...]]] = [
            ("input", n, v, s, g) for n, v, s, g in
            zip(self.program.input_names, self.program.inputs, self.in_shardings, self.global_in_shapes)]
        ends += [("output", n, a, s, g) for n, a, s, g in
                 zip(self.program.output_names, self.program.outputs, self.out_shardings, self.global_out_shapes)]
        for kind, name, atom, sharding, global_shape in ends:
            sharding.validate(global_shape, self.mesh, f"{where}: {kind} {name!r}")
            local = sharding.local_shape(global_shape, self.mesh)
            if local != tuple(atom.shape):
                raise ArtifactError(f"{where}: {kind} {name!r} is {list(atom.shape)} on a device, but its global "
                                    f"shape {list(global_shape)} sharded {sharding} on {self.mesh} gives "
                                    f"{list(local)}; the program was lowered for another mesh")
        for e, _ in walk(self.program):
            if e.prim in COLLECTIVE_PRIMS:
                for axis in e.params.get("axes", ()):
                    self.mesh.check_axis(axis)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str | bytes, where: str = "<string>") -> SpmdProgram:
        data = loads(text, where, ArtifactError, "saved SPMD program", finite=False)   # (its -inf literals)
        return cls.from_json(data, where)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.dumps())

    @classmethod
    def load(cls, path: str | os.PathLike) -> SpmdProgram:
        try:
            with open(path) as f:
                return cls.loads(f.read(), str(path))
        except OSError as exc:
            raise ArtifactError(f"cannot read SPMD program file {path}: {exc.strerror}") from None


def _executed(program: Program) -> Iterator[Eqn]:
    """The communicating collectives of one run of ``program``, in execution order."""
    for e in program.eqns:
        if e.prim in COMM_PRIMS:
            yield e
        elif e.prim == LOOP:
            body = list(_executed(e.params["body"]))
            for _ in iteration_order(e):
                yield from body
