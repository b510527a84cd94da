"""Peak memory per device from buffer liveness over a (local-shape) program.

The exact convention, which the in-process runtime reproduces on real arrays:

- Every :class:`~partir_emu.core.ir.Var` is its own buffer of ``Var.nbytes``
  bytes (local shape × itemsize; no aliasing: a reshape's result counts in
  full). A Var that appears several times (``mul x x``, an output listed twice)
  counts once. :class:`~partir_emu.core.ir.Literal` operands take no memory.
- Program points are ``start`` (index ``-1``) and one point per equation ``i``.
- At ``start`` the program inputs and constants are live.
- At point ``i`` (while equation ``i`` executes) the live buffers are: every
  buffer defined earlier and not yet freed, plus the outputs of equation ``i``.
  Its inputs and outputs are live simultaneously.
- A buffer is freed right *after* the point of its last use. Program outputs
  are never freed. A buffer used nowhere (an unused input or constant, a dead
  equation output) is freed right after the point that defines it.
- ``peak_bytes`` = max over all points of the sum of live bytes.

The breakdown at the peak point splits the live bytes into ``params`` (inputs
named ``params/...``), ``optimizer`` (``opt/...``, ``opt_state/...``),
``inputs`` (other inputs and constants), ``collective_buffers`` (results of
communicating collectives), ``temporaries`` (results of the peak equation and
values it consumes for the last time) and ``activations`` (everything else);
they sum to ``peak_bytes``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from partir_emu.core.ir import Program, Var
from partir_emu.core.spmd import COMM_PRIMS, SpmdProgram
from partir_emu.hwmodels.costs import nbytes_of

PARAM_PREFIXES: tuple[str, ...] = ("params",)
OPT_PREFIXES: tuple[str, ...] = ("opt", "opt_state", "optimizer")
CATEGORIES = ("params", "optimizer", "inputs", "activations", "temporaries", "collective_buffers")


@dataclass(frozen=True)
class MemoryProfile:
    peak_bytes: int
    peak_at: int                      # equation index of the peak point; -1 = start
    breakdown: dict[str, int]         # at the peak point, by CATEGORIES
    live_bytes: tuple[int, ...] = field(repr=False)   # at start, then at each equation
    input_bytes: int = 0              # inputs + constants

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "peak_at": self.peak_at, "breakdown": dict(self.breakdown),
                "input_bytes": self.input_bytes}


def _category(name: str) -> str:
    head = name.split("/", 1)[0]
    if head in PARAM_PREFIXES:
        return "params"
    if head in OPT_PREFIXES:
        return "optimizer"
    return "inputs"


def peak_memory(program: Program | SpmdProgram) -> MemoryProfile:
    """Liveness-based peak bytes per device (see the module docstring for the exact convention)."""
    prog = program.program if isinstance(program, SpmdProgram) else program
    eqns = prog.eqns
    end = len(eqns)
    size: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, e in enumerate(eqns):
        for a in e.inputs:
            if type(a) is Var:
                last[a.id] = i
    for o in prog.outputs:
        if type(o) is Var:
            last[o.id] = end
    initial = list(prog.inputs) + [v for v, _ in prog.consts]
    live = 0
    seen: set[int] = set()
    for v in initial:
        if v.id not in seen:
            seen.add(v.id)
            size[v.id] = b = nbytes_of(v)
            live += b
    input_bytes = live
    points = [live]
    for vid in seen:
        if vid not in last:
            live -= size[vid]
    peak, peak_at = input_bytes, -1
    for i, e in enumerate(eqns):
        out = 0
        for o in e.outputs:
            size[o.id] = b = nbytes_of(o)
            out += b
        live += out
        points.append(live)
        if live > peak:
            peak, peak_at = live, i
        freed: set[int] = set()
        for a in e.inputs:
            if type(a) is Var and last[a.id] == i and a.id not in freed:
                freed.add(a.id)
                live -= size[a.id]
        for o in e.outputs:
            if o.id not in last:
                live -= size[o.id]
    return MemoryProfile(peak, peak_at, _breakdown(prog, peak_at, last, size), tuple(points), input_bytes)


def _breakdown(prog: Program, at: int, last: dict[int, int], size: dict[int, int]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    counted: set[int] = set()

    def alive(vid: int, defined: int) -> bool:
        # defined at point `defined` (-1 for inputs); live at point `at`?
        if defined == at:
            return True
        return defined < at and last.get(vid, defined) >= at

    for v, name in list(zip(prog.inputs, prog.input_names)) + [(v, "const") for v, _ in prog.consts]:
        if v.id not in counted and alive(v.id, -1):
            counted.add(v.id)
            out[_category(name) if name != "const" else "inputs"] += size[v.id]
    if at >= 0:
        peak_eqn = prog.eqns[at]
        consumed = {a.id for a in peak_eqn.inputs if type(a) is Var and last[a.id] == at}
        for i, e in enumerate(prog.eqns[:at + 1]):
            comm = e.prim in COMM_PRIMS
            for o in e.outputs:
                if o.id in counted or not alive(o.id, i):
                    continue
                counted.add(o.id)
                if comm:
                    out["collective_buffers"] += size[o.id]
                elif i == at or o.id in consumed:
                    out["temporaries"] += size[o.id]
                else:
                    out["activations"] += size[o.id]
    return out


def live_bytes_at(program: Program | SpmdProgram, points: Sequence[int]) -> list[int]:
    """Live bytes at the given program points (``-1`` = start), per the same convention."""
    prof = peak_memory(program)
    return [prof.live_bytes[p + 1] for p in points]
