"""Peak memory per device from buffer liveness over a (local-shape) program.

Which buffers are live when is :func:`partir_emu.core.analysis.liveness`, the
convention the runtime releases buffers by, so the in-process runtime measures
these numbers on real arrays. Here every :class:`~partir_emu.core.ir.Var` takes
``nbytes_of(var)`` bytes (local shape × itemsize). Program points are ``start``
(index ``-1``) and one point per equation ``i``, sampled while equation ``i``
runs (its inputs and outputs live together); ``peak_bytes`` is the largest
sample.

The breakdown at the peak point splits the live bytes into ``params`` (inputs
named ``params/...``), ``optimizer`` (``opt/...``, ``opt_state/...``),
``inputs`` (other inputs and constants), ``collective_buffers`` (results of
communicating collectives), ``temporaries`` (results of the peak equation and
values it consumes for the last time) and ``activations`` (everything else);
they sum to ``peak_bytes``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from partir_emu.core.analysis import liveness
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
    lv = liveness(prog)
    size = {v.id: nbytes_of(v) for v in lv.initial}
    live = input_bytes = sum(size.values())
    points = [live]
    live -= sum(size[v.id] for v in lv.at_start)
    peak, peak_at = input_bytes, -1
    for i, (e, gone) in enumerate(zip(prog.eqns, lv.after)):
        for o in e.outputs:
            size[o.id] = b = nbytes_of(o)
            live += b
        points.append(live)
        if live > peak:
            peak, peak_at = live, i
        for v in gone:
            live -= size[v.id]
    return MemoryProfile(peak, peak_at, _breakdown(prog, peak_at, lv.last_use, size), tuple(points), input_bytes)


def _breakdown(prog: Program, at: int, last: Mapping[int, int], size: dict[int, int]) -> dict[str, int]:
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

