"""Spatial partitioning with halo exchanges (issue 11, item 2): a tiled spatial dim of a conv or a
pooling window is lowered to a ``collective_permute`` of the border rows to the neighbours, a
concatenate and the local equation (``partir_emu/compiler/lowering/halo.py``, whose docstring defines the
count: one *exchange* per equation and tiled spatial dim = at most one permute per direction).

- the block geometry (halos, local padding) against numpy windows of the whole operand;
- single convs and poolings (and their jax.grad forms) over a sweep of strides, paddings,
  dilations, kernels and layouts (NCHW, depthwise, lhs-dilated, 1-D), H tiled on 2 and 4
  devices (and by two mesh axes), equal jax.jit; the permutes are counted from the geometry
  worked out by hand here; a max pool's halo at the ends of the group is -inf, not zero;
- where no sum crosses devices the tiled result is bit-identical to the unpartitioned program;
- a conv net train step (3 conv layers, relu, 2×2 max pooling, global mean pooling, dense head)
  with H tiled (and H×W tiled on a 2-D mesh, and batch × H): equals jax.jit, has exactly the
  expected permutes per conv and no all_gather, and is priced by the analytical model and the DES.
"""
from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import partir_emu
from partir_emu import ManualPartition, Mesh
from partir_emu.compiler.tracing.trace import trace
from partir_emu.core.factors import FactorRule
from partir_emu.hwmodels import load_spec, simulate
from partir_emu.hwmodels.des import simulate_des
from partir_emu.primitives import rule_for
from partir_emu.primitives.window import HaloDim, window_view
from partir_emu.runtime.interpreter import eval_program

RNG = np.random.default_rng(11)
NHWC = ("NHWC", "HWIO", "NHWC")


def _arr(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _close(got, want) -> None:
    got, want = jax.tree_util.tree_leaves(got), [np.asarray(w) for w in jax.tree_util.tree_leaves(want)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6 * (float(np.abs(w).max()) + 1))


def _prims(spmd, prim: str) -> list:
    return [e for e in spmd.program.eqns if e.prim == prim]


# -- the geometry, against numpy windows (no lowering) ---------------------------------------------
@pytest.mark.parametrize("n,k,s,d,pad", [(8, 3, 1, 1, (1, 1)), (8, 3, 2, 1, (0, 1)), (8, 2, 2, 1, (0, 0)),
                                         (8, 5, 1, 1, (2, 2)), (4, 3, 1, 2, (2, 1)), (8, 1, 2, 1, (0, -1)),
                                         (12, 4, 3, 1, (1, 0))])
@pytest.mark.parametrize("b", [2, 4])
def test_blocks_with_halos_give_the_global_windows(n, k, s, d, pad, b):
    """Split a 1-D operand into b blocks, extend each by its neighbours' elements (zeros at the
    ends, what collective_permute gives non-targets), window it with the local padding: the
    concatenated windows equal the global ones."""
    x = RNG.standard_normal(n)
    full = window_view(x, (k,), (s,), (pad,), (d,), (1,), 0.0).sum(-1)
    geo = HaloDim(0, 0, 0, 0, pad[0], d, k - s)
    before, after = geo.halos()
    m = n // b
    assert max(before, after) <= m
    z = np.zeros(n + 2 * m)
    z[m:m + n] = x
    parts = []
    for j in range(b):
        own = z[m + j * m - before:m + (j + 1) * m + after]
        parts.append(window_view(own, (k,), (s,), (geo.local_padding(m),), (d,), (1,), 0.0).sum(-1))
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-12)


