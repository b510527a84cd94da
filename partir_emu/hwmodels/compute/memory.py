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

With overlap (:mod:`partir_emu.hwmodels.timeline.overlap`) the chip's schedule moves the prefetched ZeRO-3 all-gathers ahead:
:func:`prefetch_peak` adds each prefetched gather's output from the equation that was running when
the gather started to its place in the program (from there program order counts it already), and
its breakdown adds ``prefetch_buffers``. Every other buffer keeps its program-order lifetime.

**Loops** (rule 5 of :mod:`partir_emu.core.analysis`): a ``loop`` equation's point is sampled as any
equation's (its operands and all its results live), plus the peak of its body's own profile (the body's
inputs live at its start point as their own buffers; one iteration's values are gone before the next
starts, so every iteration has the same peak). Under a stack's policy (not ``"program"``) the buffers
rule 5 counts twice are counted once (:func:`shared_loop_buffers`: the body's consts and carry are the
loop's operands, a donated carry-in becomes the carry result) and an accumulating ``add`` writes
into its carry-in (:func:`stack_liveness`): a gradient accumulator is one buffer, not four. ``MemoryProfile.bodies`` keeps the body profiles added;
at a loop point the breakdown is the enclosing program's plus the body's. With overlap the body's
profile is the one of its own schedule (its prefetch buffers included): :func:`peak_memory` takes the
body profiles to add.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from partir_emu.core.analysis import Liveness
from partir_emu.core.ir import Program, Var
from partir_emu.core.loops import LOOP
from partir_emu.core.spmd import COMM_PRIMS, SpmdProgram
from partir_emu.hwmodels.compute.costs import nbytes_of
from partir_emu.hwmodels.compute.residuals import on_chip, saved_liveness

PARAM_PREFIXES: tuple[str, ...] = ("params",)
OPT_PREFIXES: tuple[str, ...] = ("opt", "opt_state", "optimizer")
CATEGORIES = ("params", "optimizer", "inputs", "activations", "temporaries", "collective_buffers")


@dataclass(frozen=True)
class MemoryProfile:
    peak_bytes: int
    peak_at: int                      # equation index of the peak point; -1 = start
    breakdown: dict[str, int]         # at the peak point, by CATEGORIES
    live_bytes: tuple[int, ...] = field(repr=False)   # at start, then at each equation (program order;
                                                      # empty for a schedule's profile, prefetch_peak)
    input_bytes: int = 0              # inputs + constants
    bodies: Mapping[int, MemoryProfile] = field(default_factory=dict, repr=False)
    # per loop equation that runs its body (length > 0): the body profile added at its point
    policy: str = "program"         # what the stack keeps for the backward (:mod:`.residuals`)

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "peak_at": self.peak_at, "breakdown": dict(self.breakdown),
                "input_bytes": self.input_bytes}


ACCUMULATE_PRIMS = frozenset({"add", "add_any"})
VIEW_PRIMS = frozenset({"reshape"})


def is_view(e) -> bool:
    """A ``reshape``, or a ``transpose`` that moves only size-1 dims (its data order is its operand's:
    XLA makes it a bitcast), e.g. a pipeline's stage dim, one row a device, moved behind the layer dim."""
    if e.prim in VIEW_PRIMS:
        return True
    if e.prim != "transpose":
        return False
    shape = e.inputs[0].shape
    kept = [d for d in e.params["permutation"] if shape[d] != 1]
    return kept == sorted(kept)


IN_PLACE_PRIMS = frozenset({"dynamic_update_slice", "scatter", "scatter-add"})


def _updates_in_place(e, last: Mapping[int, int], i: int) -> bool:
    """A ``dynamic_update_slice`` or scatter that reads its operand for the last time writes into the
    operand's buffer (XLA's in-place DUS and scatter; a pipeline's stash or conveyor written a slot a
    tick, an interleaved pipeline's gradient added to its chunk's row)."""
    return (e.prim in IN_PLACE_PRIMS and type(e.inputs[0]) is Var and last.get(e.inputs[0].id) == i
            and e.inputs[0].nbytes == e.outputs[0].nbytes)


