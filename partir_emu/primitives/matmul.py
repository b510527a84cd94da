"""The one matrix product that every contraction's numpy implementation calls (``dot_general``,
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

import numpy as np

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
