"""Halo exchanges for equations whose spatial dims are tiled (convolutions, windowed reductions).

:func:`lower_spatial` is called by the lowering for every equation before its generic local
form is emitted. It returns ``None`` when the equation needs no halo (the generic local
equation is then emitted), or else emits the border exchange and the local equation itself
through the lowerer, and returns True.

Which dims qualify is the rules' business: a *halo factor* (``FactorRule.halo``) of
``conv_general_dilated``, ``reduce_window_*`` or ``select_and_scatter_add`` is shared by a
windowed operand dim and the result dim (or, for a weight gradient, the rhs dim it slides over),
and :class:`~partir_emu.primitives.window.HaloDim` gives its geometry. When such a factor is tiled
by mesh axes ``A`` (a group of ``b`` blocks), each device needs ``before`` elements of the previous
block and ``after`` of the next (:meth:`HaloDim.halos`):

1. ``before > 0``: slice its own last ``before`` elements and ``collective_permute`` them over ``A``
   with ``shift=+1, wrap=False`` (device ``j`` receives device ``j-1``'s; the first device receives
   zeros, which is the zero padding of the global operand);
2. ``after > 0``: slice its first ``after`` elements, ``shift=-1, wrap=False`` (the last device
   receives zeros);
3. for a max/min window, whose padding is the identity (``-inf``) and not zero, the outer device
   replaces what it received by the identity: ``select_n(axis_index(A) == 0, received, identity)``
   (``== b-1`` for the next rows), local equations with no traffic;
4. ``concatenate`` [received-before, own block, received-after] along the dim;
5. run the equation locally with the padding of that dim replaced by
   :meth:`HaloDim.local_padding` (which crops where a window reaches less far than the block).

Several tiled spatial dims are exchanged one after the other, each on the already extended
block, so corners travel with the second exchange.

**Count convention.** A *halo exchange* is what one equation does for one tiled spatial dim: at
most one ``collective_permute`` per direction, so exactly two (a 3×3 'SAME' stride-1 conv,
``before = after = 1``), one (a stride-2 'SAME' conv: ``after = 1`` only; the input gradient of
a stride-2 conv: ``before = 1`` only) or none (2×2 pooling with stride 2: windows never straddle
blocks). An exchange of the same local value with the same halos over the same axes is emitted
once per lowering and reused: the weight gradient of a conv reads the forward conv's extended
input, so a conv layer of a training step costs one exchange forward (shared by its weight
gradient) and one for its input gradient.

A halo wider than a neighbour's block cannot happen: the rules make the shared factor coarse
enough (:func:`~partir_emu.primitives.window.halo_split`), so a tiling that would need it is
not divisible and never chosen. A tiled halo factor of an equation without halo geometry is an
internal error, raised loudly.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import numpy as np

from partir_emu.core.dtypes import np_dtype
from partir_emu.core.ir import Atom, Eqn, Literal, Var
from partir_emu.errors import LoweringError
from partir_emu.primitives import localize_params
from partir_emu.primitives.conv import conv_halos
from partir_emu.primitives.window import HaloDim, reduce_window_halos, select_and_scatter_add_halos, window_identity

HALO_DIMS: dict[str, Callable[[Eqn], list[HaloDim]]] = {
    "conv_general_dilated": conv_halos,
    "reduce_window_sum": reduce_window_halos,
    "reduce_window_max": reduce_window_halos,
    "reduce_window_min": reduce_window_halos,
    "select_and_scatter_add": select_and_scatter_add_halos,
}

# per lowering: (local value, dim, before, after, axes, fill) -> the extended value, so a value is
# exchanged once however many equations read it with the same halo (forward conv and weight gradient)
_EXCHANGED: WeakKeyDictionary[Any, dict[tuple, Var]] = WeakKeyDictionary()


def lower_spatial(lowerer: Any, i: int, e: Eqn, ins: list[Atom], outs: list[Var]) -> bool | None:
    """Lower global equation ``i`` (``e``) whose local operands are ``ins`` and local results
    ``outs``, with a halo exchange if a spatial dim is tiled; None if it needs none."""
    rule = lowerer.state.rules[i]
    F = lowerer.state.eqn_factors[i]
    tiled = {f for f in rule.halo if F.get(f)}
    if not tiled:
        return None
    halos = [h for h in HALO_DIMS[e.prim](e) if h.factor in tiled]
    if {h.factor for h in halos} != tiled:
        raise LoweringError(f"internal: {e.prim} at {e.source} has tiled halo factors {sorted(tiled)} "
                            f"without geometry")
    ins = list(ins)
    pads = [tuple(p) for p in e.params["padding"]]
    why = f"halo of {e.prim} at {e.source}"
    for h in halos:
        x = ins[h.operand]
        assert isinstance(x, Var)
        m = x.shape[h.dim]
        before, after = h.halos()
        if max(before, after) > m:
            raise LoweringError(f"{e.prim} at {e.source}: a block of {m} rows on axes {F[h.factor]} is narrower than "
                                f"its halo ({before}, {after}); tile that spatial dim on fewer devices")
        op = e.prim.removeprefix("reduce_window_") if e.prim in ("reduce_window_max", "reduce_window_min") else "sum"
        fill = window_identity(np_dtype(x.dtype), op)
        ins[h.operand] = exchange(lowerer, x, h.dim, before, after, tuple(F[h.factor]), why, fill)
        pads[h.pad_index] = h.local_padding(m)
    params = localize_params(e, ins, outs)
    params["padding"] = tuple(pads)
    lowerer.append(Eqn(e.prim, tuple(ins), tuple(outs), params, e.source, e.kernel))
    return True


def exchange(lowerer: Any, x: Var, dim: int, before: int, after: int, axes: tuple[str, ...], why: str,
             fill: Any = 0) -> Var:
    """``x`` extended along ``dim`` by ``before`` elements of the previous block and ``after`` of
    the next (``fill`` at the ends of the group), emitted once per (value, halo, axes, fill)."""
    if not before and not after:
        return x
    cache = _EXCHANGED.setdefault(lowerer, {})
    key = (x, dim, before, after, axes, fill)
    if key in cache:
        return cache[key]
    m = x.shape[dim]
    parts: list[Var] = []
    if before:
        got = _permute(lowerer, _slice(lowerer, x, dim, m - before, m, why), axes, 1, why)
        parts.append(_fill_edge(lowerer, got, axes, 0, fill, why))
    parts.append(x)
    if after:
        got = _permute(lowerer, _slice(lowerer, x, dim, 0, after, why), axes, -1, why)
        parts.append(_fill_edge(lowerer, got, axes, lowerer.mesh.group_size(axes) - 1, fill, why))
    shape = list(x.shape)
    shape[dim] = m + before + after
    out = cache[key] = lowerer.emit("concatenate", parts, tuple(shape), x.dtype, {"dimension": dim}, why)
    return out


def _fill_edge(lowerer: Any, got: Var, axes: tuple[str, ...], edge: int, fill: Any, why: str) -> Var:
    """``got`` on every device but group member ``edge``, which takes ``fill`` (a no-op for 0:
    collective_permute already gives that member zeros)."""
    if fill == 0:
        return got
    index = lowerer.emit("axis_index", [], (), "int32", {"axes": axes}, why)
    at_edge = lowerer.emit("eq", [index, Literal(edge, "int32")], (), "bool", {}, why)
    value = fill.item() if isinstance(fill, np.generic) else fill
    const = lowerer.emit("broadcast_in_dim", [Literal(value, got.dtype)], got.shape, got.dtype,
                         {"shape": got.shape, "broadcast_dimensions": ()}, why)
    return lowerer.emit("select_n", [at_edge, got, const], got.shape, got.dtype, {}, why)


def _slice(lowerer: Any, x: Var, dim: int, start: int, stop: int, why: str) -> Var:
    lo = [0] * x.ndim
    hi = list(x.shape)
    lo[dim], hi[dim] = start, stop
    shape = list(x.shape)
    shape[dim] = stop - start
    return lowerer.emit("slice", [x], tuple(shape), x.dtype,
                        {"start_indices": tuple(lo), "limit_indices": tuple(hi), "strides": None}, why)


def _permute(lowerer: Any, x: Var, axes: tuple[str, ...], shift: int, why: str) -> Var:
    return lowerer.emit("collective_permute", [x], x.shape, x.dtype, {"axes": axes, "shift": shift, "wrap": False},
                        why)