def stack_liveness(prog: Program, policy: str, zero: frozenset[int] | None = None
                   ) -> tuple[Liveness, frozenset[int]]:
    """:func:`.saved_liveness` plus the buffers a stack shares between values (not under the runtime's
    ``"program"`` convention, where every Var is its own buffer). Returns the lifetimes and the ids
    of the values that take no buffer of their own:

    * **views**: a ``reshape`` (or a transpose of size-1 dims, :func:`is_view`) is a view of its
      operand's storage (PyTorch's ``view``, XLA's bitcast of a row-major array), so its result shares
      the operand's buffer, which lives until
      the last reader of either (a flash kernel's output and the same bytes reshaped for the output
      projection are one buffer, not two);
    * **in-place updates**: a ``dynamic_update_slice`` at its operand's last use writes into it;
    * **in-place accumulation**: an ``add`` that reads an input of ``prog`` for the last time and
      makes one of its outputs of the same size (a loop body's ``acc + g`` into its carry) writes into
      the input's buffer, as PyTorch's ``AccumulateGrad`` (``.grad += g``), FSDP's sharded gradient
      accumulation and XLA's aliasing of a while loop's carry do; the input then lives to the end of
      ``prog`` (it *is* the output).

    ``zero``: :func:`.residuals.on_chip` of ``prog`` if the caller has it already.
    """
    lv = saved_liveness(prog, policy)
    if policy == "program":
        return lv, frozenset()
    end = len(prog.eqns)
    zero = on_chip(prog, policy) if zero is None else zero
    ins = {v.id for v in prog.inputs}
    outs = {o.id for o in prog.outputs if type(o) is Var}
    last = dict(lv.last_use)
    released = {v.id: i for i, gone in enumerate(lv.after) for v in gone}
    var = {v.id: v for v in lv.initial} | {o.id: o for e in prog.eqns for o in e.outputs}
    shared: set[int] = set()
    root: dict[int, int] = {}                 # a view's id -> the id of the buffer it shares

    def extend(vid: int, to: int) -> None:
        if to > last.get(vid, -1):
            last[vid] = to
            released.pop(vid, None)
            if to < end:
                released[vid] = to

    for i, e in enumerate(prog.eqns):
        if (is_view(e) or _updates_in_place(e, last, i)) and type(e.inputs[0]) is Var \
                and e.inputs[0].id not in zero and e.outputs[0].id not in zero:
            o, r = e.outputs[0], root.get(e.inputs[0].id, e.inputs[0].id)
            root[o.id] = r
            shared.add(o.id)
            extend(r, last.get(o.id, i))
        elif e.prim in ACCUMULATE_PRIMS and len(e.outputs) == 1 and e.outputs[0].id in outs \
                and e.outputs[0].id not in shared:
            o = e.outputs[0]
            a = next((a for a in e.inputs if type(a) is Var and a.id in ins and a.id not in root
                      and last.get(a.id) == i and nbytes_of(a) == nbytes_of(o)), None)
            if a is not None:
                shared.add(o.id)
                extend(a.id, end)
    if not shared:
        return lv, frozenset()
    after: list[list[Var]] = [[] for _ in prog.eqns]
    for vid, i in released.items():
        after[i].append(var[vid])
    return Liveness(lv.initial, MappingProxyType(last), lv.at_start, tuple(after)), frozenset(shared)


def _category(name: str) -> str:
    head = name.split("/", 1)[0]
    if head in PARAM_PREFIXES:
        return "params"
    if head in OPT_PREFIXES:
        return "optimizer"
    return "inputs"


def peak_memory(program: Program | SpmdProgram, bodies: Mapping[int, MemoryProfile] | None = None,
                policy: str = "program") -> MemoryProfile:
    """Liveness-based peak bytes per device (see the module docstring for the exact convention).
    ``bodies``: per loop equation, the body profile to add at its point (default: each body's
    :func:`peak_memory`, computed here; a loop of length 0 adds nothing). ``policy``: what the
    stack keeps for the backward pass (:mod:`.residuals`; ``"program"``: every value of the program
    in HBM, the runtime's convention)."""
    prog = program.program if isinstance(program, SpmdProgram) else program
    if bodies is None:
        bodies = loop_bodies(prog, policy)
    lv, size = _lifetimes(prog, policy)
    live = input_bytes = sum(size[v.id] for v in lv.initial)
    points = [live]
    live -= sum(size[v.id] for v in lv.at_start)
    peak, peak_at = input_bytes, -1
    for i, (e, gone) in enumerate(zip(prog.eqns, lv.after)):
        for o in e.outputs:
            live += size[o.id]
        body = bodies.get(i) if bodies else None
        sample = live + body.peak_bytes - sum(shared_loop_buffers(prog, i, lv.last_use, body, policy).values()) \
            if body is not None else live
        points.append(sample)
        if sample > peak:
            peak, peak_at = sample, i
        for v in gone:
            live -= size[v.id]
    bd = _breakdown(prog, peak_at, lv.last_use, size)
    return MemoryProfile(peak, peak_at, _with_body(bd, bodies.get(peak_at), prog, peak_at, lv.last_use, policy),
                         tuple(points), input_bytes, MappingProxyType(dict(bodies)), policy)


def loop_bodies(prog: Program, policy: str = "program") -> dict[int, MemoryProfile]:
    """The program-order profile of each loop body of ``prog`` that runs (by loop equation index)."""
    return {i: peak_memory(e.params["body"], policy=policy) for i, e in enumerate(prog.eqns)
            if e.prim == LOOP and int(e.params["length"]) > 0}


def _with_body(bd: dict[str, int], body: MemoryProfile | None, prog: Program, at: int, last: Mapping[int, int],
               policy: str) -> dict[str, int]:
    """A loop point's breakdown: the enclosing program's plus its body's at the body's peak, less the
    buffers the two share (:func:`shared_loop_buffers`)."""
    if body is None:
        return bd
    out = dict(bd)
    for k, v in body.breakdown.items():
        out[k] = out.get(k, 0) + v
    for k, v in shared_loop_buffers(prog, at, last, body, policy).items():
        out[k] -= v
    return out


