"""The numpy interpreter: one implementation per primitive, and ``eval_program``.

The ``impl`` facet of a primitive's registry entry (:mod:`partir_emu.primitives`),
``impl(*operands, **params)``, computes one equation with ``jax.lax`` semantics.
:func:`eval_eqn` wraps it: it feeds literals, casts every result to the dtype of
the equation's output ``Var`` (numpy promotes where jax does not) and checks the
shape. :func:`eval_program` is the autodidax ``eval_jaxpr``: an env,
``read``/``write``, one loop.

Literals: when an equation also has array operands, a literal is passed as a
plain Python scalar so that numpy treats it as *weak* (NEP 50) and it takes the
array's dtype, as jax's weakly-typed literals do (the traced literal dtype may
say int64/float64 where jax meant the other operand's type). When every operand
is a literal, they are 0-d arrays of their recorded dtype.

Loops (:mod:`partir_emu.core.loops`): :func:`eval_eqn` runs a ``loop`` equation by
:func:`eval_loop`, its body once per iteration on the iteration's consts, carry and ``xs[i]``
rows (views, no copy), each ``y`` row written into a preallocated ``ys``. A body input bound to
a literal (a literal carry or const) stays a :class:`Literal`, exactly as ``loops.unroll``
substitutes it, so the two run the same arithmetic: the weak-literal rule above looks at the
operands actually passed, not at the equation's atoms.

This module never imports jax.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import np_dtype
from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var
from partir_emu.core.loops import LOOP, iteration_order, parts
from partir_emu.errors import ArgumentError, EmulationError, UnsupportedPrimitiveError
from partir_emu.primitives import get
from partir_emu.runtime.kernels import kernels as numerics

Step = Callable[[Eqn, Sequence[Any]], list[Any]]     # runs one equation on its read operands


def literal_value(lit: Literal, weak: bool) -> Any:
    """A literal operand: weak Python scalar, or 0-d array of its recorded dtype."""
    dt = np_dtype(lit.dtype)
    if not weak:
        return np.asarray(lit.value, dtype=dt)
    if dt == np.bool_:
        return bool(lit.value)
    return int(lit.value) if dt.kind in "iu" else float(lit.value)


def eval_eqn(eqn: Eqn, operands: Sequence[Any]) -> list[Any]:
    """Run one equation on already-read operands (Literals still as ``Literal``)."""
    if eqn.prim == LOOP:
        return eval_loop(eqn, operands)
    entry = get(eqn.prim)
    impl = entry.impl if entry is not None else None
    if impl is None and entry is not None and (entry.communicates or entry.per_device is not None):
        raise EmulationError(f"collective {eqn} cannot run on one device; run the SpmdProgram on a mesh "
                             f"(partir_emu.runtime.local_mesh.LocalMesh)")
    if impl is None:
        where = f" (traced at {eqn.source})" if eqn.source else ""
        raise UnsupportedPrimitiveError(
            f"primitive {eqn.prim!r}{where} has no numpy implementation (no impl facet in its "
            f"partir_emu.primitives entry); add one or rewrite the function with supported operations")
    weak = any(not isinstance(a, Literal) for a in operands)
    args = [literal_value(v, weak) if isinstance(v, Literal) else v for v in operands]
    with np.errstate(all="ignore"):  # jax produces inf/nan silently
        result = impl(*args, **eqn.params)
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(results) != len(eqn.outputs):
        raise EmulationError(f"{eqn.prim} at {eqn.source or '?'} produced {len(results)} values, "
                             f"expected {len(eqn.outputs)}: {eqn}")
    return [coerce_result(r, o, eqn) for r, o in zip(results, eqn.outputs)]


def coerce_result(x: Any, out: Var, eqn: Eqn) -> np.ndarray:
    """``x`` as an array of ``out``'s dtype; its shape must already be ``out``'s."""
    arr = np.asarray(x)
    dt = np_dtype(out.dtype)
    if arr.dtype != dt:
        arr = arr.astype(dt)
    if arr.shape != out.shape:
        raise EmulationError(f"{eqn.prim} at {eqn.source or '?'} produced shape {arr.shape} for {out} which is "
                             f"declared {out.type_str()}; the program is inconsistent: {eqn}")
    return arr


def check_inputs(program: Program, inputs: Sequence[Any], what: str = "program") -> list[np.ndarray]:
    """Check count, shapes and dtypes of ``inputs`` against ``program.inputs``."""
    if len(inputs) != len(program.inputs):
        raise ArgumentError(f"{what} takes {len(program.inputs)} inputs {list(program.input_names)}, "
                            f"got {len(inputs)}")
    out = []
    for v, name, x in zip(program.inputs, program.input_names, inputs):
        arr = np.asarray(x)
        if arr.shape != v.shape or arr.dtype != np_dtype(v.dtype):
            raise ArgumentError(f"{what} input {name!r}: expected {v.dtype}{list(v.shape)}, "
                                f"got {arr.dtype.name}{list(arr.shape)}")
        out.append(arr)
    return out


def eval_program(program: Program, inputs: Sequence[np.ndarray], *, kernels: str = "blas") -> list[np.ndarray]:
    """Evaluate a single-device program (no collectives; loops run) on numpy inputs, under
    :func:`partir_emu.runtime.kernels.kernels` as the meshes run theirs."""
    args = check_inputs(program, inputs)
    with numerics(kernels):
        return [output_value(x) for x in eval_body(program, args)]


def eval_body(program: Program, args: Sequence[Any], step: Step | None = None) -> list[Any]:
    """``program``'s results on ``args`` (arrays, or ``Literal`` where a loop passes one), unchecked.
    ``step`` runs one equation (default :func:`eval_eqn`); a loop's body runs by the same ``step``."""
    run = step or eval_eqn
    env: dict[Var, Any] = {}

    def read(a: Atom) -> Any:
        return a if isinstance(a, Literal) else env[a]

    env.update(zip(program.inputs, args))
    for v, c in program.consts:
        env[v] = np.asarray(c)
    for eqn in program.eqns:
        env.update(zip(eqn.outputs, run(eqn, [read(a) for a in eqn.inputs])))
    return [read(o) for o in program.outputs]


