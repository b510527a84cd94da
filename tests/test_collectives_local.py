"""The local executor runs every schedule to the numpy meaning of its collective."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule
from partir_emu.collectives.local import reference, run_schedule
from partir_emu.collectives.schedule import KINDS
from partir_emu.errors import CollectiveError

SHAPES = [(1,), (2,), (3,), (4,), (5,), (8,), (2, 2), (2, 4), (4, 4), (2, 2, 2)]
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.int16]


def _inputs(kind, p, n, dtype, rng):
    size = n // p if kind == "all_gather" else n
    if np.issubdtype(dtype, np.integer):
        return [rng.integers(-50, 50, size).astype(dtype) for _ in range(p)]
    return [rng.standard_normal(size).astype(dtype) for _ in range(p)]


def _check(kind, shape, alg, n, dtype, op, dpn, seed):
    p = math.prod(shape)
    itemsize = np.dtype(dtype).itemsize
    perm = None
    rng = np.random.default_rng(seed)
    if kind == "collective_permute":
        dst = rng.permutation(p)
        perm = tuple((int(s), int(d)) for s, d in zip(range(p), dst) if rng.random() < 0.7)
    sched = build_schedule(kind, shape, n * itemsize, alg, itemsize=itemsize, devices_per_node=dpn,
                           permutation=perm)
    bufs = _inputs(kind, p, n, dtype, rng)
    before = [b.copy() for b in bufs]
    out = run_schedule(sched, bufs, op)
    ref = reference(kind, bufs, op, perm)
    assert len(out) == p
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        if np.issubdtype(dtype, np.integer) or op != "sum" or kind not in ("all_reduce", "reduce_scatter"):
            np.testing.assert_array_equal(o, r)
        else:
            np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
    for b, c in zip(bufs, before):  # inputs untouched, outputs fresh
        np.testing.assert_array_equal(b, c)
    assert not any(np.shares_memory(o, b) for o in out for b in bufs)
    return sched, bufs, out


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(KINDS), alg=st.sampled_from(ALGORITHMS), shape=st.sampled_from(SHAPES),
       mult=st.integers(0, 7), extra=st.integers(0, 5), dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(["sum", "max", "min"]), dpn=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31))
def test_local_executor_matches_reference(kind, alg, shape, mult, extra, dtype, op, dpn, seed):
    p = math.prod(shape)
    n = p * mult + (extra if kind == "all_reduce" else 0)  # only all_reduce allows sizes not divisible by p
    _check(kind, shape, alg, n, dtype, op, dpn, seed)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("alg", ALGORITHMS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_combination_runs(kind, alg, shape):
    p = math.prod(shape)
    for n in ([1, 2 * p + 1] if kind == "all_reduce" else [2 * p]):
        _check(kind, shape, alg, n, np.float32, "sum", 2, seed=n)


def test_reduction_order_is_fixed_by_the_schedule():
    rng = np.random.default_rng(0)
    bufs = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-3, 4)).astype(np.float32) for _ in range(8)]
    for alg in ALGORITHMS:
        s = build_schedule("all_reduce", (8,), 4000, alg, devices_per_node=4)
        a = run_schedule(s, bufs)
        b = run_schedule(s, [x.copy() for x in bufs])
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert all(np.array_equal(a[0], x) for x in a)  # every member holds the same bits


def test_all_reduce_of_a_scalar():
    s = build_schedule("all_reduce", (8,), 4, "bidir_ring")
    out = run_schedule(s, [np.array([float(i)], np.float32) for i in range(8)])
    assert all(o.tolist() == [28.0] for o in out)


def test_permute_non_receivers_get_zeros():
    s = build_schedule("collective_permute", (3,), 8, itemsize=4, permutation=((0, 1),))
    out = run_schedule(s, [np.full(2, i + 1, np.int32) for i in range(3)])
    assert [o.tolist() for o in out] == [[0, 0], [1, 1], [0, 0]]


@pytest.mark.parametrize("bufs,op,match", [
    ([np.zeros(4, np.float32)] * 3, "sum", "3 buffers for 4 members"),
    ([np.zeros(4, np.float32)] * 4, "prod", "unknown reduction op"),
    ([np.zeros(5, np.float32)] * 4, "sum", "expects 16"),
    ([np.zeros(4, np.float64)] * 4, "sum", "itemsize=8"),
    ([np.zeros((2, 2), np.float32)] * 4, "sum", "1-D"),
    ([np.zeros(4, np.float32)] * 3 + [np.zeros(4, np.int32)], "sum", "differs"),
])
def test_bad_buffers_raise(bufs, op, match):
    s = build_schedule("all_reduce", (4,), 16, "ring")
    with pytest.raises(CollectiveError, match=match):
        run_schedule(s, bufs, op)
