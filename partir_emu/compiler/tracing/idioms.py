"""Idioms found in a traced program and written as the one equation they are (``find_idioms``).

**Rotations.** jax has no rotation primitive. ``jnp.roll(x, s, axis)`` with a static shift (and a
hand-written rotation such as MaxText's pipeline ``jnp.concatenate([x[-1:], x[:-1]])``) traces to the
concatenation of two slices of ``x`` along the rolled dim, and its transpose (the gradient) to the
sum of two zero-pads of the pieces of a ``split`` (or of two slices)::

    y = concatenate[d](slice(x, d: n-s..n), slice(x, d: 0..n-s))        forward
    g = add_any(pad(split(c)[1], d: lo=0, hi=s), pad(split(c)[0], d: lo=n-s, hi=0))   its transpose

Both are rules of a slice, pad or concatenation, whose rotated dim is blocked: on a dim tiled over
mesh axes each would gather the whole value. Written as one ``rotate[dimension, shift]`` the
equation keeps the dim's tiling and the lowering moves whole blocks with a ``collective_permute``
(:mod:`partir_emu.compiler.lowering.rotate`).

The match is exact: every piece is a contiguous range of the same value along the same dim (a
``slice`` full in every other dim with unit strides, or an output of a ``split``), the pieces
cover the dim once, and each lands where one shift ``s`` (mod ``n``) puts it: at its offset in the
concatenation, or at the low padding of its zero pad (pad value a literal zero, no interior or
negative padding, the pad's size the dim's). Anything else is left as written.

**In-place accumulation.** jax's transpose of a loop accumulates each constant's cotangent in the
carry: ``acc + scatter-add(zeros, idx, upd)`` every iteration when the body gathered from the
constant (a pipeline stage picking its layer chunk). That is ``scatter-add(acc, idx, upd)``: the
same sums when every update lands on its own element (one index vector per batch of a batched
scatter, or ``unique_indices``), with the accumulator updated where the updates land instead of a
zero buffer of its size written and added every iteration.

The replaced equations' inputs stay if something else reads them and are dropped otherwise. Loop
bodies are searched too.
"""
from __future__ import annotations

from partir_emu.core.analysis import dead_code_elimination
from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var
from partir_emu.core.loops import LOOP

ROTATE = "rotate"
_SUMS = frozenset({"add_any", "add"})

Piece = tuple[Var, int, int, int]       # (value, dim, start, length): a contiguous range of one dim


class _Scope:
    """One program's lookups: each value's producer, how often it is read, and which values are
    known zeros (a literal zero, a zero scalar constant, or a loop-constant body input fed one: jax
    writes a bfloat16 zero as a constant, which a loop body receives as an input)."""

    def __init__(self, program: Program, zeros: frozenset[Var]) -> None:
        self.producers: dict[Var, Eqn] = {o: e for e in program.eqns for o in e.outputs}
        self.readers: dict[Var, int] = {}
        for a in (*(a for e in program.eqns for a in e.inputs), *program.outputs):
            if isinstance(a, Var):
                self.readers[a] = self.readers.get(a, 0) + 1
        self.zeros = zeros | {v for v, c in program.consts if c.size == 1 and not c.any()}

    def is_zero(self, a: Atom) -> bool:
        return (isinstance(a, Literal) and a.value == 0) or (isinstance(a, Var) and a in self.zeros)

    def producer(self, a: Atom) -> Eqn | None:
        return self.producers.get(a) if isinstance(a, Var) else None


def find_idioms(program: Program, zeros: frozenset[Var] = frozenset()) -> Program:
    """``program`` with each rotation written as one ``rotate`` and each accumulated zero-based
    scatter-add made in place (see the module docstring); ``program`` itself when it has none.
    ``zeros``: inputs known to be zero (a loop body's constants fed a zero)."""
    scope = _Scope(program, zeros)
    eqns = list(program.eqns)
    changed = False
    for k, e in enumerate(eqns):
        if e.prim == LOOP:
            body, nc = e.params["body"], int(e.params["num_consts"])
            known = frozenset(bv for a, bv in zip(e.inputs[:nc], body.inputs) if scope.is_zero(a))
            new_body = find_idioms(body, known)
            if new_body is not body:
                eqns[k] = Eqn(e.prim, e.inputs, e.outputs, {**e.params, "body": new_body}, e.source, e.kernel)
                changed = True
            continue
        new = _as_rotation(e, scope) or _in_place(e, scope)
        if new is not None:
            eqns[k] = new
            changed = True
    if not changed:
        return program
    kept, consts = dead_code_elimination(eqns, program.consts, program.outputs)
    return Program(program.inputs, program.input_names, tuple(kept), program.outputs, program.output_names,
                   tuple(consts))


def _as_rotation(e: Eqn, scope: _Scope) -> Eqn | None:
    found = _rotation(e, scope)
    if found is None:
        return None
    x, dim, shift = found
    return Eqn(ROTATE, (x,), e.outputs, {"dimension": dim, "shift": shift}, e.source, e.kernel)