def test_the_rule_marks_halo_factors_and_blocks_what_cannot_line_up():
    x, w = _arr(2, 8, 8, 3), _arr(3, 3, 3, 4)
    prog = trace(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC), x, w)
    (e,) = [e for e in prog.eqns if e.prim == "conv_general_dilated"]
    r: FactorRule = rule_for(e)
    assert len(r.halo) == 2 and all(r.operands[0][d][0] in r.halo for d in (1, 2))
    assert r.operands[0][1] == r.results[0][1]                          # lhs H and result H share it
    valid = trace(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=NHWC), x, w)
    (e,) = [e for e in valid.eqns if e.prim == "conv_general_dilated"]
    assert not rule_for(e).halo                                         # 8 rows -> 6: blocks cannot line up
    pool = trace(_with_grads(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")), x)
    fwd = next(e for e in pool.eqns if e.prim == "reduce_window_max")
    bwd = next(e for e in pool.eqns if e.prim == "select_and_scatter_add")
    assert len(rule_for(fwd).halo) == 2 and not rule_for(bwd).halo     # overlapping windows: the scatter is blocked


# -- single equations through the lowering --------------------------------------------------------
def _with_grads(f):
    return lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(jnp.sin(f(*b))), argnums=tuple(range(len(a))))(*a))


def _tiled(fn, args, b, dim=1):
    """fn with dim ``dim`` of its first argument (``x``, or ``arg0`` through ``*args``) tiled on ``s``."""
    pjit = partir_emu.jit(fn, mesh=Mesh(s=b), schedule=[ManualPartition({"x": dim, "arg0": dim}, axis="s",
                                                                        allow_unmatched=True)])
    _close(pjit(*args), jax.jit(fn)(*args))
    return pjit.lower(*args).spmd


# (strides, padding, rhs_dilation, kernel): permutes (forward, whole value-and-grad) on H, by hand:
# 3x3 SAME s1: 1 row each way = 2; with the input gradient (2) and the weight gradient (reuses the forward's) = 4.
# 3x3 SAME s2 (pad (0,1)): forward 1 (from the next); input gradient (lhs dilated by 2, pad (2,1)): 1 (from the
# previous); weight gradient reuses the forward's: 2. 2x2 s2 VALID: no halo anywhere. 5x5 SAME: 2 rows each way,
# still one permute per direction. 3x3 dilated by 2 SAME: 2 rows each way.
CONV_CASES = [((1, 1), "SAME", (1, 1), 3, 2, 4), ((2, 2), "SAME", (1, 1), 3, 1, 2), ((2, 2), "VALID", (1, 1), 2, 0, 0),
              ((1, 1), "SAME", (1, 1), 5, 2, 4), ((1, 1), "SAME", (2, 2), 3, 2, 4),
              ((1, 1), ((1, 0), (1, 1)), (1, 1), 2, 1, 2)]


@pytest.mark.parametrize("strides,padding,rhs_dil,k,fwd,total", CONV_CASES)
@pytest.mark.parametrize("b", [2, 4])
def test_conv_and_its_gradients_tiled_on_h(strides, padding, rhs_dil, k, fwd, total, b):
    x, w = _arr(2, 16, 6, 3), _arr(k, k, 3, 4)

    def conv(x, w):
        return lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=rhs_dil, dimension_numbers=NHWC)
    spmd = _tiled(conv, (x, w), b)
    assert len(_prims(spmd, "collective_permute")) == fwd and not _prims(spmd, "all_gather")
    spmd = _tiled(_with_grads(conv), (x, w), b)
    perms = _prims(spmd, "collective_permute")
    assert len(perms) == total and all(e.params["axes"] == ("s",) and not e.params["wrap"] for e in perms)
    # the weight gradient is a pending sum over the spatial axis; nothing is gathered
    assert not _prims(spmd, "all_gather") and [e.params["axes"] for e in _prims(spmd, "all_reduce")] == [("s",)]


