"""Per-primitive cost rules: the FLOPs and HBM bytes of one equation (local shapes).

One table, ``cost_rules``, keyed by primitive name (jax's names plus the SPMD
collectives); each rule maps an :class:`~partir_emu.core.ir.Eqn` to
``(flops, hbm_bytes)``. ``op_kind`` files every primitive under one kind
(``matmul``, ``elementwise``, ``reduction``, ``memory``, ``collective``,
``free``) for the report and for the rate it runs at (matmuls at the chip's
matrix peak for their dtype, everything else at ``vector_flops_per_s``).

Conventions (no fusion is modelled: every equation reads its operands from
HBM and writes its results back):

- elementwise ops: 1 FLOP per output element; bytes = operands + results.
- ``dot_general``: ``2·batch·M·N·K`` FLOPs; bytes = operands + result.
- reductions and cumulative ops: 1 FLOP per input element.
- layout ops (reshape, transpose, broadcast, concatenate, pad, ...): 0 FLOPs,
  bytes = operands + results. Slicing ops read only what they keep
  (2 × result); in-place updates (``dynamic_update_slice``, ``scatter-add``)
  touch only the update region.
- communicating collectives cost 0 here: the communication model prices them.
  ``all_slice`` and ``to_partial`` are local memory ops.

A primitive without a rule raises :class:`UnsupportedPrimitiveError` naming it.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from partir_emu.core.ir import Eqn, Var, itemsize
from partir_emu.errors import UnsupportedPrimitiveError

CostRule = Callable[[Eqn], tuple[float, float]]
cost_rules: dict[str, CostRule] = {}
op_kind: dict[str, str] = {}

KINDS = ("matmul", "elementwise", "reduction", "memory", "collective", "free")


_NB: dict[tuple[tuple[int, ...], str], int] = {}


def nbytes_of(v) -> int:
    """Bytes of a Var's buffer (memoized by shape and dtype; Literals take none)."""
    if type(v) is not Var:
        return 0
    key = (v.shape, v.dtype)
    n = _NB.get(key)
    if n is None:
        n = _NB[key] = math.prod(v.shape) * itemsize(v.dtype)
    return n


class _ItemSize(dict):
    def __missing__(self, dtype: str) -> int:
        self[dtype] = n = itemsize(dtype)
        return n


_ITEMSIZE = _ItemSize()


def _elems(v) -> int:
    return math.prod(v.shape)


def _in_bytes(e: Eqn) -> int:
    ins = e.inputs
    if len(ins) == 1:
        return nbytes_of(ins[0])
    if len(ins) == 2:
        a, b = ins
        return nbytes_of(a) if a is b or a == b else nbytes_of(a) + nbytes_of(b)
    seen: set[int] = set()
    total = 0
    for a in ins:
        if type(a) is Var and a.id not in seen:
            seen.add(a.id)
            total += nbytes_of(a)
    return total


def _out_bytes(e: Eqn) -> int:
    outs = e.outputs
    if len(outs) == 1:
        return nbytes_of(outs[0])
    return sum(nbytes_of(o) for o in outs)


_var_bytes = nbytes_of


