"""The local executor runs every schedule to the numpy meaning of its collective."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule
from partir_emu.collectives.local import LocalExecutor, run_schedule
from partir_emu.collectives.schedule import KINDS
from partir_emu.collectives.semantics import reference
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


@pytest.mark.slow
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


# ------------------------------------------------------- the executor is the schedule's semantics
def _semantic_run(sched, bufs, op="sum"):
    """The step semantics of schedule.py, chunk by chunk: every transfer sends the value its source
    holds at the start of the step, then the values are applied in transfer order."""
    fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    isz, cb = sched.itemsize, sched.chunk_bytes
    state = []
    for pos, b in enumerate(bufs):
        st, off = {}, 0
        for c in sched.input_chunks(pos):
            k = cb[c] // isz
            st[c] = b[off:off + k]
            off += k
        state.append(st)
    for step in sched.steps:
        sent = [[(c, state[t.src][c]) for c in t.chunks if cb[c]] for t in step.transfers]
        for t, vals in zip(step.transfers, sent):
            for c, v in vals:
                state[t.dst][c] = fn(state[t.dst][c], v) if t.reduce else v
    out = []
    for pos, st in enumerate(state):
        chunks = sched.output_chunks(pos)
        if chunks is None:
            out.append(np.zeros(sched.output_nbytes // isz, bufs[0].dtype))
        else:
            parts = [st[c] for c in chunks if cb[c]]
            out.append(np.concatenate(parts) if parts else np.zeros(0, bufs[0].dtype))
    return out


def _bits_equal(a, b):
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(KINDS), alg=st.sampled_from(ALGORITHMS), shape=st.sampled_from(SHAPES + [(16,), (4, 8)]),
       mult=st.integers(0, 9), extra=st.integers(0, 7), dtype=st.sampled_from([np.float32, np.float16, np.int64]),
       op=st.sampled_from(["sum", "max"]), seed=st.integers(0, 2**31))
def test_executor_is_bit_identical_to_the_step_semantics(kind, alg, shape, mult, extra, dtype, op, seed):
    p = math.prod(shape)
    n = p * mult + (extra if kind == "all_reduce" else 0)
    rng = np.random.default_rng(seed)
    perm = tuple((i, int(d)) for i, d in enumerate(rng.permutation(p)) if rng.random() < 0.7) \
        if kind == "collective_permute" else None
    isz = np.dtype(dtype).itemsize
    sched = build_schedule(kind, shape, n * isz, alg, itemsize=isz, devices_per_node=2, permutation=perm)
    size = n // p if kind == "all_gather" else n
    bufs = [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(dtype) for _ in range(p)]
    assert _bits_equal(run_schedule(sched, bufs, op), _semantic_run(sched, bufs, op))


def _hand_schedule(steps, p=3, n_chunks=3, nbytes=4 * 3 * 2):
    from partir_emu.collectives.schedule import CollectiveSchedule, Step, Transfer
    cb = nbytes // n_chunks
    return CollectiveSchedule(kind="all_reduce", algorithm="ring", group_shape=(p,), nbytes=nbytes,
                              num_chunks=n_chunks, itemsize=4, chunk_bytes=(cb,) * n_chunks,
                              steps=tuple(Step(tuple(Transfer(s, d, cb * k, c, r, k) for s, d, c, r, k in st))
                                          for st in steps))


def test_overlapping_writes_in_a_step_apply_in_transfer_order():
    # step 0: member 0 adds chunk 0 from 2 and then from 1 (order matters for floats); member 1
    # sends chunk 1 to 2 while it receives chunk 1 from 0 (it must send its value from before the step)
    sched = _hand_schedule([
        [(2, 0, 0, True, 1), (1, 0, 0, True, 1), (1, 2, 1, True, 1), (0, 1, 1, True, 1), (2, 1, 2, True, 1),
         (0, 1, 2, True, 1)],
        [(0, 1, 0, False, 1), (0, 2, 0, False, 1), (1, 0, 1, False, 2), (2, 0, 1, True, 1)],
    ])
    bufs = [np.array([1e8, 1.0, 3.0, -1e8, 0.5, 2.0], np.float32) * (i + 1) for i in range(3)]
    got, want = run_schedule(sched, bufs), _semantic_run(sched, bufs)
    assert _bits_equal(got, want)
    # and the order is really the schedule's: swapping the first two transfers changes the bits of chunk 0
    steps = [list(st) for st in [[(1, 0, 0, True, 1), (2, 0, 0, True, 1)]]]
    a = run_schedule(_hand_schedule(steps), [np.array([1e8, 1, 1, 1, 1, 1], np.float32),
                                             np.array([1.0, 1, 1, 1, 1, 1], np.float32),
                                             np.array([-1e8, 1, 1, 1, 1, 1], np.float32)])
    b = run_schedule(_hand_schedule([[(2, 0, 0, True, 1), (1, 0, 0, True, 1)]]),
                     [np.array([1e8, 1, 1, 1, 1, 1], np.float32), np.array([1.0, 1, 1, 1, 1, 1], np.float32),
                      np.array([-1e8, 1, 1, 1, 1, 1], np.float32)])
    assert a[0][0] != b[0][0]


# ------------------------------------------------------- the reference on shaped operands, the kept plans
def test_reference_works_along_the_given_dims():
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((3, 4, 2)).astype(np.float32) for _ in range(4)]
    ag = reference("all_gather", xs, dim=1)
    assert all(np.array_equal(a, np.concatenate(xs, axis=1)) for a in ag)
    rs = reference("reduce_scatter", xs, dim=1)
    total = xs[0] + xs[1] + xs[2] + xs[3]
    assert all(np.array_equal(r, total[:, i:i + 1]) for i, r in enumerate(rs))
    a2a = reference("all_to_all", xs, split_dim=1, concat_dim=2)
    assert all(np.array_equal(a2a[j], np.concatenate([x[:, j:j + 1] for x in xs], axis=2)) for j in range(4))
    outs = ag + rs + a2a + reference("all_reduce", xs, "max")
    assert not any(np.shares_memory(o, x) for o in outs for x in xs)   # fresh results
    with pytest.raises(CollectiveError, match="must divide"):
        reference("reduce_scatter", xs, dim=2)


def test_local_executor_keeps_one_plan_per_schedule():
    ex = LocalExecutor(max_plans=2)
    s1, s2, s3 = (build_schedule("all_reduce", (4,), 64 * k, "ring") for k in (1, 2, 3))
    assert ex.plan(s1) is ex.plan(s1)
    bufs = [np.arange(16 * 2, dtype=np.float32) * i for i in range(4)]
    assert _bits_equal(ex.run(s2, bufs), run_schedule(s2, bufs))
    first = ex.plan(s1)
    ex.plan(s3)                      # s2 was used least recently: dropped, s1 kept
    assert ex.plan(s1) is first and len(ex._plans) == 2