NCHW = ("NCHW", "OIHW", "NCHW")
# other conv forms with H tiled on 4 devices (value and gradients): permutes of the whole program
FORMS = {
    "nchw": (lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NCHW),
             ((2, 3, 16, 8), (4, 3, 3, 3)), 2, 4),
    "depthwise": (lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=4,
                                                        dimension_numbers=NHWC), ((2, 16, 8, 4), (3, 3, 1, 4)), 1, 4),
    # a transposed conv (lhs dilated by 2): 8 rows -> 16; one row from the previous device
    "lhs_dilated": (lambda x, w: lax.conv_general_dilated(x, w, (1, 1), ((2, 1), (1, 1)), lhs_dilation=(2, 1),
                                                          dimension_numbers=NHWC), ((2, 8, 8, 4), (3, 3, 4, 4)), 1, 2),
    "1d": (lambda x, w: lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")),
           ((2, 16, 4), (3, 4, 5)), 1, 4),
    "stride3": (lambda x, w: lax.conv_general_dilated(x, w, (3, 1), ((1, 1), (1, 1)), dimension_numbers=NHWC),
                ((2, 24, 8, 4), (4, 3, 4, 4)), 1, 2),
    "1x1_stride2": (lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "VALID", dimension_numbers=NHWC),
                    ((2, 16, 8, 4), (1, 1, 4, 4)), 1, 0),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_other_conv_forms_tiled_on_h(form):
    fn, shapes, dim, permutes = FORMS[form]
    spmd = _tiled(_with_grads(fn), tuple(_arr(*s) for s in shapes), 4, dim)
    assert len(_prims(spmd, "collective_permute")) == permutes and not _prims(spmd, "all_gather")
    assert _prims(spmd, "conv_general_dilated")[0].inputs[0].shape[dim] < shapes[0][dim]


def test_h_tiled_by_two_axes_shifts_along_the_flattened_group():
    x, w = _arr(2, 16, 8, 4), _arr(3, 3, 4, 4)
    fn = _with_grads(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC))
    pjit = partir_emu.jit(fn, mesh=Mesh(a=2, b=2), schedule=[ManualPartition({"arg0": 1}, axis="a"),
                                                             ManualPartition({"arg0": 1}, axis="b")])
    _close(pjit(x, w), jax.jit(fn)(x, w))
    perms = _prims(pjit.lower(x, w).spmd, "collective_permute")
    assert len(perms) == 4 and {e.params["axes"] for e in perms} == {("a", "b")}


@pytest.mark.parametrize("op,window,strides,padding,permutes", [
    ("max", (1, 2, 2, 1), (1, 2, 2, 1), "VALID", 0),
    ("sum", (1, 2, 2, 1), (1, 2, 2, 1), "VALID", 0),
    ("sum", (1, 3, 3, 1), (1, 2, 2, 1), "SAME", 1),       # pad (0, 1): one row from the next device
    ("sum", (1, 3, 1, 1), (1, 1, 1, 1), "SAME", 2),
])
def test_pooling_tiled_on_h(op, window, strides, padding, permutes):
    x = _arr(2, 16, 4, 3)
    init, f = (-jnp.inf, lax.max) if op == "max" else (0.0, lax.add)
    pool = lambda x: lax.reduce_window(x, init, f, window, strides, padding)  # noqa: E731
    spmd = _tiled(pool, (x,), 4)
    assert len(_prims(spmd, "collective_permute")) == permutes and not _prims(spmd, "all_gather")
    red = _prims(spmd, f"reduce_window_{op}")[0]
    assert red.inputs[0].shape[1] == 4 + permutes    # 4 own rows + one halo row per permute
    if op == "max":   # its gradient (select_and_scatter_add) tiles the same way, with no exchange
        spmd = _tiled(_with_grads(pool), (x,), 4)
        assert not _prims(spmd, "collective_permute") and not _prims(spmd, "all_gather")
        assert _prims(spmd, "select_and_scatter_add")[0].outputs[0].shape == (2, 4, 4, 3)


@pytest.mark.parametrize("window,strides,permutes", [((1, 3, 3, 1), (1, 2, 2, 1), 1), ((1, 3, 1, 1), (1, 1, 1, 1), 2)])
def test_a_max_pool_halo_takes_minus_infinity_at_the_ends(window, strides, permutes):
    """'SAME' max pooling of negative values: the outer devices' missing rows must be -inf (the
    padding of a max), not the zeros collective_permute gives them. The gradient
    (select_and_scatter_add over overlapping windows) is blocked: gathered, and still right."""
    x = -np.abs(_arr(2, 16, 4, 3)) - 1
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, "SAME")  # noqa: E731
    spmd = _tiled(pool, (x,), 4)
    assert len(_prims(spmd, "collective_permute")) == permutes and not _prims(spmd, "all_gather")
    assert len(_prims(spmd, "axis_index")) == permutes                 # one edge test per direction
    spmd = _tiled(_with_grads(pool), (x,), 2)
    assert _prims(spmd, "all_gather")


