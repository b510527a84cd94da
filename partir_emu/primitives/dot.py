"""dot_general: batch dims shared, free dims to the result, contracting dims reduce."""
from __future__ import annotations

from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.primitives import register


@register("dot_general")
def dot_general_rule(eqn: Eqn) -> FactorRule:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.inputs
    b = RuleBuilder()
    ldims: list = [None] * lhs.ndim
    rdims: list = [None] * rhs.ndim
    out = []
    for i, j in zip(lb, rb):
        f = b.new(lhs.shape[i])
        ldims[i] = rdims[j] = (f,)
        out.append((f,))
    for i, j in zip(lc, rc):
        f = b.new(lhs.shape[i])
        ldims[i] = rdims[j] = (f,)
    for dims, x in ((ldims, lhs), (rdims, rhs)):
        for i in range(x.ndim):
            if dims[i] is None:
                f = b.new(x.shape[i])
                dims[i] = (f,)
                out.append((f,))
    return b.rule([ldims, rdims], [out])
