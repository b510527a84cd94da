"""Shape primitives: broadcast, reshape, transpose, squeeze/expand_dims, concatenate, slice,
pad, rev, dynamic_slice/update, split, stack/unstack, tile, iota, and ``rotate``.

Rules: reshape uses compound factors (a dim made of several factors, major→minor); dims
that a slice, pad, concatenation or reversal changes are blocked. Impls may return views of
their operands and never write into one. Costs: layout ops move bytes and do no FLOPs
(kind ``memory``; slices read only what they keep). Lowering localizes the parameters that
spell out global sizes (``shape``, ``new_sizes``, ``slice_sizes``, ``limit_indices``).

``rotate[dimension, shift]`` (``jnp.roll`` of one dim by a static shift: ``y[i] = x[(i - shift) mod n]``)
is not a jax primitive: the tracer finds the two forms jax writes it in, the concatenation of two
slices and its transpose (:mod:`partir_emu.compiler.tracing.idioms`). Its rule shares every dim, the
rotated one too, and lets pending sums through (it is linear); a tiled rotated dim is lowered to a
``collective_permute`` of whole blocks (:mod:`partir_emu.compiler.lowering.rotate`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import np_dtype
from partir_emu.core.factors import Dims, FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import LocalizeFn, Primitive, register
from partir_emu.primitives.costs import Cost, copy_cost, nbytes_of, read_what_you_keep_cost, write_only_cost


# -- rules ------------------------------------------------------------------------------
def broadcast_rule(eqn: Eqn) -> FactorRule:
    x, out = eqn.inputs[0], eqn.outputs[0]
    bd = eqn.params["broadcast_dimensions"]
    b = RuleBuilder()
    odims = list(b.fresh_dims(out.shape))
    xdims = []
    for i, od in enumerate(bd):
        if x.shape[i] == out.shape[od]:
            xdims.append(odims[od])
        else:  # a size-1 dim broadcast up
            xdims.append((b.new(1),))
    ops = [xdims] + [() for _ in eqn.inputs[1:]]
    return b.rule(ops, [odims])


def reshape_factors(b: RuleBuilder, ishape, oshape) -> tuple[Dims, Dims]:
    """A common refinement of two row-major shapes of equal size: each dim becomes
    the tuple of factors it is made of. Where no contiguous refinement exists
    (e.g. [2,3]->[3,2]) the dims of that segment get unrelated blocked factors."""
    idims: list[list[int]] = [[] for _ in ishape]
    odims: list[list[int]] = [[] for _ in oshape]
    i = o = 0
    ri = ishape[0] if ishape else 1     # what is left of input dim i / output dim o
    ro = oshape[0] if oshape else 1
    while i < len(ishape) and o < len(oshape):
        if ishape[i] == 1 and not idims[i]:
            idims[i].append(b.new(1))
            i += 1
            ri = ishape[i] if i < len(ishape) else 1
        elif oshape[o] == 1 and not odims[o]:
            odims[o].append(b.new(1))
            o += 1
            ro = oshape[o] if o < len(oshape) else 1
        elif ri % ro == 0 or ro % ri == 0:
            f = b.new(min(ri, ro))
            idims[i].append(f)
            odims[o].append(f)
            ri, ro = ri // min(ri, ro), ro // min(ri, ro)
            if ri == 1:
                i += 1
                ri = ishape[i] if i < len(ishape) else 1
            if ro == 1:
                o += 1
                ro = oshape[o] if o < len(oshape) else 1
        else:
            # no contiguous refinement: block the rest of both sides
            for k in range(i, len(ishape)):
                idims[k].append(b.new(ri if k == i else ishape[k], blocked=True))
            for k in range(o, len(oshape)):
                odims[k].append(b.new(ro if k == o else oshape[k], blocked=True))
            i, o = len(ishape), len(oshape)
    for dims, shape, start in ((idims, ishape, i), (odims, oshape, o)):
        for k in range(start, len(shape)):   # trailing size-1 dims
            if not dims[k]:
                dims[k].append(b.new(1))
    return tuple(tuple(d) for d in idims), tuple(tuple(d) for d in odims)


def reshape_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    x = eqn.inputs[0]
    perm = eqn.params.get("dimensions") or tuple(range(x.ndim))   # reshape of transpose(x, perm)
    tdims, odims = reshape_factors(b, tuple(x.shape[d] for d in perm), eqn.outputs[0].shape)
    idims = [tdims[perm.index(d)] for d in range(x.ndim)]
    return b.rule([idims] + [() for _ in eqn.inputs[1:]], [odims], linear=True)


def transpose_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    xdims = b.fresh_dims(eqn.inputs[0].shape)
    return b.rule([xdims], [[xdims[p] for p in eqn.params["permutation"]]], linear=True)


def squeeze_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    x = eqn.inputs[0]
    drop = {d % x.ndim for d in eqn.params["dimensions"]}
    xdims = b.fresh_dims(x.shape)
    return b.rule([xdims], [[d for i, d in enumerate(xdims) if i not in drop]], linear=True)


def expand_dims_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    odims = b.fresh_dims(eqn.outputs[0].shape)
    new = {d % len(odims) for d in eqn.params["dimensions"]}
    return b.rule([[d for i, d in enumerate(odims) if i not in new]], [odims], linear=True)


def _same_or_blocked(b: RuleBuilder, ins, out, changed) -> tuple[list, list]:
    """Dims in ``changed`` get separate blocked factors; the rest are shared."""
    odims: list = []
    idims_all: list[list] = [[] for _ in ins]
    for d, n in enumerate(out.shape):
        if d in changed:
            odims.append((b.new(n, blocked=True),))
            for k, x in enumerate(ins):
                idims_all[k].append((b.new(x.shape[d], blocked=True),))
        else:
            f = (b.new(n),)
            odims.append(f)
            for k in range(len(ins)):
                idims_all[k].append(f)
    return idims_all, odims


def concatenate_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    ins, odims = _same_or_blocked(b, eqn.inputs, eqn.outputs[0], {eqn.params["dimension"]})
    return b.rule(ins, [odims])


def windowed_rule(eqn: Eqn) -> FactorRule:
    x, out = eqn.inputs[0], eqn.outputs[0]
    if eqn.prim == "rev":
        changed = set(eqn.params["dimensions"])
    elif eqn.prim == "dynamic_update_slice":
        upd = eqn.inputs[1]
        changed = {d for d in range(x.ndim) if upd.shape[d] != x.shape[d]}
    elif eqn.prim == "pad":
        changed = {d for d, cfg in enumerate(eqn.params["padding_config"]) if any(cfg)}
    else:
        changed = {d for d in range(x.ndim) if x.shape[d] != out.shape[d]}
        if eqn.prim == "slice" and eqn.params.get("strides"):
            changed |= {d for d, s in enumerate(eqn.params["strides"]) if s not in (None, 1)}
    b = RuleBuilder()
    tensors = [x] + ([eqn.inputs[1]] if eqn.prim == "dynamic_update_slice" else [])
    ins, odims = _same_or_blocked(b, tensors, out, changed)
    ops = ins + [() for _ in eqn.inputs[len(tensors):]]
    return b.rule(ops, [odims])


def split_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    x = eqn.inputs[0]
    ax = eqn.params["axis"]
    xdims = [(b.new(n, blocked=(i == ax)),) for i, n in enumerate(x.shape)]
    outs = []
    for o in eqn.outputs:
        outs.append([xdims[i] if i != ax else (b.new(o.shape[i], blocked=True),) for i in range(o.ndim)])
    return b.rule([xdims], outs)


def stack_rule(eqn: Eqn) -> FactorRule:
    """Operands of one shape; the new dim ``axis`` is blocked (each operand is one block of it)."""
    b = RuleBuilder()
    xdims = b.fresh_dims(eqn.inputs[0].shape)
    ax = eqn.params["axis"]
    odims = [*xdims[:ax], (b.new(len(eqn.inputs), blocked=True),), *xdims[ax:]]
    return b.rule([xdims] * len(eqn.inputs), [odims])


def unstack_rule(eqn: Eqn) -> FactorRule:
    """The inverse of stack: the unstacked dim is blocked, the others are shared with every result."""
    b = RuleBuilder()
    ax = eqn.params["axis"]
    xdims = [(b.new(n, blocked=(i == ax)),) for i, n in enumerate(eqn.inputs[0].shape)]
    return b.rule([xdims], [[d for i, d in enumerate(xdims) if i != ax]] * len(eqn.outputs))


def tile_rule(eqn: Eqn) -> FactorRule:
    """A dim repeated ``reps > 1`` times is blocked (a device's block of the result is not the
    repetition of its block of the operand); dims with ``reps == 1`` are shared."""
    b = RuleBuilder()
    x, out = eqn.inputs[0], eqn.outputs[0]
    changed = {d for d, r in enumerate(eqn.params["reps"]) if r != 1}
    ins, odims = _same_or_blocked(b, [x], out, changed)
    return b.rule(ins, [odims])


def rotate_rule(eqn: Eqn) -> FactorRule:
    """Every dim shared by operand and result, the rotated one included (see the module docstring)."""
    b = RuleBuilder()
    dims = b.fresh_dims(eqn.inputs[0].shape)
    return b.rule([dims], [dims], linear=True)


def iota_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    return b.rule([], [b.fresh_dims(eqn.outputs[0].shape, blocked=True)])


# -- impls ------------------------------------------------------------------------------
def _broadcast_in_dim(x: Any, shape: Sequence[int], broadcast_dimensions: Sequence[int], **_: Any) -> np.ndarray:
    x = np.asarray(x)
    expanded = [1] * len(shape)
    for src, dst in enumerate(broadcast_dimensions):
        expanded[dst] = x.shape[src]
    return np.broadcast_to(x.reshape(expanded), tuple(shape))


def _reshape(x: np.ndarray, new_sizes: Sequence[int], dimensions: Sequence[int] | None = None, **_: Any) -> np.ndarray:
    if dimensions is not None:
        x = np.transpose(x, dimensions)
    return np.reshape(x, tuple(new_sizes))


def _slice(x: np.ndarray, start_indices: Sequence[int], limit_indices: Sequence[int],
           strides: Sequence[int] | None = None, **_: Any) -> np.ndarray:
    strides = strides or (1,) * len(start_indices)
    return x[tuple(slice(s, e, k) for s, e, k in zip(start_indices, limit_indices, strides))]


def _pad(x: np.ndarray, padval: Any, padding_config: Sequence[Sequence[int]], **_: Any) -> np.ndarray:
    """lax.pad: (low, high, interior) per dim; low/high may be negative (crop)."""
    x = np.asarray(x)
    full, place, crop = [], [], []
    for n, (lo, hi, interior) in zip(x.shape, padding_config):
        inner = n + max(n - 1, 0) * interior
        size = max(lo, 0) + inner + max(hi, 0)
        full.append(size)
        place.append(slice(max(lo, 0), max(lo, 0) + inner, interior + 1))
        crop.append(slice(max(-lo, 0), size - max(-hi, 0)))
    out = np.full(full, padval, dtype=x.dtype)
    out[tuple(place)] = x
    return out[tuple(crop)]


def _clamped_starts(shape: Sequence[int], sizes: Sequence[int], starts: Sequence[Any]) -> list[int]:
    # lax clamps dynamic start indices so that the slice fits in the operand
    return [min(max(int(s), 0), n - k) for s, n, k in zip(starts, shape, sizes)]


def _dynamic_slice(x: np.ndarray, *starts: Any, slice_sizes: Sequence[int], **_: Any) -> np.ndarray:
    st = _clamped_starts(x.shape, slice_sizes, starts)
    return x[tuple(slice(s, s + k) for s, k in zip(st, slice_sizes))]


def _dynamic_update_slice(x: np.ndarray, update: Any, *starts: Any, **_: Any) -> np.ndarray:
    update = np.asarray(update)
    st = _clamped_starts(x.shape, update.shape, starts)
    out = np.array(x, copy=True)
    out[tuple(slice(s, s + k) for s, k in zip(st, update.shape))] = update
    return out


def _iota(*, dtype: str, shape: Sequence[int], dimension: int, **_: Any) -> np.ndarray:
    dt = np_dtype(dtype)
    r = np.arange(shape[dimension], dtype=dt if dt.kind in "iuf" else np.int64)
    expanded = [1] * len(shape)
    expanded[dimension] = shape[dimension]
    return np.broadcast_to(r.reshape(expanded), tuple(shape))


def _split(x: np.ndarray, sizes: Sequence[int], axis: int, **_: Any) -> list[np.ndarray]:
    bounds = np.cumsum(sizes)[:-1]
    return np.split(x, bounds, axis=axis)


def _dynamic_update_slice_cost(e: Eqn) -> Cost:
    # in place: read the update, write it into the operand's buffer (+ the index scalars)
    upd = nbytes_of(e.inputs[1])
    return 0.0, float(2 * upd + sum(nbytes_of(a) for a in e.inputs[2:]))


# -- localisation: parameters that spell out global sizes -------------------------------
def _set_to_result_shape(param: str) -> LocalizeFn:
    def localize(e: Eqn, ins: Sequence[Any], outs: Sequence[Any]) -> dict:
        return {**e.params, param: outs[0].shape}
    return localize


def _slice_localize(e: Eqn, ins: Sequence[Any], outs: Sequence[Any]) -> dict:
    """A slice that ran to the end of a tiled dim runs to the end of the local block."""
    g, loc = e.inputs[0].shape, ins[0].shape
    lim = tuple(lo if (gs != lo and li == gs) else li for li, gs, lo in zip(e.params["limit_indices"], g, loc))
    return {**e.params, "limit_indices": lim}


_ENTRIES: dict[str, tuple[Callable[[Eqn], FactorRule], Callable[..., Any], Callable[[Eqn], Cost],
                          LocalizeFn | None]] = {
    "broadcast_in_dim": (broadcast_rule, _broadcast_in_dim, copy_cost, _set_to_result_shape("shape")),
    "reshape": (reshape_rule, _reshape, copy_cost, _set_to_result_shape("new_sizes")),
    "transpose": (transpose_rule, lambda x, permutation, **_: np.transpose(x, permutation), copy_cost, None),
    "squeeze": (squeeze_rule, lambda x, dimensions, **_: np.squeeze(x, tuple(dimensions)), copy_cost, None),
    "expand_dims": (expand_dims_rule, lambda x, dimensions, **_: np.expand_dims(x, tuple(dimensions)),
                    copy_cost, None),
    "concatenate": (concatenate_rule,
                    lambda *xs, dimension, **_: np.concatenate([np.asarray(x) for x in xs], axis=dimension),
                    copy_cost, None),
    "slice": (windowed_rule, _slice, read_what_you_keep_cost, _slice_localize),
    "pad": (windowed_rule, _pad, copy_cost, None),
    "rev": (windowed_rule, lambda x, dimensions, **_: np.flip(x, tuple(dimensions)) if dimensions else x,
            copy_cost, None),
    "dynamic_slice": (windowed_rule, _dynamic_slice, read_what_you_keep_cost, _set_to_result_shape("slice_sizes")),
    "dynamic_update_slice": (windowed_rule, _dynamic_update_slice, _dynamic_update_slice_cost, None),
    "split": (split_rule, _split, copy_cost, None),
    "stack": (stack_rule, lambda *xs, axis, **_: np.stack([np.asarray(x) for x in xs], axis=axis), copy_cost, None),
    "unstack": (unstack_rule, lambda x, axis, **_: list(np.moveaxis(np.asarray(x), axis, 0)), copy_cost, None),
    "tile": (tile_rule, lambda x, reps, **_: np.tile(x, tuple(reps)), copy_cost, None),
    "iota": (iota_rule, _iota, write_only_cost, _set_to_result_shape("shape")),
}
register(*(Primitive(name, kind="memory", rule=rule, impl=impl, cost=cost, localize=loc)
           for name, (rule, impl, cost, loc) in _ENTRIES.items()))
# made by the tracer from the slices and concatenation jax writes (not a jaxpr primitive)
register(Primitive("rotate", kind="memory", rule=rotate_rule, cost=copy_cost, traceable=False,
                   impl=lambda x, shift, dimension, **_: np.roll(x, shift, axis=dimension)))