# -- a conv net train step -------------------------------------------------------------------------
def _net_params():
    return {"c1": _arr(3, 3, 3, 8) * 0.3, "c2": _arr(3, 3, 8, 8) * 0.2, "c3": _arr(3, 3, 8, 8) * 0.2,
            "d": _arr(8, 10) * 0.3, "b": np.zeros(10, np.float32)}


def _forward(p, x):
    h = jax.nn.relu(lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=NHWC))
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jax.nn.relu(lax.conv_general_dilated(h, p["c2"], (1, 1), "SAME", dimension_numbers=NHWC))
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jax.nn.relu(lax.conv_general_dilated(h, p["c3"], (1, 1), "SAME", dimension_numbers=NHWC))
    return jnp.mean(h, axis=(1, 2)) @ p["d"] + p["b"]


def _step(params, x, y):
    def loss(p):
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(_forward(p, x)) * y, axis=-1))
    val, g = jax.value_and_grad(loss)(params)
    return val, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, g)


_ARGS = (_net_params(), _arr(4, 16, 16, 3), np.asarray(jax.nn.one_hot(RNG.integers(0, 10, 4), 10)))
CONV_LAYERS = 3


def _net(mesh, schedule, fn=_step, args=_ARGS):
    pjit = partir_emu.jit(fn, mesh=mesh, schedule=schedule, state_outputs={"1": "params"} if fn is _step else None)
    _close(pjit(*args), jax.jit(fn)(*args))
    return pjit.lower(*args).spmd


@pytest.mark.parametrize("b", [2, 4])
def test_conv_net_forward_has_one_exchange_per_conv_layer(b):
    spmd = _net(Mesh(spatial=b), [ManualPartition({"x": 1}, axis="spatial")], _forward, _ARGS[:2])
    convs = _prims(spmd, "conv_general_dilated")
    assert len(convs) == CONV_LAYERS
    perms = _prims(spmd, "collective_permute")
    # one exchange per conv layer: the pair of shifts (+1: previous device's last row, -1: next's first)
    assert sorted(e.params["shift"] for e in perms) == sorted([1, -1] * CONV_LAYERS)
    eqns = spmd.program.eqns
    for c in convs:   # each conv reads the concatenation of its own exchange
        (cat,) = [e for e in eqns if e.outputs[0] == c.inputs[0]]
        assert cat.prim == "concatenate" and cat.outputs[0].shape[1] == c.outputs[0].shape[1] + 2
    # and nothing gathered: the only other collective sums the global mean pooling over the spatial axis
    assert {e.prim for e in spmd.collectives()} == {"collective_permute", "all_reduce"}