def shared_loop_buffers(prog: Program, at: int, last: Mapping[int, int], body: MemoryProfile,
                        policy: str) -> dict[str, int]:
    """Bytes that rule 5 counts twice at loop point ``at`` but a stack's loop holds once, by category.
    Under policy ``"program"`` (the runtime's convention: every Var its own buffer) none. A compiled or
    eager stack runs a loop in its operands' buffers: the body's consts and carry *are* the loop's
    operands (XLA's while-loop parameters alias its operand tuple; an accumulating ``.grad`` is one
    tensor), and a carry result takes over its carry-in buffer when the loop is that operand's last use
    (the carry is donated). Counted once, at the enclosing program's operands. A new carry made by
    accumulating into the old one takes its buffer (:func:`stack_liveness`); any other new carry
    counts beside the old one until the iteration ends, and the x rows and the stacked ys keep their
    own buffers."""
    if policy == "program":
        return {}
    e = prog.eqns[at]
    nc, nk = int(e.params["num_consts"]), int(e.params["num_carry"])
    out: dict[str, int] = {}
    for a, o in zip(e.inputs[nc:nc + nk], e.outputs[:nk]):
        if type(a) is Var and last.get(a.id) == at and nbytes_of(a) == nbytes_of(o):
            out["temporaries"] = out.get("temporaries", 0) + nbytes_of(o)
    b = e.params["body"]
    blast = stack_liveness(b, policy)[0].last_use
    for v, name in list(zip(b.inputs, b.input_names))[:nc + nk]:
        if body.peak_at == -1 or blast.get(v.id, -1) >= body.peak_at:
            cat = _category(name)
            out[cat] = out.get(cat, 0) + nbytes_of(v)
    return out


_LIFETIMES: dict[tuple[int, str], tuple[Program, Liveness, dict[int, int]]] = {}
_MAX_LIFETIMES = 8


def lifetimes(prog: Program, policy: str) -> Liveness:
    """The buffer lifetimes the profile of ``prog`` under ``policy`` counts (:func:`stack_liveness`)."""
    return _lifetimes(prog, policy)[0]


def _lifetimes(prog: Program, policy: str) -> tuple[Liveness, dict[int, int]]:
    """:func:`stack_liveness` of ``prog`` and its buffers' bytes (:func:`_sizes`), kept for the last
    programs asked about (by identity, the program held so its id stays its own): the peak and the
    breakdowns at other points (:func:`breakdown_at`, asked for by each overlap schedule's peak) read
    the same lifetimes. Read only."""
    key = (id(prog), policy)
    hit = _LIFETIMES.get(key)
    if hit is not None and hit[0] is prog:
        return hit[1], hit[2]
    zero = on_chip(prog, policy)
    lv, inplace = stack_liveness(prog, policy, zero)
    size = _sizes(prog, lv.initial, zero | inplace)
    if len(_LIFETIMES) >= _MAX_LIFETIMES:
        del _LIFETIMES[next(iter(_LIFETIMES))]              # the oldest
    _LIFETIMES[key] = (prog, lv, size)
    return lv, size


def _sizes(prog: Program, initial: tuple[Var, ...], zero: frozenset[int] = frozenset()) -> dict[int, int]:
    """Bytes per buffer; the ``zero`` ones never reach HBM (a hand kernel's on-chip values)."""
    size = {v.id: nbytes_of(v) for v in initial}
    for e in prog.eqns:
        for o in e.outputs:
            size[o.id] = 0 if o.id in zero else nbytes_of(o)
    return size


def breakdown_at(program: Program, at: int, bodies: Mapping[int, MemoryProfile] | None = None,
                 policy: str = "program") -> dict[str, int]:
    """The program-order breakdown (module docstring) at point ``at`` (an equation; -1: start); at a
    loop point plus ``bodies[at]``'s (the body profile added there)."""
    lv, size = _lifetimes(program, policy)
    bd = _breakdown(program, at, lv.last_use, size)
    return _with_body(bd, bodies.get(at) if bodies else None, program, at, lv.last_use, policy)


def prefetch_peak(live: np.ndarray, first: np.ndarray, last: np.ndarray, nbytes: np.ndarray
                  ) -> tuple[int, int, int]:
    """Peak of ``live`` (bytes at the start point, then at each equation: ``MemoryProfile.live_bytes``)
    when buffer ``k`` of ``nbytes[k]`` bytes is also live at equations ``first[k] .. last[k] - 1``.
    Returns ``(peak bytes, peak equation (-1: start), the added bytes there)``."""
    n = len(live)
    keep = first < last
    if keep.any():
        w = nbytes[keep]
        extra = np.cumsum(np.bincount(first[keep] + 1, w, n) - np.bincount(last[keep] + 1, w, n))[:n]
        total = live + extra
    else:
        extra, total = np.zeros(n), live
    k = int(np.argmax(total))
    return int(total[k]), k - 1, int(extra[k])


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