def _in_place(e: Eqn, scope: _Scope) -> Eqn | None:
    """``scatter-add(acc, idx, upd)`` for ``acc + scatter-add(zeros, idx, upd)`` when every update lands
    on its own element and nothing else reads the zero-based scatter-add (else None)."""
    if e.prim not in _SUMS or len(e.inputs) != 2:
        return None
    for j in (0, 1):
        s, acc = e.inputs[j], e.inputs[1 - j]
        if not isinstance(s, Var) or not isinstance(acc, Var):
            continue
        sc = scope.producer(s)
        if sc is None or sc.prim != "scatter-add" or scope.readers.get(s, 0) != 1:
            continue
        zeros = scope.producer(sc.inputs[0])
        if zeros is None or zeros.prim != "broadcast_in_dim" or not scope.is_zero(zeros.inputs[0]) \
                or acc.shape != s.shape or acc.dtype != s.dtype or not _lands_once(sc):
            continue
        return Eqn(sc.prim, (acc, *sc.inputs[1:]), e.outputs, sc.params, sc.source, sc.kernel)
    return None


def _lands_once(sc: Eqn) -> bool:
    """Whether no two updates of scatter ``sc`` can add to one element: ``unique_indices``, or one
    index vector per batch (the indices have no dims but the batching dims and the vector's)."""
    if sc.params.get("unique_indices"):
        return True
    dn = sc.params["dimension_numbers"]
    idx = sc.inputs[1]
    batch = set(dn.get("scatter_indices_batching_dims", ()))
    return all(n == 1 for d, n in enumerate(idx.shape[:-1]) if d not in batch)


def _rotation(e: Eqn, scope: _Scope) -> tuple[Var, int, int] | None:
    """``(x, dim, shift)`` if ``e`` is a rotation of ``x``, else None."""
    if e.prim == "concatenate" and len(e.inputs) >= 2:
        dim = int(e.params["dimension"])
        placed, at = [], 0
        for a in e.inputs:
            p = _piece(a, scope)
            if p is None or p[1] != dim:
                return None
            placed.append((p, at))
            at += p[3]
        return _shift(placed, e.outputs[0].shape[dim])
    if e.prim in _SUMS and len(e.inputs) == 2:
        placed_pads = [_padded(a, scope) for a in e.inputs]
        if any(p is None for p in placed_pads):
            return None
        dims = {p[0][1] for p in placed_pads if p is not None}
        if len(dims) != 1:
            return None
        return _shift([p for p in placed_pads if p is not None], e.outputs[0].shape[dims.pop()])
    return None


def _shift(placed: list[tuple[Piece, int]], n: int) -> tuple[Var, int, int] | None:
    """The rotation that puts each piece at its offset, if one shift does it for every piece, the
    pieces are of one value along one dim and cover it once."""
    xs = {(p[0], p[1]) for p, _ in placed}
    if len(xs) != 1 or sum(p[3] for p, _ in placed) != n:
        return None
    (x, dim), = xs
    shifts = {(at - p[2]) % n for p, at in placed}
    starts = sorted(p[2] for p, _ in placed)
    if len(shifts) != 1 or len(set(starts)) != len(starts) or x.shape[dim] != n:
        return None
    shift = shifts.pop()
    return (x, dim, shift) if shift else None


def _piece(a: Atom, scope: _Scope) -> Piece | None:
    """``a`` as a contiguous range of one dim of another value (a unit-stride slice that keeps every
    other dim whole, or one output of a split), else None."""
    e = scope.producer(a)
    if e is None or not isinstance(e.inputs[0], Var):
        return None
    x = e.inputs[0]
    if e.prim == "split":
        axis, sizes = int(e.params["axis"]), [int(s) for s in e.params["sizes"]]
        k = e.outputs.index(a)
        return x, axis, sum(sizes[:k]), sizes[k]
    if e.prim != "slice" or any(s not in (None, 1) for s in (e.params.get("strides") or ())):
        return None
    cut = [d for d, (lo, hi, n) in enumerate(zip(e.params["start_indices"], e.params["limit_indices"], x.shape))
           if (lo, hi) != (0, n)]
    if len(cut) != 1:
        return None
    d = cut[0]
    lo, hi = int(e.params["start_indices"][d]), int(e.params["limit_indices"][d])
    return x, d, lo, hi - lo


def _padded(a: Atom, scope: _Scope) -> tuple[Piece, int] | None:
    """``a`` as a piece zero-padded along its own dim to the whole dim, and where it lands (its low
    padding), else None."""
    e = scope.producer(a)
    if e is None or e.prim != "pad" or not scope.is_zero(e.inputs[1]):
        return None
    p = _piece(e.inputs[0], scope)
    if p is None:
        return None
    cfg = [tuple(int(c) for c in t) for t in e.params["padding_config"]]
    others = [c for d, c in enumerate(cfg) if d != p[1]]
    lo, hi, interior = cfg[p[1]]
    if any(c != (0, 0, 0) for c in others) or interior or lo < 0 or hi < 0 or lo + p[3] + hi != p[0].shape[p[1]]:
        return None
    return p, lo


__all__ = ["ROTATE", "find_idioms"]
