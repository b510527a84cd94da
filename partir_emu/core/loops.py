"""The loop op: one equation that runs a body program a fixed number of times.

``scan`` (``lax.scan``, ``fori_loop`` with static bounds, Flax ``nn.scan``, and the reversed scans
their gradients make) is traced to one ``loop`` equation, in the global program and, once
partitioned, in the SpmdProgram::

    carry_out..., ys... = loop[length=n, num_consts=c, num_carry=k, reverse=r, body=B]
                              consts..., carry_init..., xs...

- ``B`` is a :class:`~partir_emu.core.ir.Program` whose inputs are ``(*consts, *carry, *x_rows)``
  and whose outputs are ``(*carry_new, *y_rows)``; ``x_row`` is ``xs[i]`` (the leading dim of each
  ``xs`` has length ``n``) and each ``ys`` is the ``y_rows`` stacked on a new leading dim of ``n``.
- Iteration ``i`` runs ``i = 0..n-1`` (``n-1..0`` when ``reverse``) and reads row ``i`` of each
  ``xs``, writes row ``i`` of each ``ys``; the carry flows from one iteration to the next.
- Var ids are unique across a program *and* its bodies (one id space), so a body can be
  inlined or unrolled without renaming clashes, and a body reads nothing but its own inputs,
  its own constants and its own equations' outputs.
- In an SpmdProgram the body is a local program too: it may contain collectives, which every
  device runs once per iteration, in the same order (lockstep, as every other equation).

The body sits in ``params["body"]``: it is the one parameter that is not plain data; the file
format writes it as a nested program and ``Eqn.__str__`` prints it indented.

This module holds the vocabulary every layer shares (:func:`loop_eqn`, :func:`parts`,
:func:`iteration_order`, :func:`walk`) and :func:`unroll`, the reference semantics: the same
program with every loop expanded into straight-line equations (tests compare against it;
a consumer that has no loop support yet may run the unrolled program).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.core.dtypes import np_dtype
from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var

LOOP = "loop"


@dataclass(frozen=True)
class LoopParts:
    """A loop equation's operands and results by role."""

    consts: tuple[Atom, ...]
    carry: tuple[Atom, ...]
    xs: tuple[Atom, ...]
    carry_out: tuple[Var, ...]
    ys: tuple[Var, ...]
    body: Program
    length: int
    reverse: bool


def is_loop(e: Eqn) -> bool:
    return e.prim == LOOP


def loop_eqn(consts: Sequence[Atom], carry: Sequence[Atom], xs: Sequence[Atom], carry_out: Sequence[Var],
             ys: Sequence[Var], body: Program, length: int, reverse: bool = False, source: str = "",
             kernel: str = "") -> Eqn:
    """A checked loop equation (shapes of the body's inputs/outputs against the operands)."""
    nc, nk = len(consts), len(carry)
    assert len(body.inputs) == nc + nk + len(xs), "body inputs are consts, carry, x rows"
    assert len(body.outputs) == nk + len(ys), "body outputs are carry, y rows"
    for a, bv in zip((*consts, *carry), body.inputs):
        assert a.shape == bv.shape, (a, bv)
    for x, bv in zip(xs, body.inputs[nc + nk:]):
        assert tuple(x.shape) == (length, *bv.shape), (x, bv, length)
    for y, bo in zip(ys, body.outputs[nk:]):
        assert tuple(y.shape) == (length, *bo.shape), (y, bo, length)
    params = {"length": int(length), "num_consts": nc, "num_carry": nk, "reverse": bool(reverse), "body": body}
    return Eqn(LOOP, (*consts, *carry, *xs), (*carry_out, *ys), params, source, kernel)


def parts(e: Eqn) -> LoopParts:
    p = e.params
    nc, nk = int(p["num_consts"]), int(p["num_carry"])
    ins = e.inputs
    return LoopParts(tuple(ins[:nc]), tuple(ins[nc:nc + nk]), tuple(ins[nc + nk:]), tuple(e.outputs[:nk]),
                     tuple(e.outputs[nk:]), p["body"], int(p["length"]), bool(p.get("reverse", False)))


def iteration_order(e: Eqn) -> range:
    n = int(e.params["length"])
    return range(n - 1, -1, -1) if e.params.get("reverse") else range(n)


def walk(program: Program, times: int = 1) -> Iterator[tuple[Eqn, int]]:
    """Every equation of ``program`` and of its loop bodies, with how many times one run executes
    it (a loop equation itself is yielded too, once per run of its enclosing program)."""
    for e in program.eqns:
        yield e, times
        if e.prim == LOOP:
            yield from walk(e.params["body"], times * int(e.params["length"]))


def static_eqn_count(program: Program) -> int:
    """Equations in the program text: each body counted once (what a loop saves)."""
    return sum(1 for _ in walk(program))


def has_loops(program: Program) -> bool:
    return any(e.prim == LOOP for e in program.eqns)


# -- unrolling ------------------------------------------------------------------------------------

