"""Shape primitives. Reshape uses compound factors (a dim made of several
factors, major→minor); dims that a slice, pad, concatenation or reversal
changes are blocked."""
from __future__ import annotations

from partir_emu.core.factors import Dims, FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.primitives import register


@register("broadcast_in_dim")
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


@register("reshape")
def reshape_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    idims, odims = reshape_factors(b, eqn.inputs[0].shape, eqn.outputs[0].shape)
    return b.rule([idims] + [() for _ in eqn.inputs[1:]], [odims], linear=True)


@register("transpose")
def transpose_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    xdims = b.fresh_dims(eqn.inputs[0].shape)
    return b.rule([xdims], [[xdims[p] for p in eqn.params["permutation"]]], linear=True)


@register("squeeze")
def squeeze_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    x = eqn.inputs[0]
    drop = {d % x.ndim for d in eqn.params["dimensions"]}
    xdims = b.fresh_dims(x.shape)
    return b.rule([xdims], [[d for i, d in enumerate(xdims) if i not in drop]], linear=True)


@register("expand_dims")
def expand_dims_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    odims = b.fresh_dims(eqn.outputs[0].shape)
    new = {d % len(odims) for d in eqn.params["dimensions"]}
    return b.rule([[d for i, d in enumerate(odims) if i not in new]], [odims], linear=True)


def _same_or_blocked(b: RuleBuilder, ins, out, changed) -> tuple[list, list]:
    """Dims in ``changed`` get separate blocked factors; the rest are shared."""
    odims, idims_all = [], [[] for _ in ins]
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


@register("concatenate")
def concatenate_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    ins, odims = _same_or_blocked(b, eqn.inputs, eqn.outputs[0], {eqn.params["dimension"]})
    return b.rule(ins, [odims])


@register("slice", "pad", "rev", "dynamic_slice", "dynamic_update_slice")
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


@register("split")
def split_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    x = eqn.inputs[0]
    ax = eqn.params["axis"]
    xdims = [(b.new(n, blocked=(i == ax)),) for i, n in enumerate(x.shape)]
    outs = []
    for o in eqn.outputs:
        outs.append([xdims[i] if i != ax else (b.new(o.shape[i], blocked=True),) for i in range(o.ndim)])
    return b.rule([xdims], outs)


@register("iota")
def iota_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    return b.rule([], [b.fresh_dims(eqn.outputs[0].shape, blocked=True)])
