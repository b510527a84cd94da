"""A rotation along a tiled dim: ``collective_permute`` of whole blocks, never a gather.

``rotate[dimension, shift]`` (``jnp.roll``, found by :mod:`partir_emu.compiler.tracing.idioms`) is
``y[i] = x[(i - s) mod n]``. When its dim is tiled over mesh axes ``A`` (a group of ``g`` members,
member ``j`` holding rows ``[j·b, (j+1)·b)``, ``n = g·b``), member ``j``'s block of ``y`` is rows
``[j·b - s, (j+1)·b - s)`` of ``x``. With ``s mod n = q·b + r`` (``0 <= r < b``):

- ``r = 0``: the whole block of member ``j - q``: one ``collective_permute`` over ``A`` with
  ``shift=q, wrap=True`` (each member sends its block to member ``j + q``). A pipeline's state
  buffer rotated by one stage, or ring attention's key/value blocks passed on, are this case.
- ``r > 0``: the last ``r`` rows of member ``j - q - 1``'s block, then the first ``b - r`` rows of
  member ``j - q``'s: two slices, each permuted (``shift=q+1`` and ``shift=q``, a local slice where
  the shift is a whole turn of the group, ``q = 0`` for the second), concatenated. Every row moves
  once and nothing is gathered.

An untiled rotated dim is the local ``rotate`` (the generic path; the shift is the same on the whole dim).
"""
from __future__ import annotations

from typing import Any

from partir_emu.core.ir import Atom, Eqn, Var


def lower_rotation(lw: Any, i: int, e: Eqn, ins: list[Atom], outs: list[Var]) -> bool | None:
    """Lower global equation ``i`` (``e``, local operand ``ins[0]``, result ``outs[0]``) as permutes
    when its rotated dim is tiled (see the module docstring); None otherwise."""
    if e.prim != "rotate":
        return None
    dim = int(e.params["dimension"])
    (f,) = lw.state.rules[i].operands[0][dim]
    axes = tuple(lw.state.eqn_factors[i].get(f, ()))
    if not axes:
        return None
    x, out = ins[0], outs[0]
    assert isinstance(x, Var)
    g, b = lw.mesh.group_size(axes), x.shape[dim]
    q, r = divmod(int(e.params["shift"]) % (g * b), b)
    if q == r == 0:             # a whole turn: the local rotate (by a multiple of the block) is the identity
        return None
    why = f"rotate by {e.params['shift']} of a dim tiled over {','.join(axes)} at {e.source}"
    if r == 0:
        lw.append(Eqn("collective_permute", (x,), (out,), {"axes": axes, "shift": q, "wrap": True}, why))
        return True
    tail = _permute(lw, _rows(lw, x, dim, b - r, b, why), axes, (q + 1) % g, why)
    head = _permute(lw, _rows(lw, x, dim, 0, b - r, why), axes, q % g, why)
    lw.append(Eqn("concatenate", (tail, head), (out,), {"dimension": dim}, e.source, e.kernel))
    return True


def _rows(lw: Any, x: Var, dim: int, start: int, stop: int, why: str) -> Var:
    lo, hi, shape = [0] * x.ndim, list(x.shape), list(x.shape)
    lo[dim], hi[dim], shape[dim] = start, stop, stop - start
    return lw.emit("slice", [x], tuple(shape), x.dtype,
                   {"start_indices": tuple(lo), "limit_indices": tuple(hi), "strides": None}, why)


def _permute(lw: Any, x: Var, axes: tuple[str, ...], shift: int, why: str) -> Var:
    """``x`` of group member ``j - shift`` (``x`` itself for a whole turn of the group)."""
    if shift == 0:
        return x
    return lw.emit("collective_permute", [x], x.shape, x.dtype, {"axes": axes, "shift": shift, "wrap": True}, why)


__all__ = ["lower_rotation"]
