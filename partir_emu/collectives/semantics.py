"""What each collective means, in plain numpy: the reference the executors are checked against.

:func:`reference` takes one array per group member (in group order) and returns
each member's result as a fresh array:

=====================  ==========================================================================
all_gather             every member: the inputs concatenated along ``dim``
all_reduce             every member: the inputs reduced elementwise by ``op``, in group order
reduce_scatter         member ``i``: block ``i`` (along ``dim``) of the inputs reduced by ``op``
all_to_all             member ``j``: block ``j`` (along ``split_dim``) of every member's input,
                       concatenated in group order along ``concat_dim``
collective_permute     member ``d``: the input of ``s`` for each pair ``(s, d)``, else zeros
=====================  ==========================================================================

A collective_permute's pairs are positions within the group, each source and each target at most
once (as XLA's collective-permute). An SPMD program may spell them as a shift (``shift``, ``wrap``):
:func:`partir_emu.core.spmd.permute_pairs` expands either spelling to the ``permutation`` given here.

Reduction precision: a reduction adds in the operands' dtype, each addition rounded to it. For
bfloat16 that is what NCCL and TPU ICI reductions do (every hop of a ring rounds to bfloat16;
ml_dtypes adds in float32 and rounds), so a bfloat16 all_reduce over ``p`` members carries up to
``p - 1`` bfloat16 roundings, in the order of the algorithm's schedule. Every executor (local,
MPI schedules, MPI ``native`` for bfloat16) uses this one meaning.

On flat buffers (every dim 0) this is what a schedule computes; the in-process
mesh's ``'direct'`` algorithm runs it on the operands as they are.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from partir_emu.collectives.schedule import KINDS, REDUCE_KINDS, check_permutation
from partir_emu.errors import CollectiveError

REDUCE_OPS: dict[str, np.ufunc] = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def reduce_fn(op: str) -> np.ufunc:
    """The ufunc of a reduction op name ('sum', 'max', 'min')."""
    try:
        return REDUCE_OPS[op]
    except (KeyError, TypeError):
        raise CollectiveError(f"unknown reduction op {op!r}; use one of {tuple(REDUCE_OPS)}") from None


def reference(kind: str, buffers: Sequence[np.ndarray], op: str = "sum",
              permutation: Sequence[tuple[int, int]] | None = None, *, dim: int = 0, split_dim: int = 0,
              concat_dim: int = 0) -> list[np.ndarray]:
    """The numpy meaning of collective ``kind`` over ``buffers`` (members in group order; see the
    module docstring). The inputs are not modified and no result shares memory with them."""
    if kind not in KINDS:
        raise CollectiveError(f"unknown collective kind {kind!r}; use one of {KINDS}")
    p = len(buffers)
    bufs = [np.asarray(b) for b in buffers]
    if kind == "all_gather":
        return [np.concatenate(bufs, axis=dim) for _ in range(p)]
    if kind in REDUCE_KINDS:
        total = np.asarray(functools.reduce(reduce_fn(op), bufs))
        if kind == "all_reduce":
            return [total.copy() for _ in range(p)]
        if total.ndim == 0 or total.shape[dim] % p:
            raise CollectiveError(f"reduce_scatter of shape {list(total.shape)} over {p} members along dim {dim}: "
                                  "that dim's size must divide by p")
        return [b.copy() for b in np.split(total, p, axis=dim)]
    if kind == "all_to_all":
        blocks = [np.split(b, p, axis=split_dim) for b in bufs]
        return [np.concatenate([blocks[i][j] for i in range(p)], axis=concat_dim) for j in range(p)]
    out = [np.zeros_like(b) for b in bufs]
    for s, d in check_permutation(permutation, p):
        out[d] = bufs[s].copy()
    return out
