"""Elementwise primitives: unary, binary, select_n, clamp, conversions.

Sharding rule ``ij,ij->ij`` (scalar operands have no dims; a size-1 dim broadcast implicitly,
as lax allows for rank-equal operands, gets a factor of its own); pending sums pass through the
linear ones. numpy impls with ``jax.lax`` semantics (the interpreter casts each result to the
equation's dtype, so an impl may compute in a wider type: ``erf`` computes in float64). Cost:
1 FLOP per output element, except the copies and conversions, which are memory ops.

bfloat16 / float16: each op is computed in float32 and rounded to the narrow type (ml_dtypes'
ufuncs do that, as XLA CPU does); ``integer_pow`` multiplies as jax lowers it (square and
multiply, each product rounded) and ``rsqrt`` rounds once. ``convert_element_type`` to bfloat16
rounds to nearest even (ml_dtypes' cast). With these, single bfloat16 ops equal jax.jit on CPU
bit for bit (tests/integration/test_bf16_runtime.py); ``erf``/``erfc`` computed in float64 and rounded once
agree as well on the values tested. Chains can still differ by a bfloat16 ulp where XLA keeps a
fused intermediate in float32 without rounding it (seen: the argument of ``erfc`` in exact GELU).

**Special.** Special functions numpy lacks (scipy is not a runtime dependency): erf, erfc, erf⁻¹ in float64.

Used by the elementwise entries ``erf``, ``erfc`` and ``erf_inv``; the interpreter casts the
float64 result to the equation's dtype.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from partir_emu.core.dtypes import is_float, is_low_float, np_dtype
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.primitives.costs import copy_cost, elementwise_cost

Impl = Callable[..., Any]

# Pending sums pass through these unchanged (linear in every operand).
LINEAR = {"add", "add_any", "sub", "neg", "copy", "copy_p", "convert_element_type"}
# Filed as memory traffic, not arithmetic, by the hardware models.
MEMORY = {"copy", "copy_p", "convert_element_type", "reduce_precision", "stop_gradient"}


def elementwise_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    out = eqn.outputs[0]
    dims = b.fresh_dims(out.shape)
    ops: list[tuple] = []
    for a in eqn.inputs:
        if a.ndim != out.ndim:   # a scalar operand
            ops.append(())
        else:   # lax broadcasts size-1 dims implicitly (rank-equal operands)
            ops.append(tuple(d if n == m else (b.new(1),) for d, n, m in zip(dims, a.shape, out.shape)))
    linear = eqn.prim in LINEAR and not (eqn.prim == "convert_element_type"
                                         and not eqn.params.get("new_dtype", "").startswith(("float", "bfloat")))
    return b.rule(ops, [dims], linear=linear)


# -- special -----------------------------------------------------------------------------------------
_T = (9.60497373987051638749e0, 9.00260197203842689217e1, 2.23200534594684319226e3,
      7.00332514112805075473e3, 5.55923013010394962768e4)
_U = (3.35617141647503099647e1, 5.21357949780152679795e2, 4.59432382970980127987e3,
      2.26290000613890934246e4, 4.92673942608635921086e4)
_P = (2.46196981473530512524e-10, 5.64189564831068821977e-1, 7.46321056442269912687e0,
      4.86371970985681366614e1, 1.96520832956077098242e2, 5.26445194995477358631e2,
      9.34528527171957607540e2, 1.02755188689515710272e3, 5.57535335369399327526e2)
_Q = (1.32281951154744992508e1, 8.67072140885989742329e1, 3.54937778887819891062e2,
      9.75708501743205489753e2, 1.82390916687909736289e3, 2.24633760818710981792e3,
      1.65666309194161350182e3, 5.57535340817727675546e2)
_R = (5.64189583547755073984e-1, 1.27536670759978104416e0, 5.01905042251180477414e0,
      6.16021097993053585195e0, 7.40974269950448939160e0, 2.97886665372100240670e0)
_S = (2.26052863220117276590e0, 9.39603524938001434673e0, 1.20489539808096656605e1,
      1.70814450747565897222e1, 9.60896809063285878198e0, 3.36907645100081516050e0)


def _polevl(x: np.ndarray, c: tuple[float, ...], monic: bool = False) -> np.ndarray:
    y = x + c[0] if monic else np.full_like(x, c[0])
    for k in c[1:]:
        y = y * x + k
    return y


def _erf_inner(x: np.ndarray) -> np.ndarray:
    xi = np.clip(x, -1.0, 1.0)
    z = xi * xi
    return xi * _polevl(z, _T) / _polevl(z, _U, monic=True)


def _erfc_tail(a: np.ndarray) -> np.ndarray:
    """erfc(|x|) for |x| >= 1 (smaller |x| are clipped to 1; erfc(30) underflows already)."""
    ao = np.clip(a, 1.0, 30.0)
    tail = np.where(ao < 8.0, _polevl(ao, _P) / _polevl(ao, _Q, monic=True),
                    _polevl(ao, _R) / _polevl(ao, _S, monic=True))
    return np.exp(-ao * ao) * tail


def erf64(x: np.ndarray) -> np.ndarray:
    """erf in float64 for any real array (NaN stays NaN, ±inf → ±1)."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    outer = np.copysign(1.0 - _erfc_tail(a), x)
    return np.where(a <= 1.0, _erf_inner(x), outer) + np.where(np.isnan(x), x, 0.0)


