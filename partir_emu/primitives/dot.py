"""dot_general: batch dims shared, free dims to the result, contracting dims reduce.

bfloat16 / float16 operands are multiplied and summed in float32 and the result rounded to the
output dtype (round-to-nearest-even), which is what XLA CPU does with them.

Cost ``2·batch·M·N·K`` FLOPs at the matrix unit's rate (kind ``matmul``).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from partir_emu.core.dtypes import is_low_float, np_dtype
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.primitives._costs import Cost, in_bytes, out_bytes
from partir_emu.primitives.matmul import matmul


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


def _dot_general(lhs: np.ndarray, rhs: np.ndarray, *, dimension_numbers: Any,
                 preferred_element_type: str | None = None, **_: Any) -> np.ndarray:
    """Output dims: batch, lhs free, rhs free (each in operand order), as lax.dot_general."""
    (lc, rc), (lb, rb) = dimension_numbers
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    if preferred_element_type is not None:  # accumulate in the requested type
        dt = np_dtype(preferred_element_type)
        lhs, rhs = lhs.astype(dt, copy=False), rhs.astype(dt, copy=False)
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    bshape = [lhs.shape[d] for d in lb]
    lfs, rfs = [lhs.shape[d] for d in lf], [rhs.shape[d] for d in rf]
    csize = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
    b, m, n = int(np.prod(bshape, dtype=np.int64)), int(np.prod(lfs, dtype=np.int64)), int(np.prod(rfs, dtype=np.int64))
    lt = np.transpose(lhs, (*lb, *lf, *lc)).reshape(b, m, csize)
    rt = np.transpose(rhs, (*rb, *rc, *rf)).reshape(b, csize, n)
    if lt.dtype == np.bool_:  # a bool contraction is an "or" of "and"s
        out = np.matmul(lt.astype(np.int32), rt.astype(np.int32)) != 0
    elif is_low_float(lt.dtype) or is_low_float(rt.dtype):
        # as XLA CPU: products summed in float32 (BLAS), rounded once to the output dtype by the
        # interpreter; numpy's own bfloat16 matmul has no BLAS and is orders of magnitude slower
        out = matmul(lt.astype(np.float32), rt.astype(np.float32))
    else:
        out = matmul(lt, rt)
    return out.reshape((*bshape, *lfs, *rfs))


def dot_general_cost(e: Eqn) -> Cost:
    lhs, rhs = e.inputs[0], e.inputs[1]
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    batch = math.prod(lhs.shape[i] for i in lb)
    k = math.prod(lhs.shape[i] for i in lc)
    m = math.prod(s for i, s in enumerate(lhs.shape) if i not in lc and i not in lb)
    n = math.prod(s for i, s in enumerate(rhs.shape) if i not in rc and i not in rb)
    return float(2 * batch * m * n * k), float(in_bytes(e) + out_bytes(e))


register(Primitive("dot_general", kind="matmul", rule=dot_general_rule, impl=_dot_general, cost=dot_general_cost,
                   summands=(0, 1)))
