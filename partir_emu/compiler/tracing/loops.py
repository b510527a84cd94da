"""``scan``, ``cond`` and ``empty`` for the tracer.

- ``scan`` (``lax.scan``, ``fori_loop`` with static bounds, Flax ``nn.scan``, and the reversed
  scans of their gradients) becomes one ``loop`` equation (:mod:`partir_emu.core.loops`) whose
  body is traced once, into a program of its own (its own equations and constants, fresh
  input Vars for the consts, carry and x rows), so the program does not grow with the trip
  count and the partitioner sees the body once.
- ``cond`` computes **every branch** and picks each output with ``select_n`` on the branch index,
  which is exact for the pure functions jax traces (an untaken branch's infinities are
  discarded by the select, in the gradient too) and costs every branch. A branch index known
  at trace time picks its branch alone.
- ``empty`` (jax's uninitialised buffer, which cond's gradient uses) becomes zeros.
- ``while`` whose trip count is known at trace time (``fori_loop`` with constant bounds that jax
  kept as a while: ``i < n`` with ``i`` and ``n`` literals and ``i += 1``) is a loop of that count;
  any other ``while`` (a trip count known only at run time) stays unsupported.

The equations emitted here carry the ``scan``'s own source line and kernel tag.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from partir_emu.core.analysis import dead_code_elimination
from partir_emu.core.ir import Eqn, Literal, Program, Var
from partir_emu.core.loops import loop_eqn

Atom = Var | Literal


def _new(b: Any, shape: Sequence[int], dtype: str) -> Var:
    v = Var(b.next_id, tuple(int(d) for d in shape), dtype)
    b.next_id += 1
    return v


def _emit(b: Any, prim: str, ins: Sequence[Atom], shape: Sequence[int], dtype: str, params: dict,
          where: str, kernel: str) -> Var:
    out = _new(b, shape, dtype)
    b.eqns.append(Eqn(prim, tuple(ins), (out,), params, where, kernel))
    return out


def _body(b: Any, closed: Any, nc: int, nk: int, where: str, stack: str,
          shape_of: Callable[[Any], tuple[tuple[int, ...], str]]) -> Program:
    """A loop body traced once from ``closed`` (inputs: ``nc`` consts, ``nk`` carries, x rows), into a
    program of its own: its own equations and constants, fresh input Vars; it reads nothing outer."""
    body_ins = [_new(b, *shape_of(iv)) for iv in closed.jaxpr.invars]
    outer_eqns, outer_consts = b.eqns, b.consts
    b.eqns, b.consts = [], []
    try:
        body_outs = b.inline(closed.jaxpr, closed.consts, body_ins, where, stack)
        eqns, consts = dead_code_elimination(b.eqns, b.consts, body_outs)
    finally:
        b.eqns, b.consts = outer_eqns, outer_consts
    names_in = [f"const{i}" for i in range(nc)] + [f"carry{i}" for i in range(nk)] + \
        [f"x{i}" for i in range(len(body_ins) - nc - nk)]
    names_out = [f"carry{i}" for i in range(nk)] + [f"y{i}" for i in range(len(body_outs) - nk)]
    return Program(tuple(body_ins), tuple(names_in), tuple(eqns), tuple(body_outs), tuple(names_out),
                   tuple(consts))


def trace_scan(b: Any, e: Any, ins: Sequence[Atom], where: str, stack: str, kernel: str,
               shape_of: Callable[[Any], tuple[tuple[int, ...], str]]) -> list[Atom]:
    """Scan equation ``e`` as one ``loop`` equation whose body is traced once (see core/loops)."""
    p = e.params
    nc, nk = int(p["num_consts"]), int(p["num_carry"])
    body = _body(b, p["jaxpr"], nc, nk, where, stack, shape_of)
    outs = [_new(b, *shape_of(ov)) for ov in e.outvars]
    b.eqns.append(loop_eqn(ins[:nc], ins[nc:nc + nk], ins[nc + nk:], outs[:nk], outs[nk:], body, int(p["length"]),
                           bool(p.get("reverse")), where, kernel))
    return list(outs)


def _counted(e: Any, ins: Sequence[Atom]) -> tuple[int, int] | None:
    """``(counter position, trip count)`` if while equation ``e`` is a counted loop known at trace
    time (``fori_loop`` with constant bounds that jax did not turn into a scan): its condition is
    ``carry[k] < carry[m]``, its body adds 1 to ``carry[k]`` and passes ``carry[m]`` on, and both
    start as literals. None otherwise."""
    p = e.params
    cn, bn = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    if cn or len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt" or cond.outvars[0] is not cond.eqns[0].outvars[0]:
        return None
    try:
        k, m = (cond.invars.index(v) for v in cond.eqns[0].invars)
    except ValueError:
        return None
    carry = ins[cn + bn:]
    if not (isinstance(carry[k], Literal) and isinstance(carry[m], Literal)):
        return None
    bin_, bout = body.invars[bn:], body.outvars
    step = next((q for q in body.eqns if q.outvars[0] is bout[k]), None)
    if bout[m] is not bin_[m] or step is None or step.primitive.name != "add" or step.invars[0] is not bin_[k] \
            or getattr(step.invars[1], "val", None) != 1:
        return None
    return k, max(0, int(carry[m].value) - int(carry[k].value))


def trace_while(b: Any, e: Any, ins: Sequence[Atom], where: str, stack: str, kernel: str,
                shape_of: Callable[[Any], tuple[tuple[int, ...], str]]) -> list[Atom]:
    """A counted ``while`` (see :func:`_counted`) as a loop of its trip count; any other ``while``
    is reported unsupported (its trip count is known only at run time)."""
    counted = _counted(e, ins)
    outs = [_new(b, *shape_of(ov)) for ov in e.outvars]
    if counted is None:
        b.unsupported.add("while", list(reversed(b.call_sites)), where)
        return list(outs)
    bn, cn = int(e.params["body_nconsts"]), int(e.params["cond_nconsts"])
    body = _body(b, e.params["body_jaxpr"], bn, len(outs), where, stack, shape_of)
    b.eqns.append(loop_eqn(ins[cn:cn + bn], ins[cn + bn:], (), outs, (), body, counted[1], False, where, kernel))
    return list(outs)


def select_cond(b: Any, e: Any, ins: Sequence[Atom], where: str, stack: str, kernel: str,
                shape_of: Callable[[Any], tuple[tuple[int, ...], str]]) -> list[Atom]:
    """The outputs of cond equation ``e``: every branch inlined, each output a ``select_n``."""
    index, ops = ins[0], list(ins[1:])
    branches = e.params["branches"]
    if isinstance(index, Literal):          # known at trace time: that branch alone (lax clamps it)
        k = min(max(int(index.value), 0), len(branches) - 1)
        return b.inline(branches[k].jaxpr, branches[k].consts, ops, where, stack)
    results = [b.inline(br.jaxpr, br.consts, ops, where, stack) for br in branches]
    outs: list[Atom] = []
    for j, ov in enumerate(e.outvars):
        cases = [r[j] for r in results]
        if all(c is cases[0] for c in cases):
            outs.append(cases[0])
            continue
        shape, dtype = shape_of(ov)
        cases = [c if isinstance(c, Var) else
                 _emit(b, "broadcast_in_dim", (c,), shape, dtype, {"shape": shape, "broadcast_dimensions": ()},
                       where, kernel) for c in cases]
        outs.append(_emit(b, "select_n", (index, *cases), shape, dtype, {}, where, kernel))
    return outs


def empty_as_zeros(b: Any, e: Any, ins: Sequence[Atom], where: str, stack: str, kernel: str,
                   shape_of: Callable[[Any], tuple[tuple[int, ...], str]]) -> list[Atom]:
    """``empty`` (an uninitialised buffer; cond's gradient makes its untaken branch's residuals
    with it): zeros, a well-defined value for a buffer nothing may read before writing it."""
    shape, dtype = shape_of(e.outvars[0])
    zero = Literal(False if dtype == "bool" else 0, dtype)
    return [_emit(b, "broadcast_in_dim", (zero,), shape, dtype, {"shape": shape, "broadcast_dimensions": ()},
                  where, kernel)]


__all__ = ["empty_as_zeros", "select_cond", "trace_scan", "trace_while"]
