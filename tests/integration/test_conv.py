"""Convolutions and pooling (issue 11, item 2): ``conv_general_dilated``, ``reduce_window_*`` and
``select_and_scatter_add``. Each impl is checked against jax.jit over a parameter sweep (and the
exact convs jax.grad emits); a small CNN train step and a Flax CNN partition with batch, kernel
output-feature and ZeRO-3 shardings on the LocalMesh and equal jax.jit to float32 rounding; a
tactic that tiles a spatial dim (a halo exchange, see tests/integration/test_halo.py) gives the right result."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import partir_emu
from partir_emu import ManualPartition, Mesh
from partir_emu.compiler.tracing.trace import trace
from partir_emu.hwmodels import load_spec, simulate
from partir_emu.primitives import lookup, rule_for
from partir_emu.runtime.interpreter import eval_program

RNG = np.random.default_rng(5)
NHWC = ("NHWC", "HWIO", "NHWC")
NCHW = ("NCHW", "OIHW", "NCHW")


def _close(got, want) -> None:
    got, want = jax.tree_util.tree_leaves(got), [np.asarray(w) for w in jax.tree_util.tree_leaves(want)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        # float32 rounding of sums of many products: relative to the array's scale
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=3e-6 * (float(np.abs(w).max()) + 1))


def _interp(fn, *args) -> set[str]:
    """fn through the numpy interpreter against jax.jit; every rule and cost accepts its eqns."""
    prog = trace(fn, *args)
    _close(eval_program(prog, [np.asarray(a) for a in jax.tree_util.tree_leaves(args)]), jax.jit(fn)(*args))
    for e in prog.eqns:
        rule_for(e)
        lookup(e.prim).cost(e)
    return {e.prim for e in prog.eqns}


def _with_grads(f):
    return lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(jnp.sin(f(*b))), argnums=tuple(range(len(a))))(*a))


def _arr(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- impls ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dn", [NHWC, NCHW], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("strides", [(1, 1), (2, 3)])
@pytest.mark.parametrize("padding", ["SAME", "VALID", ((1, 2), (0, 1)), ((-1, 1), (2, 0))])
@pytest.mark.parametrize("rhs_dilation", [(1, 1), (2, 1)])
def test_conv_and_its_gradients_match_jax(dn, strides, padding, rhs_dilation):
    x, w = (_arr(2, 9, 8, 4), _arr(3, 2, 4, 6)) if dn == NHWC else (_arr(2, 4, 9, 8), _arr(6, 4, 3, 2))
    f = _with_grads(lambda x, w: lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=rhs_dilation,
                                                          dimension_numbers=dn))
    assert "conv_general_dilated" in _interp(f, x, w)


@pytest.mark.parametrize("groups,kernel", [(2, (3, 3, 3, 4)), (6, (3, 3, 1, 6)), (6, (3, 3, 1, 12)), (3, (1, 1, 2, 3))],
                         ids=["grouped", "depthwise", "depthwise_x2", "grouped_1x1"])
def test_grouped_convs_and_their_gradients_match_jax(groups, kernel):
    f = _with_grads(lambda x, w: lax.conv_general_dilated(x, w, (2, 1), "SAME", feature_group_count=groups,
                                                          dimension_numbers=NHWC))
    prog = trace(f, _arr(2, 8, 8, 6), _arr(*kernel))
    # the weight gradient of a grouped conv is a batch-grouped conv
    assert any(e.params.get("batch_group_count", 1) == groups for e in prog.eqns)
    _interp(f, _arr(2, 8, 8, 6), _arr(*kernel))


def test_lhs_dilated_and_batch_grouped_convs_match_jax():
    x, w = _arr(2, 5, 6, 4), _arr(3, 3, 4, 6)
    _interp(lambda x, w: lax.conv_general_dilated(x, w, (1, 2), ((2, 1), (0, 2)), lhs_dilation=(2, 3),
                                                  rhs_dilation=(1, 2), dimension_numbers=NHWC), x, w)
    _interp(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", batch_group_count=2,
                                                  dimension_numbers=NHWC), _arr(6, 5, 6, 4), w)
    _interp(lambda x, w: lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")),
            _arr(2, 7, 4), _arr(3, 4, 5))


@pytest.mark.parametrize("window,strides,padding", [((1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
                                                    ((1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
                                                    ((1, 3, 2, 1), (1, 1, 1, 1), ((0, 0), (1, 1), (0, 1), (0, 0)))])
def test_pooling_and_its_gradients_match_jax(window, strides, padding):
    x = _arr(2, 7, 6, 3)
    pmax = _with_grads(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding))
    psum = _with_grads(lambda x: lax.reduce_window(x, 0.0, lax.add, window, strides, padding))
    pmin = lambda x: lax.reduce_window(x, jnp.inf, lax.min, window, strides, padding)  # noqa: E731
    assert {"reduce_window_max", "select_and_scatter_add"} <= _interp(pmax, x)
    assert "reduce_window_sum" in _interp(psum, x)
    assert "reduce_window_min" in _interp(pmin, x)


def test_max_pool_gradient_picks_the_first_maximum_of_ties():
    x = np.array([[1, 3, 3, 0], [3, 2, 3, 3]], np.float32)[None, :, :, None]
    f = jax.grad(lambda x: jnp.sum(lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 3, 1), (1, 1, 1, 1), "SAME")))
    want = np.asarray(jax.jit(f)(x))
    got = eval_program(trace(f, x), [x])[0]
    np.testing.assert_array_equal(got, want)


# -- partitioned ------------------------------------------------------------------------------------
def _cnn_params():
    return {"c1": _arr(3, 3, 3, 8) * 0.3, "c2": _arr(3, 3, 8, 8) * 0.2, "d": _arr(2 * 2 * 8, 10) * 0.2,
            "b": np.zeros(10, np.float32)}


def _cnn_step(params, x, y):
    def loss(p):
        h = jax.nn.relu(lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=NHWC))
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        h = jax.nn.relu(lax.conv_general_dilated(h, p["c2"], (1, 1), "SAME", dimension_numbers=NHWC))
        h = lax.reduce_window(h, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
        logits = h.reshape(h.shape[0], -1) @ p["d"] + p["b"]
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))
    val, g = jax.value_and_grad(loss)(params)
    return val, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, g)


_CNN_ARGS = None


def _cnn_args():
    global _CNN_ARGS
    if _CNN_ARGS is None:
        _CNN_ARGS = (_cnn_params(), _arr(8, 8, 8, 3), jax.nn.one_hot(RNG.integers(0, 10, 8), 10))
    return _CNN_ARGS


_SCHEDULES = {
    "bp": [ManualPartition({"x": 0, "y": 0}, axis="batch")],
    "mp": [ManualPartition({"params/c1": 3, "params/c2": 3}, axis="model")],
    "bp+mp": [ManualPartition({"x": 0, "y": 0}, axis="batch"),
              ManualPartition({"params/c1": 3, "params/c2": 3}, axis="model")],
    "bp+z3": [ManualPartition({"x": 0, "y": 0}, axis="batch"),
              ManualPartition({"params/c1": 3, "params/c2": 3, "params/d": 0}, axis="batch")],
    "spatial": [ManualPartition({"x": 1}, axis="batch")],
}


@pytest.mark.parametrize("strategy", list(_SCHEDULES))
def test_cnn_train_step_partitions_and_matches_jax(strategy):
    args = _cnn_args()
    mesh = Mesh(batch=2, model=2)
    pjit = partir_emu.jit(_cnn_step, mesh=mesh, schedule=_SCHEDULES[strategy], state_outputs={"1": "params"})
    _close(pjit(*args), jax.jit(_cnn_step)(*args))
    low = pjit.lower(*args)
    convs = [e for e in low.spmd.program.eqns if e.prim == "conv_general_dilated"]
    assert len(convs) == 5   # 2 forward, 2 weight gradients, 1 input gradient
    if strategy == "bp":     # every conv runs on half the batch; the weight gradients are all-reduced
        assert all(e.inputs[0].shape[0] == 4 for e in convs if e.params["batch_group_count"] == 1
                   and e.params["dimension_numbers"]["lhs_spec"][0] == 0)
        assert sum(e.prim == "all_reduce" for e in low.spmd.collectives()) >= 3
    if strategy == "mp":     # the kernels' output features are tiled on the devices
        assert any(e.inputs[1].shape[3] == 4 for e in convs)
    if strategy == "spatial":   # H tiled with a halo (tests/integration/test_halo.py): 4 own rows + one from each neighbour
        assert any(e.prim == "collective_permute" for e in low.spmd.collectives())
        assert convs[0].inputs[0].shape == (8, 6, 8, 3)
    rep = simulate(low.spmd, load_spec("tpu-v4"))
    assert rep.step_s > 0


@pytest.mark.slow
def test_flax_cnn_with_optax_sgd_partitions_with_batch_parallelism():
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(8, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = nn.relu(nn.Conv(8, (3, 3), strides=(2, 2), padding="VALID")(x))
            x = nn.avg_pool(x, (2, 2), padding="SAME")
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    model, tx = CNN(), optax.sgd(0.1, momentum=0.9)
    x, y = _arr(8, 12, 12, 3), RNG.integers(0, 10, 8).astype(np.int32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    opt = tx.init(params)

    def step(params, opt, x, y):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()
        val, g = jax.value_and_grad(loss)(params)
        upd, opt = tx.update(g, opt, params)
        return val, optax.apply_updates(params, upd), opt

    pjit = partir_emu.jit(step, mesh=Mesh(batch=4), schedule=[ManualPartition({"x": 0, "y": 0}, axis="batch")],
                          state_outputs={"1": "params", "2": "opt"})
    _close(pjit(params, opt, x, y), jax.jit(step)(params, opt, x, y))
    prims = {e.prim for e in pjit.lower(params, opt, x, y).spmd.program.eqns}
    assert {"conv_general_dilated", "reduce_window_max", "reduce_window_sum", "select_and_scatter_add"} <= prims


def test_depthwise_conv_shards_by_channel_without_gathering():
    x, w = _arr(2, 6, 6, 8), _arr(3, 3, 1, 8)
    def f(x, w):
        return _with_grads(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=8,
                                                                 dimension_numbers=NHWC))(x, w)
    pjit = partir_emu.jit(f, mesh=Mesh(batch=2), schedule=[ManualPartition({"x": 3, "w": 3}, axis="batch")])
    _close(pjit(x, w), jax.jit(f)(x, w))
    spmd = pjit.lower(x, w).spmd
    convs = [e for e in spmd.program.eqns if e.prim == "conv_general_dilated"]
    assert {max(e.params["feature_group_count"], e.params["batch_group_count"]) for e in convs} == {4}
    assert not [e for e in spmd.collectives() if e.prim == "all_gather"]


def test_grouped_conv_with_group_and_input_feature_tiled_matches_jax():
    """Channels = (group, in-feature): one axis tiles the groups, the other the features in a
    group (a pending sum). The input gradient reshapes the kernel with a transposing reshape
    (``reshape[dimensions=...]``), whose rule must follow that transpose."""
    x, w = _arr(2, 6, 6, 8), _arr(3, 3, 4, 6)

    def f(x, w):
        return _with_grads(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=2,
                                                                 dimension_numbers=NHWC))(x, w)
    sched = [ManualPartition({"x": 3}, axis="batch"), ManualPartition({"x": 3}, axis="model")]
    pjit = partir_emu.jit(f, mesh=Mesh(batch=2, model=2), schedule=sched)
    _close(pjit(x, w), jax.jit(f)(x, w))
    convs = [e for e in pjit.lower(x, w).spmd.program.eqns if e.prim == "conv_general_dilated"]
    assert convs[0].inputs[0].shape == (2, 6, 6, 2) and convs[0].params["feature_group_count"] == 1
