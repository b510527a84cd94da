"""The numerics every run of a program shares: the in-process mesh, the MPI ranks and the
single-device interpreter compute under :func:`kernels`, so that the same equation on the same
local shapes is the same arithmetic wherever it runs.

Why each part:

- **One BLAS thread.** OpenBLAS splits a matrix product among its threads by rows and columns,
  and the blocks at the edges of each thread's share go through other micro-kernels, which sum
  in another order. With its optimised kernels (Haswell, SkylakeX, Zen) the same product then
  rounds differently with 1 and with 2 threads. MPI ranks always ran with one thread (the
  launcher sets ``OPENBLAS_NUM_THREADS=1`` so that ranks do not fight over the cores); the
  in-process mesh ran with the machine's default, and the U-Net's bias gradients differed
  between the two in the last bit on an AVX2 machine. Now both pin it here, for the duration of
  the run, whatever the environment says (``threadpoolctl`` finds the BLAS numpy loaded).
- **The matmul kernel** (:mod:`partir_emu.primitives.dot`): ``"blas"`` (default) or
  ``"exact"``, the fixed-order product whose result elements depend only on their own row and
  column: with it a program tiled by rows equals the unpartitioned one bit for bit where no sum
  crosses devices, on any machine.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from threadpoolctl import threadpool_limits

from partir_emu.errors import ArgumentError
from partir_emu.primitives.dot import KERNEL, KERNELS

__all__ = ["KERNELS", "check_kernels", "kernels"]


def check_kernels(mode: str) -> str:
    """``mode`` if it names a kernel, else an error that lists them."""
    if mode not in KERNELS:
        raise ArgumentError(f"unknown kernels {mode!r}; use one of {list(KERNELS)} ('exact': a fixed-order "
                            f"matmul whose rows do not depend on the matrix's shape, slower)")
    return mode


@contextlib.contextmanager
def kernels(mode: str = "blas") -> Iterator[None]:
    """Compute under one BLAS thread and the matmul kernel ``mode`` (see the module docstring)."""
    token = KERNEL.set(check_kernels(mode))
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            yield
    finally:
        KERNEL.reset(token)