class _Emitter:
    def __init__(self, next_id: int) -> None:
        self.next_id = next_id
        self.eqns: list[Eqn] = []
        self.consts: list[tuple[Var, np.ndarray]] = []

    def new(self, shape: Sequence[int], dtype: str) -> Var:
        v = Var(self.next_id, tuple(int(d) for d in shape), dtype)
        self.next_id += 1
        return v

    def emit(self, prim: str, ins: Sequence[Atom], shape: Sequence[int], dtype: str, params: dict,
             source: str = "", kernel: str = "") -> Var:
        out = self.new(shape, dtype)
        self.eqns.append(Eqn(prim, tuple(ins), (out,), params, source, kernel))
        return out


def row(em: Any, x: Var, i: int, source: str = "", kernel: str = "") -> Var:
    """``x[i]`` along the leading dim (``slice`` + ``squeeze``), emitted through ``em``."""
    start = (i,) + (0,) * (len(x.shape) - 1)
    limit = (i + 1,) + tuple(x.shape[1:])
    one = em.emit("slice", (x,), (1, *x.shape[1:]), x.dtype,
                  {"start_indices": start, "limit_indices": limit, "strides": None}, source, kernel)
    return em.emit("squeeze", (one,), x.shape[1:], x.dtype, {"dimensions": (0,)}, source, kernel)


def stack(em: Any, rows: Sequence[Atom], shape: Sequence[int], dtype: str, source: str = "",
          kernel: str = "") -> Atom:
    """``rows`` stacked on a new leading dim (``shape`` is the stacked shape), emitted through ``em``."""
    row_shape = tuple(shape[1:])
    lifted = [em.emit("broadcast_in_dim", (r,), (1, *row_shape), dtype,
                      {"shape": (1, *row_shape), "broadcast_dimensions": tuple(range(1, len(row_shape) + 1))}
                      if isinstance(r, Var) else {"shape": (1, *row_shape), "broadcast_dimensions": ()},
                      source, kernel) for r in rows]
    if len(lifted) == 1:
        return lifted[0]
    return em.emit("concatenate", lifted, shape, dtype, {"dimension": 0}, source, kernel)


def _copy(em: _Emitter, program: Program, args: Sequence[Atom]) -> list[Atom]:
    """Inline ``program`` (loops unrolled) on ``args`` with fresh Var ids; its results."""
    env: dict[Var, Atom] = dict(zip(program.inputs, args))
    for v, c in program.consts:
        nv = em.new(v.shape, v.dtype)
        em.consts.append((nv, c))
        env[v] = nv

    def read(a: Atom) -> Atom:
        return a if isinstance(a, Literal) else env[a]

    for e in program.eqns:
        ins = [read(a) for a in e.inputs]
        if e.prim == LOOP:
            outs = _unroll_one(em, e, ins)
        else:
            outs = [em.new(o.shape, o.dtype) for o in e.outputs]
            em.eqns.append(Eqn(e.prim, tuple(ins), tuple(outs), dict(e.params), e.source, e.kernel))  # type: ignore[arg-type]
        env.update(zip(e.outputs, outs))
    return [read(o) for o in program.outputs]


def _unroll_one(em: _Emitter, e: Eqn, ins: Sequence[Atom]) -> list[Atom]:
    lp = parts(e)
    nc, nk = len(lp.consts), len(lp.carry)
    consts, carry, xs = list(ins[:nc]), list(ins[nc:nc + nk]), list(ins[nc + nk:])
    ys: dict[int, list[Atom]] = {}
    for i in iteration_order(e):
        rows = [row(em, x, i, e.source, e.kernel) if isinstance(x, Var) else x for x in xs]
        outs = _copy(em, lp.body, [*consts, *carry, *rows])
        carry, ys[i] = outs[:nk], outs[nk:]
    stacked: list[Atom] = []
    for j, y in enumerate(lp.ys):
        if lp.length == 0:
            z = em.new(y.shape, y.dtype)
            em.consts.append((z, np.zeros(y.shape, np_dtype(y.dtype))))
            stacked.append(z)
        else:
            stacked.append(stack(em, [ys[i][j] for i in range(lp.length)], y.shape, y.dtype, e.source, e.kernel))
    return [*carry, *stacked]


def unroll(program: Program) -> Program:
    """``program`` with every loop (and nested loop) expanded into straight-line equations."""
    if not any(e.prim == LOOP for e, _ in walk(program)):
        return program
    em = _Emitter(_max_id(program) + 1)
    ins = [em.new(v.shape, v.dtype) for v in program.inputs]
    outs = _copy(em, program, ins)
    return Program(tuple(ins), program.input_names, tuple(em.eqns), tuple(outs), program.output_names,
                   tuple(em.consts))


def _max_id(program: Program) -> int:
    m = max((v.id for v in program.vars()), default=-1)
    for e, _ in walk(program):
        if e.prim == LOOP:
            m = max(m, _max_id(e.params["body"]))
    return m


__all__ = ["LOOP", "LoopParts", "has_loops", "is_loop", "iteration_order", "loop_eqn", "parts", "row", "stack",
           "static_eqn_count", "unroll", "walk"]
