"""Elementwise primitives: ``ij,ij->ij`` (scalar operands have no dims; a size-1 dim
broadcast implicitly, as lax allows for rank-equal operands, gets a factor of its own)."""
from __future__ import annotations

from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.primitives import register

UNARY = """neg exp exp2 log log1p expm1 tanh logistic erf erfc erf_inv rsqrt sqrt cbrt abs sign floor ceil round not
sin cos tan is_finite integer_pow square stop_gradient copy copy_p convert_element_type reduce_precision""".split()
BINARY = "add add_any sub mul div rem pow max min and or xor eq ne lt le gt ge atan2 nextafter".split()
OTHER = ["select_n", "clamp"]
# Pending sums pass through these unchanged (linear in every operand).
LINEAR = {"add", "add_any", "sub", "neg", "copy", "copy_p", "convert_element_type"}


@register(*UNARY, *BINARY, *OTHER)
def elementwise_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    out = eqn.outputs[0]
    dims = b.fresh_dims(out.shape)
    ops = []
    for a in eqn.inputs:
        if a.ndim != out.ndim:   # a scalar operand
            ops.append(())
        else:   # lax broadcasts size-1 dims implicitly (rank-equal operands)
            ops.append(tuple(d if n == m else (b.new(1),) for d, n, m in zip(dims, a.shape, out.shape)))
    linear = eqn.prim in LINEAR and not (eqn.prim == "convert_element_type"
                                         and not eqn.params.get("new_dtype", "").startswith(("float", "bfloat")))
    return b.rule(ops, [dims], linear=linear)
