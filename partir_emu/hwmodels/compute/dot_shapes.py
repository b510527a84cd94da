"""The GEMM shape of a matmul-kind equation, and what a flash-attention kernel's dots say about it.

- :func:`dot_dims`: ``(batch, M, N, K)`` of a ``dot_general`` (its batch, free and contracting
  dimensions) or of a convolution's implicit GEMM;
- :func:`score_len` / :func:`head_width`: the score length ``s`` and head width ``d`` of a dot inside
  a flash-attention kernel (``q·kᵀ`` is s×d·d×s, ``p·v`` s×s·s×d; the backward's likewise), which the
  measured attention-kernel rates are looked up by (:mod:`.attention_kernels`).
"""
from __future__ import annotations

import numpy as np

from partir_emu.primitives.conv import conv_gemm_dims


def score_len(m: float, n: float, k: float) -> float:
    """The score length of a flash-attention dot: the dimension it has twice (``q·kᵀ``: M = N = s;
    ``p·v`` and the backward's: one of M, N and K is the head width, the other two are s)."""
    return m if m in (n, k) else n if n == k else max(m, n, k)


def head_width(m: float, n: float, k: float, s: int) -> float:
    """The head width of a flash-attention dot with score length ``s``: its dimension other than s
    (``q·kᵀ``: K; ``p·v``: N); s itself when every dimension is s."""
    others = [d for d in (m, n, k) if d != s]
    return min(others) if others else s


def dot_dims(e) -> tuple[int, int, int, int]:
    if e.prim == "conv_general_dilated":   # the other matmul-kind primitive: its implicit GEMM
        return conv_gemm_dims(e)
    lhs, rhs = e.inputs[0], e.inputs[1]
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    prod = np.prod
    b = int(prod([lhs.shape[i] for i in lb]))
    k = int(prod([lhs.shape[i] for i in lc]))
    m = int(prod([s for i, s in enumerate(lhs.shape) if i not in lc and i not in lb]))
    nn = int(prod([s for i, s in enumerate(rhs.shape) if i not in rc and i not in rb]))
    return b, m, nn, k