def new_ys(eqn: Eqn) -> list[np.ndarray]:
    """A loop's stacked outputs, allocated once; iteration ``i`` writes row ``i`` (zeros if ``length`` is 0,
    as ``loops.unroll`` makes them)."""
    alloc = np.zeros if int(eqn.params["length"]) == 0 else np.empty
    return [alloc(y.shape, np_dtype(y.dtype)) for y in parts(eqn).ys]


def put_rows(ys: Sequence[np.ndarray], i: int, rows: Sequence[Any]) -> None:
    """Write one iteration's y rows into row ``i`` of the stacked outputs."""
    for y, r in zip(ys, rows):
        y[i] = r.value if isinstance(r, Literal) else r


def loop_args(eqn: Eqn, operands: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """A loop's operands split into consts, carry and xs."""
    nc, nk = int(eqn.params["num_consts"]), int(eqn.params["num_carry"])
    return list(operands[:nc]), list(operands[nc:nc + nk]), list(operands[nc + nk:])


def eval_loop(eqn: Eqn, operands: Sequence[Any], step: Step | None = None) -> list[Any]:
    """Run a ``loop`` equation: carry_out and the stacked ys (its body's equations by ``step``)."""
    body, nk = eqn.params["body"], int(eqn.params["num_carry"])
    consts, carry, xs = loop_args(eqn, operands)
    ys = new_ys(eqn)
    for i in iteration_order(eqn):
        outs = eval_body(body, [*consts, *carry, *(x[i] for x in xs)], step)
        carry = outs[:nk]
        put_rows(ys, i, outs[nk:])
    return [*carry, *ys]


def output_value(x: Any) -> np.ndarray:
    """A program result as an owned, writable array (impls may return read-only views)."""
    if isinstance(x, Literal):
        return np.asarray(x.value, dtype=np_dtype(x.dtype))
    return x if (x.flags.writeable and x.flags.owndata) else np.array(x)
