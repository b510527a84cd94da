"""dot_general: batch dims shared, free dims to the result, contracting dims reduce.

bfloat16 / float16 operands are multiplied and summed in float32 and the result rounded to the
output dtype (round-to-nearest-even), which is what XLA CPU does with them.

Cost ``2·batch·M·N·K`` FLOPs at the matrix unit's rate (kind ``matmul``).

**Matmul.** The one matrix product that every contraction's numpy implementation calls (``dot_general``,
convolutions by im2col), and the two kernels it can run on.

- ``blas`` (the default): ``np.matmul``, i.e. OpenBLAS. The order in which it sums a row depends
  on the kernel OpenBLAS picks for the CPU (``OPENBLAS_CORETYPE`` Haswell, SkylakeX, Zen,
  Prescott, ...), on the matrix's shape (the edge tiles of its blocking) and on the number of
  threads (how the rows and columns are split among them). So two calls on the same shapes, in
  processes with the same thread count and kernel, agree bit for bit; a block of rows does not
  always round like the same rows inside the whole matrix.
- ``exact``: every result element is ``Σ_k a[..., i, k] · b[..., k, j]`` summed for k = 0, 1, ...
  in that order, with one rounding per product and one per addition (numpy's elementwise
  multiply and add, two ufunc calls, so never fused into an FMA). An element depends on its own
  row and column only: a matmul of a block of rows equals the same rows of the whole product bit
  for bit, on any IEEE-754 machine and BLAS. It is a K-step loop of elementwise operations, tens
  of times slower than BLAS: for checks and debugging.

The kernel is chosen for a run by :func:`partir_emu.runtime.kernels.kernels` (a context variable,
so threads and nested runs keep their own); this module only reads it.
"""
from __future__ import annotations

import contextvars
import math
from typing import Any

import numpy as np

from partir_emu.core.dtypes import is_low_float, np_dtype
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.primitives.costs import Cost, in_bytes, out_bytes


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


# -- matmul ------------------------------------------------------------------------------------------
KERNELS = ("blas", "exact")
KERNEL: contextvars.ContextVar[str] = contextvars.ContextVar("partir_emu_matmul_kernel", default="blas")


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for ``(..., M, K)`` and ``(..., K, N)`` operands of one dtype, by the current kernel
    (integer products are exact either way and always go to ``np.matmul``)."""
    if KERNEL.get() == "exact" and np.result_type(a, b).kind in "fc":
        return exact_matmul(a, b)
    return np.matmul(a, b)


def exact_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` summed over k in increasing order, one rounding per operation (see the module
    docstring)."""
    dt = np.result_type(a, b)
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = (*lead, a.shape[-2], b.shape[-1])
    k = a.shape[-1]
    if k == 0:
        return np.zeros(shape, dt)
    acc = np.empty(shape, dt)
    np.multiply(a[..., :, 0:1], b[..., 0:1, :], out=acc)
    term = np.empty(shape, dt)
    for i in range(1, k):
        np.multiply(a[..., :, i:i + 1], b[..., i:i + 1, :], out=term)
        np.add(acc, term, out=acc)
    return acc