def erfc64(x: np.ndarray) -> np.ndarray:
    """erfc in float64, accurate in the tail (not computed as 1 - erf there)."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    t = _erfc_tail(a)
    outer = np.where(x > 0, t, 2.0 - t)
    return np.where(a <= 1.0, 1.0 - _erf_inner(x), outer) + np.where(np.isnan(x), x, 0.0)


def erf_inv64(x: np.ndarray) -> np.ndarray:
    """erf⁻¹ in float64: Giles' single-precision approximation, then Newton steps."""
    x = np.asarray(x, np.float64)
    w = -np.log((1.0 - x) * (1.0 + x))
    w1 = w - 2.5
    p1: np.ndarray | float = 2.81022636e-08
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
              -0.00417768164, 0.246640727, 1.50140941):
        p1 = c + p1 * w1
    w2 = np.sqrt(w) - 3.0
    p2: np.ndarray | float = -0.000200214257
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
              0.00943887047, 1.00167406, 2.83297682):
        p2 = c + p2 * w2
    y = np.where(w < 5.0, p1, p2) * x
    finite = np.abs(x) < 1.0
    ys = np.where(finite, y, 0.0)
    for _ in range(2):
        ys = ys - (erf64(ys) - np.where(finite, x, 0.0)) / (2.0 / math.sqrt(math.pi) * np.exp(-ys * ys))
    out = np.where(finite, ys, np.where(np.abs(x) == 1.0, np.copysign(np.inf, x), np.nan))
    return out


def _unary(f: Callable[[np.ndarray], np.ndarray]) -> Impl:
    return lambda x, **_: f(x)