@pytest.mark.parametrize("b", [2, 4])
def test_conv_net_train_step_tiled_on_h(b):
    spmd = _net(Mesh(spatial=b), [ManualPartition({"x": 1}, axis="spatial")])
    convs = _prims(spmd, "conv_general_dilated")
    assert len(convs) == 3 * CONV_LAYERS - 1          # forward, weight gradient, input gradient (not of layer 1)
    perms = _prims(spmd, "collective_permute")
    # one exchange per conv layer forward (reused by its weight gradient) + one per input gradient
    assert len(perms) == 2 * (CONV_LAYERS + CONV_LAYERS - 1)
    count = Counter(e.prim for e in spmd.collectives())
    assert "all_gather" not in count and "all_to_all" not in count
    # every conv (and pooling) runs on H/b rows (plus halos)
    assert all(e.inputs[0].shape[1] <= 16 // b + 2 for e in convs if e.params["dimension_numbers"]["lhs_spec"][0] == 0)
    # the parameter gradients are summed over the spatial axis
    assert all(e.params["axes"] == ("spatial",) for e in spmd.collectives() if e.prim == "all_reduce")


def test_conv_net_tiled_on_h_and_w_and_with_batch():
    spmd = _net(Mesh(h=2, w=2), [ManualPartition({"x": 1}, axis="h"), ManualPartition({"x": 2}, axis="w")])
    perms = _prims(spmd, "collective_permute")
    assert Counter(e.params["axes"] for e in perms) == {("h",): 10, ("w",): 10}
    assert "all_gather" not in {e.prim for e in spmd.collectives()}
    spmd = _net(Mesh(batch=2, spatial=2), [ManualPartition({"x": 0, "y": 0}, axis="batch"),
                                           ManualPartition({"x": 1}, axis="spatial")])
    assert len(_prims(spmd, "collective_permute")) == 10
    assert {e.params["axes"] for e in spmd.collectives() if e.prim == "all_reduce"} >= {("batch", "spatial")}


@pytest.mark.parametrize("b", [2, 4])
def test_tiled_features_are_bit_identical_to_the_unpartitioned_program_with_the_exact_kernel(b):
    """Where no sum crosses devices (convs, relu, max pooling, a stride-2 conv), every output row
    is computed by one device from the same values in the same order. With the fixed-order matmul
    (kernels="exact") that is bit for bit, on any CPU; with BLAS it is not (OpenBLAS's Haswell and
    SkylakeX kernels round a row of a GEMM by the matrix's shape), so there the rows agree to float32
    rounding."""
    def features(p, x):
        h = jax.nn.relu(lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=NHWC))
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        return lax.conv_general_dilated(h, p["c2"], (2, 2), "SAME", dimension_numbers=NHWC)
    args = _ARGS[:2]
    flat = [np.asarray(a) for a in jax.tree_util.tree_leaves(args)]
    schedule = [ManualPartition({"x": 1}, axis="spatial")]
    exact = partir_emu.jit(features, mesh=Mesh(spatial=b), schedule=schedule, kernels="exact")
    want = eval_program(trace(features, *args), flat, kernels="exact")[0]
    assert np.asarray(exact(*args)).tobytes() == want.tobytes()
    blas = np.asarray(partir_emu.jit(features, mesh=Mesh(spatial=b), schedule=schedule)(*args))
    np.testing.assert_allclose(blas, want, rtol=1e-5, atol=1e-6)
    assert len(_prims(exact.lower(*args).spmd, "collective_permute")) == 4     # 2 + 1 (pool) + 1 (stride 2)


def test_the_exact_kernel_sums_in_a_fixed_order():
    """The exact matmul is the k-ordered sum of rounded products, so a block of rows equals those
    rows of the whole product bit for bit, and it agrees with BLAS to rounding."""
    from partir_emu.primitives.dot import exact_matmul
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 37, 300), np.float32), rng.standard_normal((2, 300, 19), np.float32)
    whole = exact_matmul(a, b)
    assert whole.tobytes() == np.concatenate([exact_matmul(a[:, :5], b), exact_matmul(a[:, 5:], b)], 1).tobytes()
    row = np.zeros(19, np.float32)
    for k in range(300):                    # the definition, one element row at a time
        row = row + a[1, 7, k] * b[1, k]
    assert whole[1, 7].tobytes() == row.tobytes()
    np.testing.assert_allclose(whole, a @ b, rtol=1e-4, atol=1e-4)


def test_conv_net_is_priced_by_the_analytical_model_and_the_des():
    spmd = _net(Mesh(spatial=4), [ManualPartition({"x": 1}, axis="spatial")])
    spec = load_spec("tpu-v4")
    rep = simulate(spmd, spec)
    rows = [r for r in rep.collectives if r.prim == "collective_permute"]
    assert len(rows) == 10 and all(r.time_s > 0 for r in rows)
    assert rep.by_collective["collective_permute"]["count"] == 10
    des = simulate_des(spmd, spec)
    drows = [r for r in des.collectives if r.prim == "collective_permute"]
    assert len(drows) == 10
    # nothing else is on the links during a halo shift: the DES takes the analytical time for each
    for r, d in zip(rows, drows):
        assert d.duration_s == pytest.approx(r.time_s, rel=1e-6)
    assert des.step_s > 0 and rep.step_s > 0
