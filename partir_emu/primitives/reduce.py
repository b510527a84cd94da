"""Reductions and scans. Tiling a summed dim makes the result partial; the
reduced dim of max/min/argmax/prod and a scanned dim are blocked."""
from __future__ import annotations

from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.primitives import register


@register("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin")
def reduce_rule(eqn: Eqn) -> FactorRule:
    x = eqn.inputs[0]
    axes = set(eqn.params["axes"])
    b = RuleBuilder()
    summed = eqn.prim == "reduce_sum"
    dims = [(b.new(n, blocked=(i in axes and not summed)),) for i, n in enumerate(x.shape)]
    out = [d for i, d in enumerate(dims) if i not in axes]
    return b.rule([dims], [out], linear=summed)


@register("cumsum", "cumprod", "cummax", "cummin")
def scan_rule(eqn: Eqn) -> FactorRule:
    x = eqn.inputs[0]
    b = RuleBuilder()
    dims = [(b.new(n, blocked=(i == eqn.params["axis"])),) for i, n in enumerate(x.shape)]
    return b.rule([dims], [dims])