def _binary(f: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Impl:
    return lambda x, y, **_: f(x, y)


# -- impls ------------------------------------------------------------------------------
def _div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype.kind in "iu" and np.result_type(x, y).kind in "iu":
        q = np.floor_divide(x, y)
        if x.dtype.kind == "i":  # lax.div rounds toward zero, numpy floors
            q = q + ((np.remainder(x, y) != 0) & ((x < 0) != (y < 0)))
        return q
    return np.true_divide(x, y)


def _round(x: np.ndarray, rounding_method: Any = 0, **_: Any) -> np.ndarray:
    # lax.RoundingMethod: 0 / AWAY_FROM_ZERO, 1 / TO_NEAREST_EVEN
    if rounding_method in (1, "TO_NEAREST_EVEN"):
        return np.round(x)
    a = np.abs(x)
    fl = np.floor(a)
    # compare the exact fraction with 0.5 (floor(a + 0.5) rounds 0.49999997 up in float32)
    return np.copysign(np.where(a - fl >= 0.5, fl + 1, fl), x)


def _logistic(x: np.ndarray, **_: Any) -> np.ndarray:
    one = np.asarray(1, x.dtype)
    return one / (one + np.exp(-x))


def _integer_pow(x: np.ndarray, y: int, **_: Any) -> np.ndarray:
    x = np.asarray(x)
    if is_float(x.dtype):  # jax's lowering: square-and-multiply, each product rounded to x's dtype
        acc = _pow_by_squaring(x, abs(y))
        return acc if y >= 0 else np.asarray(1, x.dtype) / acc
    if y >= 0:
        return np.power(x, y)
    return np.power(x.astype(np.float64), y)


def _pow_by_squaring(x: np.ndarray, y: int) -> np.ndarray:
    acc: np.ndarray | None = None
    while y > 0:
        if y & 1:
            acc = x if acc is None else acc * x
        y >>= 1
        if y:
            x = x * x
    return np.ones_like(x) if acc is None else acc


def _rsqrt(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if is_low_float(x.dtype):  # one float32 rsqrt rounded once (as XLA), not a rounded sqrt then a division
        x = x.astype(np.float32)
    return np.asarray(1, x.dtype) / np.sqrt(x)


def _pow(x: Any, y: Any, **_: Any) -> np.ndarray:
    if isinstance(y, (int, float)):  # a weak literal exponent takes x's dtype
        return np.power(x, y)
    x, y = np.asarray(x), np.asarray(y)
    if is_float(x.dtype) and y.dtype.kind in "iu":  # lax.pow(float, int): stay in x's dtype
        y = y.astype(x.dtype)
    return np.power(x, y)


def _select_n(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    which = np.asarray(which)
    if which.dtype == np.bool_:
        assert len(cases) == 2, "select_n with a bool predicate takes two cases"
        return np.where(which, cases[1], cases[0])
    out = cases[0]
    for i, c in enumerate(cases[1:], start=1):
        out = np.where(which == i, c, out)
    return out


def _clamp(lo: np.ndarray, x: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(x, lo), hi)


def _convert(x: np.ndarray, new_dtype: str, **_: Any) -> np.ndarray:
    x = np.asarray(x)
    dt = np_dtype(new_dtype)
    if dt.kind in "iu" and is_float(x.dtype):
        # XLA saturates float→int and maps NaN to 0; numpy's cast is undefined there
        info = np.iinfo(dt)
        f = x.astype(np.float64)
        out = np.trunc(np.where(np.isnan(f), 0.0, np.clip(f, info.min, info.max)))
        res = out.astype(dt)
        res = np.where(f >= float(info.max), info.max, res)
        return np.where(f <= float(info.min), info.min, res).astype(dt)
    if dt == np.bool_:
        return x != 0
    return x.astype(dt)


_FLOAT_BITS = {  # dtype name → (total bits, exponent bits, mantissa bits, uint dtype)
    "float16": (16, 5, 10, np.uint16), "bfloat16": (16, 8, 7, np.uint16),
    "float32": (32, 8, 23, np.uint32), "float64": (64, 11, 52, np.uint64),
}


def _reduce_precision(x: np.ndarray, exponent_bits: int, mantissa_bits: int, **_: Any) -> np.ndarray:
    """XLA's ReducePrecision: round the mantissa to nearest-even, flush out-of-range exponents."""
    nbits, src_exp, src_mant, udt = _FLOAT_BITS[x.dtype.name]
    bits = np.ascontiguousarray(x).view(udt).copy()
    one: Any = udt(1)
    if mantissa_bits < src_mant:
        shift = udt(src_mant - mantissa_bits)
        last = one << shift
        bias = (last >> one) - one
        bits = (bits + (((bits & last) >> shift) + bias)) & ~(last - one)
    if exponent_bits < src_exp:
        sign = one << udt(nbits - 1)
        exp_mask = ((one << udt(src_exp)) - one) << udt(src_mant)
        exp_bias = (1 << (src_exp - 1)) - 1
        red_bias = (1 << (exponent_bits - 1)) - 1
        e = bits & exp_mask
        overflow = e > udt((exp_bias + red_bias) << src_mant)
        underflow = e <= udt((exp_bias - red_bias) << src_mant)
        signed_zero = bits & sign
        bits = np.where(overflow, signed_zero | exp_mask, np.where(underflow, signed_zero, bits)).astype(udt)
    out = bits.view(x.dtype)
    return np.where(np.isnan(x), x, out) if mantissa_bits < src_mant else out


IMPLS: dict[str, Impl] = {
    "neg": _unary(np.negative),
    "exp": _unary(np.exp),
    "exp2": _unary(np.exp2),
    "log": _unary(np.log),
    "log1p": _unary(np.log1p),
    "expm1": _unary(np.expm1),
    "tanh": _unary(np.tanh),
    "logistic": _logistic,
    "erf": _unary(erf64),
    "erfc": _unary(erfc64),
    "erf_inv": _unary(erf_inv64),
    "rsqrt": _unary(_rsqrt),
    "sqrt": _unary(np.sqrt),
    "cbrt": _unary(np.cbrt),
    "abs": _unary(np.abs),
    "sign": _unary(lambda x: np.where(x == 0, x, np.sign(x))),   # XLA keeps the zero's sign: sign(-0.0) = -0.0
    "floor": _unary(np.floor),
    "ceil": _unary(np.ceil),
    "round": _round,
    "not": _unary(np.invert),
    "sin": _unary(np.sin),
    "cos": _unary(np.cos),
    "tan": _unary(np.tan),
    "asin": _unary(np.arcsin),
    "acos": _unary(np.arccos),
    "atan": _unary(np.arctan),
    "sinh": _unary(np.sinh),
    "cosh": _unary(np.cosh),
    "asinh": _unary(np.arcsinh),
    "acosh": _unary(np.arccosh),
    "atanh": _unary(np.arctanh),
    "is_finite": _unary(np.isfinite),
    "integer_pow": _integer_pow,
    "square": _unary(np.square),
    "stop_gradient": _unary(lambda x: x),
    "copy": _unary(np.copy),
    "copy_p": _unary(np.copy),
    "convert_element_type": _convert,
    "reduce_precision": _reduce_precision,
    "add": _binary(np.add),
    "add_any": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "div": _binary(_div),
    "rem": _binary(np.fmod),  # lax.rem takes the sign of the dividend (C fmod), ints too
    "pow": _pow,
    "max": _binary(np.maximum),
    "min": _binary(np.minimum),
    "and": _binary(np.bitwise_and),
    "or": _binary(np.bitwise_or),
    "xor": _binary(np.bitwise_xor),
    "eq": _binary(np.equal),
    "ne": _binary(np.not_equal),
    "lt": _binary(np.less),
    "le": _binary(np.less_equal),
    "gt": _binary(np.greater),
    "ge": _binary(np.greater_equal),
    "atan2": _binary(np.arctan2),
    "nextafter": _binary(np.nextafter),
    "select_n": lambda which, *cases, **_: _select_n(which, *cases),
    "clamp": lambda lo, x, hi, **_: _clamp(lo, x, hi),
}

# every elementwise op shares the rule; the kind and cost depend only on MEMORY
register(*(Primitive(name, kind="memory" if name in MEMORY else "elementwise", rule=elementwise_rule, impl=impl,
                     cost=copy_cost if name in MEMORY else elementwise_cost)
           for name, impl in IMPLS.items()))
