"""Correct runs in other summation orders: what rounding alone can do to a program's results.

A partitioned program sums the same terms as the unpartitioned one, in blocks and in another
order; so does XLA, and so does OpenBLAS with another CPU kernel. How far that moves a result
depends on the program: a sum that cancels (a gradient element near zero) has a large relative
error, and an optimizer step such as Adam's (``m / sqrt(v) ≈ sign(g)``) turns a gradient element
within rounding of zero into a whole ``±lr`` step. No tolerance fixed in advance fits every
program, and comparing with one other correct run (``jax.jit``) is a coin toss on exactly those
elements: one of them flipped in our run and not in XLA's was enough for a false "verified: NO"
on an AVX2 machine.

:func:`other_orders` measures it instead. It runs the unpartitioned program through the
interpreter ``runs`` times. After each equation that sums (a registry entry with ``summands``:
contractions, convolutions, ``reduce_sum``, ``cumsum``, window sums, ``scatter-add``, the max-pool
gradient), every result element ``i`` gets a random error of the size that a floating-point sum
of its terms can have in another order::

    δ_i = α · u · sqrt(n_i) · sqrt(Σ_k t_ik²) · ξ_i,        ξ_i ~ N(0, 1)

with ``n_i`` terms ``t_ik`` (counted by running the implementation on ones, so padding and
scatter collisions count right), ``Σ t²`` by running it on the squared summands (it is linear in
each of them), and ``u`` the unit roundoff the sum accumulates in (float32 for float32, bfloat16
and float16 results: the implementations sum those in float32; float64 for float64).

Why this size. A recursive sum's error is ``Σ_j ε_j S_j`` over its partial sums ``S_j`` with
``|ε_j| ≤ u``; for terms of random sign ``Σ_j S_j² ≈ n/2 · Σ t²``, so its standard deviation is
about ``u · sqrt(n/6) · sqrt(Σ t²)``, and pairwise, blocked and tree orders (BLAS, XLA, a ring
all_reduce of per-device partial sums) stay well below that. The error is relative to the
*terms*, not to the result, so a sum that cancels gets the large relative error it can have.
``α = 32`` (:data:`ALPHA`) is the margin over that statistical size, for orders whose roundings
correlate (terms of one sign, long sequential sums) and for the few elements of a large tensor
that sit in a tail: the runs must reach at least as far as any correct order, elementwise.

The runs come in antithetic pairs (``ξ`` and ``−ξ``): an element that a small change of one sum
moves across a threshold (a sign that Adam amplifies, a max, a bfloat16 rounding boundary) goes
one way in one run of the pair and the other way in the other, so both sides are seen.

Everything else runs as the interpreter runs it (the numpy implementations the meshes run), so
these runs differ from a partitioned run only by summation order and by the injected error.
:mod:`partir_emu.runtime.verdict` judges a run against the float64 reference by how far these runs
and ``jax.jit`` reach, element by element. This module never imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import np_dtype
from partir_emu.core.ir import Eqn, Literal, Program
from partir_emu.core.loops import LOOP
from partir_emu.primitives import get
from partir_emu.runtime.interpreter import check_inputs, eval_body, eval_eqn, eval_loop, output_value
from partir_emu.runtime.kernels import kernels as numerics

ALPHA = 32.0       # the injected error over the statistical size of a sum's rounding (module docstring)
RUNS = 4           # two antithetic pairs
ACCUMULATE = {"float64": 2.0 ** -53}     # unit roundoff of the accumulation; float32 for every other float


def other_orders(program: Program, inputs: Sequence[np.ndarray], *, runs: int = RUNS, alpha: float = ALPHA,
                 seed: int = 0) -> list[list[np.ndarray]]:
    """``runs`` results of ``program`` on ``inputs``, each with every sum's rounding drawn anew
    (see the module docstring); runs ``2j`` and ``2j + 1`` draw opposite errors."""
    args = check_inputs(program, inputs, "the program (other summation orders)")
    out: list[list[np.ndarray]] = []
    counts: dict = {}       # shared by the runs: the term counts that depend on shapes only
    with numerics("blas"):
        for r in range(runs):
            step = _Perturbed(np.random.default_rng([seed, r // 2]), alpha, -1.0 if r % 2 else 1.0, counts)
            out.append([output_value(x) for x in eval_body(program, args, step)])
    return out


class _Perturbed:
    """The interpreter's step with a drawn rounding error added to each sum's results."""

    def __init__(self, rng: np.random.Generator, alpha: float, sign: float, counts: dict | None = None) -> None:
        self.rng, self.scale = rng, alpha * sign
        self.counts = counts if counts is not None else {}

    def __call__(self, eqn: Eqn, operands: Sequence[Any]) -> list[Any]:
        if eqn.prim == LOOP:
            return eval_loop(eqn, operands, self)
        outs = eval_eqn(eqn, operands)
        entry = get(eqn.prim)
        if entry is None or not entry.summands or outs[0].dtype.kind != "f":
            return outs
        xi = self.rng.standard_normal(outs[0].shape)    # drawn whatever the sizes: both runs of a pair align
        size = sum_rounding(eqn, operands, self.counts)
        err = np.where(np.isfinite(size), size, 0.0) * xi * self.scale
        return [(outs[0].astype(np.float64) + err).astype(outs[0].dtype), *outs[1:]]


def sum_rounding(eqn: Eqn, operands: Sequence[Any], counts: dict | None = None) -> np.ndarray:
    """Per result element of a summing equation, ``u · sqrt(n) · sqrt(Σ t²)`` (module docstring).
    ``counts`` keeps the term counts of equations whose every operand is a summand (then the count
    depends on the shapes only, not on the data), by equation and operand shapes."""
    entry = get(eqn.prim)
    assert entry is not None and entry.impl is not None and entry.summands, eqn.prim
    impl, summands = entry.impl, entry.summands
    arrays = [np.asarray(a.value, np_dtype(a.dtype)) if isinstance(a, Literal) else np.asarray(a) for a in operands]
    params = {**eqn.params, "preferred_element_type": None} if "preferred_element_type" in eqn.params else eqn.params

    def summed(f: Any) -> np.ndarray:
        ops = [f(x) if k in summands else x for k, x in enumerate(arrays)]
        with np.errstate(all="ignore"):
            return np.asarray(impl(*ops, **params), np.float64)

    squares = summed(lambda x: np.square(x.astype(np.float64)))
    key = (id(eqn), tuple(x.shape for x in arrays)) if len(summands) == len(arrays) else None
    count = counts.get(key) if counts is not None and key is not None else None
    if count is None:
        count = summed(lambda x: np.ones(x.shape, np.float64))
        if counts is not None and key is not None:
            counts[key] = count
    u = ACCUMULATE.get(eqn.outputs[0].dtype, 2.0 ** -24)
    return u * np.sqrt(np.maximum(count, 1.0) * squares)