def _elementwise(e: Eqn) -> tuple[float, float]:
    o = e.outputs[0]
    key = (o.shape, o.dtype)
    out = _NB.get(key)
    if out is None:
        out = nbytes_of(o)
    return float(out // _ITEMSIZE[o.dtype]), float(_in_bytes(e) + out)


def _reduction(e: Eqn) -> tuple[float, float]:
    return float(_elems(e.inputs[0])), float(_in_bytes(e) + _out_bytes(e))


def _copy(e: Eqn) -> tuple[float, float]:
    return 0.0, float(_in_bytes(e) + _out_bytes(e))


def _read_what_you_keep(e: Eqn) -> tuple[float, float]:
    # slice/dynamic_slice/gather/all_slice: read the kept region (+ index operands), write the result
    idx = sum(_var_bytes(a) for a in e.inputs[1:])
    return 0.0, float(2 * _out_bytes(e) + idx)


def _write_only(e: Eqn) -> tuple[float, float]:
    return 0.0, float(_out_bytes(e))


def _free(e: Eqn) -> tuple[float, float]:
    return 0.0, 0.0


def _dynamic_update_slice(e: Eqn) -> tuple[float, float]:
    # in place: read the update, write it into the operand's buffer (+ the index scalars)
    upd = _var_bytes(e.inputs[1])
    return 0.0, float(2 * upd + sum(_var_bytes(a) for a in e.inputs[2:]))


def _scatter_add(e: Eqn) -> tuple[float, float]:
    # operand, indices, updates: read updates and indices, read-modify-write the touched rows
    idx, upd = _var_bytes(e.inputs[1]), _var_bytes(e.inputs[2])
    return float(_elems(e.inputs[2])), float(idx + 3 * upd)


def _dot_general(e: Eqn) -> tuple[float, float]:
    lhs, rhs = e.inputs[0], e.inputs[1]
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    batch = math.prod(lhs.shape[i] for i in lb)
    k = math.prod(lhs.shape[i] for i in lc)
    m = math.prod(s for i, s in enumerate(lhs.shape) if i not in lc and i not in lb)
    n = math.prod(s for i, s in enumerate(rhs.shape) if i not in rc and i not in rb)
    return float(2 * batch * m * n * k), float(_in_bytes(e) + _out_bytes(e))


def _sort(e: Eqn) -> tuple[float, float]:
    x = e.inputs[0]
    dim = e.params.get("dimension", x.ndim - 1)
    n = x.shape[dim] if x.ndim else 1
    return float(_elems(x) * max(1, math.ceil(math.log2(max(n, 2))))), float(_in_bytes(e) + _out_bytes(e))


def _register(kind: str, rule: CostRule, names: str) -> None:
    for name in names.split():
        cost_rules[name] = rule
        op_kind[name] = kind


_register("elementwise", _elementwise, """
neg exp exp2 log log1p expm1 tanh logistic erf erf_inv rsqrt sqrt cbrt abs sign floor ceil round not
sin cos tan asin acos atan sinh cosh asinh acosh atanh is_finite integer_pow square
add add_any sub mul div rem pow max min and or xor eq ne lt le gt ge atan2 nextafter select_n clamp
shift_left shift_right_logical shift_right_arithmetic population_count clz erfc lgamma digamma igamma igammac
bessel_i0e bessel_i1e polygamma zeta regularized_incomplete_beta real imag conj complex""")
_register("reduction", _reduction, """
reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
cumsum cumprod cummax cummin cumlogsumexp""")
_register("reduction", _sort, "sort")
_register("matmul", _dot_general, "dot_general")
_register("memory", _copy, """
broadcast_in_dim reshape transpose squeeze expand_dims concatenate pad rev copy copy_p split
convert_element_type reduce_precision stop_gradient to_partial""")
_register("memory", _read_what_you_keep, "slice dynamic_slice gather all_slice")
_register("memory", _write_only, "iota")
_register("memory", _dynamic_update_slice, "dynamic_update_slice")
_register("memory", _scatter_add, "scatter-add scatter_add")
_register("free", _free, "axis_index")
_register("collective", _free, "all_gather all_reduce reduce_scatter all_to_all")


def eqn_cost(e: Eqn) -> tuple[float, float]:
    """``(flops, hbm_bytes)`` of one equation; raises UnsupportedPrimitiveError without a rule."""
    rule = cost_rules.get(e.prim)
    if rule is None:
        raise UnsupportedPrimitiveError(
            f"no cost rule for primitive {e.prim!r} (in `{e}`{', from ' + e.source if e.source else ''}); "
            f"add one to partir_emu.hwmodels.costs.cost_rules (and op_kind)")
    return rule(e)
