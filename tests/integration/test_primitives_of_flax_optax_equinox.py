"""The primitives ordinary Flax/optax/Equinox train steps emit (issue 11, item 3): jax.random's
threefry primitives, shifts and bit counts, bitcasts, the scatters, top_k, tile and the inverse
trigonometric/hyperbolic functions. Each is checked against jax.jit unpartitioned (the numpy
interpreter) and partitioned on a LocalMesh with a tactic that tiles a dim its rule allows (the
primitive then runs on the local block), and, where a rule blocks a dim, with a tactic that tiles
that dim (the result must still be right: the value is gathered first). Bit for bit where the
semantics are exact (integers, bits, RNG, selections), to float32 rounding otherwise."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir_emu
from partir_emu import ManualPartition, Mesh
from partir_emu.compiler.tracing.trace import trace
from partir_emu.hwmodels import load_spec, simulate
from partir_emu.primitives import lookup, rule_for
from partir_emu.primitives.bits import HASH_OPS
from partir_emu.runtime.interpreter import eval_program

RNG = np.random.default_rng(11)           # restored before each test (tests/conftest.py)
KEY = np.array([0, 42], np.uint32)          # jax.random.PRNGKey(42), without a jax call


def _bits(a: np.ndarray) -> np.ndarray:
    """The bits of ``a``, every NaN made the canonical one (jax leaves a NaN's sign unspecified)."""
    a = np.asarray(a)
    return np.where(np.isnan(a), np.nan, a).astype(a.dtype).view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def _same(got, want, exact: bool) -> None:
    got, want = jax.tree_util.tree_leaves(got), [np.asarray(w) for w in jax.tree_util.tree_leaves(want)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        if exact:
            np.testing.assert_array_equal(_bits(g), _bits(w))
        else:
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6)


def _check(fn, *args, tiles: dict[str, int] | None = None, mesh: Mesh | None = None, exact: bool = True):
    """fn through the interpreter (one device) and through partir_emu.jit with ``tiles`` (argument
    name -> dim) on ``mesh`` (axis ``batch``), both against jax.jit. Returns the SpmdProgram."""
    want = jax.jit(fn)(*args)
    prog = trace(fn, *args)
    _same(eval_program(prog, [np.asarray(x) for x in jax.tree_util.tree_leaves(args)]), want, exact)
    for e in prog.eqns:   # every rule accepts its equations and every cost prices them
        rule_for(e)
        lookup(e.prim).cost(e)
    pjit = partir_emu.jit(fn, mesh=mesh or Mesh(batch=2), schedule=[ManualPartition(tiles or {}, axis="batch")])
    _same(pjit(*args), want, exact)
    return pjit.lower(*args).spmd


def _local_inputs(spmd, prim: str) -> list[tuple[int, ...]]:
    """The local shape of the first operand of each ``prim`` equation of an SpmdProgram."""
    return [e.inputs[0].shape for e in spmd.program.eqns if e.prim == prim]


def _collectives(spmd) -> list[str]:
    return [e.prim for e in spmd.collectives()]


# -- RNG: the same bits as jax's threefry ------------------------------------------------------------
@pytest.mark.slow
def test_random_draws_match_jax_bit_for_bit():
    def draws(k):
        k1, k2 = jax.random.split(k)
        return (jax.random.bernoulli(k1, 0.9, (8, 16)), jax.random.uniform(k2, (3, 5)),
                jax.random.randint(jax.random.fold_in(k, 7), (6,), -5, 9), jax.random.split(k, (2, 3)),
                jax.random.bits(k, (5,), jnp.uint8), jax.random.bits(k1, (4,), jnp.uint16),
                jax.random.permutation(k2, 6), jax.random.key_data(jax.random.clone(jax.random.wrap_key_data(k))))
    spmd = _check(draws, KEY, tiles={"k": 0})   # the key-data dim is blocked: the key is gathered first
    assert {"random_bits", "random_split", "random_fold_in", "random_wrap", "random_clone"} <= {
        e.prim for e in spmd.program.eqns}


def test_typed_keys_from_a_seed_match_jax():
    """jax.random.key(seed) (random_seed) and ops on typed key arrays (a slice of split's keys)."""
    def keys(seed):
        return jax.random.split(jax.random.key(seed), 4)

    for seed in (np.int32(-5), np.int32(123456)):
        _check(lambda s: (jax.random.key_data(keys(s)), jax.random.uniform(keys(s)[1], (3,))), seed)
    # normal goes through erf_inv, computed in float64 and rounded: equal to float32 rounding
    _check(lambda s: jax.random.normal(keys(s)[2], (2, 2)), np.int32(7), exact=False)


def test_batch_of_keys_draws_on_the_local_keys():
    """vmap over keys: random_bits' key dims are shared factors, so a tiled key batch draws locally."""
    keys = np.stack([np.array([0, i], np.uint32) for i in range(4)])
    spmd = _check(jax.vmap(lambda k: jax.random.bernoulli(k, 0.5, (6,))), keys, tiles={"k": 0})
    assert _local_inputs(spmd, "random_bits") == [(2, 2)] and not _collectives(spmd)
    # one key folded with a tiled batch of messages: fold_in broadcasts the key, the messages stay local
    spmd = _check(lambda k, i: jax.vmap(lambda i: jax.random.fold_in(k, i))(i), KEY, np.arange(4, dtype=np.int32),
                  tiles={"i": 0})
    assert [e.inputs[1].shape for e in spmd.program.eqns if e.prim == "random_fold_in"] == [(2,)]


def test_drawn_dims_are_blocked_and_the_mask_is_sliced():
    """A dropout-like mask over a batch-tiled activation: the draw's own dims are blocked (an
    element's bits depend on its global position), so each device draws the whole mask."""
    x = RNG.standard_normal((8, 16)).astype(np.float32)
    spmd = _check(lambda x, k: jnp.where(jax.random.bernoulli(k, 0.75, x.shape), x * 4.0, 0.0), x, KEY,
                  tiles={"x": 0})
    bits = [e for e in spmd.program.eqns if e.prim == "random_bits"]
    assert [e.outputs[0].shape for e in bits] == [(8, 16)]
    assert lookup("random_bits").cost(bits[0]) == (HASH_OPS * 8 * 16, 8 + 4 * 8 * 16)   # one hash per element
    assert "all_gather" not in _collectives(spmd)


def test_threefry2x32_primitive():
    from jax.extend.random import threefry_2x32
    x = RNG.integers(0, 2**32, (8,), dtype=np.uint64).astype(np.uint32)
    spmd = _check(lambda k, x: threefry_2x32(k, x), KEY, x, tiles={"x": 0})
    assert "threefry2x32" in {e.prim for e in spmd.program.eqns}


# -- bits ------------------------------------------------------------------------------------------
INTS = np.array([[0, 1, -1, 7, -123456, 2**31 - 1, -2**31, 12345]] * 2, np.int32)


def test_shifts_and_bit_counts_batch_tiled():
    def f(x):
        big = jnp.full_like(x, 40)
        return (jax.lax.shift_left(x, 3), jax.lax.shift_right_logical(x, 31), jax.lax.shift_right_arithmetic(x, 2),
                jax.lax.shift_left(x, big), jax.lax.shift_right_logical(x, big), jax.lax.shift_right_arithmetic(x, big),
                jax.lax.shift_right_logical(x, -1), jax.lax.population_count(x), jax.lax.clz(x),
                jax.lax.clz(x.astype(jnp.uint8)), jax.lax.population_count(x.astype(jnp.uint16)),
                jax.lax.shift_left(jnp.int32(1), x & 63), jax.lax.shift_right_logical(jnp.int32(-8), x & 63))
    spmd = _check(f, INTS, tiles={"x": 1})
    assert _local_inputs(spmd, "population_count")[0] == (2, 4) and not _collectives(spmd)


def test_bitcast_convert_type():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    spmd = _check(lambda x: (jax.lax.bitcast_convert_type(x, jnp.int32), jax.lax.bitcast_convert_type(x, jnp.uint8)),
                  x, tiles={"x": 0})
    assert all(s == (2, 6) for s in _local_inputs(spmd, "bitcast_convert_type"))
    b = RNG.integers(0, 256, (6, 4), dtype=np.uint8)
    # the consumed byte dim is blocked: tiling it gathers the bytes first
    spmd = _check(lambda b: jax.lax.bitcast_convert_type(b, jnp.uint32), b, tiles={"b": 1})
    assert _local_inputs(spmd, "bitcast_convert_type") == [(6, 4)] and "all_gather" in _collectives(spmd)


# -- scatters --------------------------------------------------------------------------------------
def _at(x, i):
    return x.at[i].set(-1.0), x.at[i].min(1.5), x.at[i].max(5.0), x.at[i].mul(2.0), x.at[i].add(0.5)


IDX = np.array([0, 2, 5], np.int32)
DUP = np.array([1, 1, 4, 1], np.int32)    # repeated rows: min, max, mul and add combine them all


@pytest.mark.parametrize("idx", [IDX, DUP], ids=["distinct", "repeated"])
def test_scatters_with_a_tiled_window_dim_stay_local(idx):
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    fn = _at if idx is IDX else (lambda x, i: _at(x, i)[1:])
    spmd = _check(fn, x, idx, tiles={"x": 1})
    for prim in ("scatter-min", "scatter-max", "scatter-mul"):
        assert _local_inputs(spmd, prim) == [(6, 4)], prim
    assert not _collectives(spmd)


@pytest.mark.parametrize("idx", [IDX, DUP], ids=["distinct", "repeated"])
def test_scatters_into_a_tiled_indexed_dim_apply_each_blocks_rows_locally(idx):
    """Row scatters (set/min/max/mul/add of rows of x) with x's rows tiled: each device shifts the
    indices by its block start and drops the rows it does not hold (compiler/lowering/indexed.py); no
    collective, whichever block the (repeated) rows fall in."""
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    spmd = _check(_at, x, idx, tiles={"x": 0})
    for prim in ("scatter", "scatter-min", "scatter-max", "scatter-mul", "scatter-add"):
        assert _local_inputs(spmd, prim) == [(3, 8)], prim
    assert not _collectives(spmd)


def test_scatter_set_of_updates_tiled_along_their_scatter_dim():
    """scatter's update rows are blocked (only scatter-add may leave them partial): updates tiled
    by row are gathered, and the result is the jax one."""
    x, u = np.zeros((6, 4), np.float32), RNG.standard_normal((4, 4)).astype(np.float32)
    i = np.array([5, 0, 3, 1], np.int32)
    spmd = _check(lambda x, i, u: (x.at[i].set(u), x.at[i].max(u), x.at[i].add(u)), x, i, u, tiles={"u": 0, "i": 0})
    assert [e.inputs[2].shape for e in spmd.program.eqns if e.prim == "scatter"] == [(4, 4)]


# -- top_k, tile, and the idioms built on sort/gather ----------------------------------------------
def _ties(shape):
    x = RNG.integers(-3, 4, shape).astype(np.float32)
    x.reshape(-1)[:4] = [np.nan, np.inf, -0.0, 0.0]
    return x


def test_top_k_batch_tiled_and_its_dim_blocked():
    x = _ties((4, 9))
    spmd = _check(lambda x: jax.lax.top_k(x, 4), x, tiles={"x": 0})
    assert _local_inputs(spmd, "top_k") == [(2, 9)] and not _collectives(spmd)
    spmd = _check(lambda x: jax.lax.top_k(x, 3), x, tiles={"x": 1}, mesh=Mesh(batch=3))
    assert _local_inputs(spmd, "top_k") == [(4, 9)]
    _check(lambda x: jax.lax.top_k(x, 2), RNG.integers(-9, 9, (4, 6)).astype(np.int32), tiles={"x": 0})


def test_tile_repeated_dim_blocked_other_dims_shared():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    spmd = _check(lambda x: jnp.tile(x, (1, 3)), x, tiles={"x": 0})
    assert _local_inputs(spmd, "tile") == [(2, 6)] and not _collectives(spmd)
    spmd = _check(lambda x: jnp.tile(x, (2, 1)), x, tiles={"x": 0})
    assert _local_inputs(spmd, "tile") == [(4, 6)]


def test_one_hot_take_along_axis_argsort_cumulative():
    x, t = _ties((4, 6)), np.array([3, 0, 5, 1], np.int32)

    def f(x, t):
        order = jnp.argsort(x, axis=1)
        return (jax.nn.one_hot(t, 6), jnp.take_along_axis(x, order, axis=1), jnp.cumsum(x, 1), jnp.cumprod(x, 1),
                jax.lax.cummax(x, axis=1), jnp.sign(x), jnp.isfinite(x), jnp.clip(x, -1, 1), jnp.remainder(x, 2.0))
    _check(f, x, t, tiles={"x": 0, "t": 0})


def test_inverse_and_hyperbolic_functions():
    x = RNG.uniform(-0.9, 0.9, (4, 6)).astype(np.float32)
    spmd = _check(lambda x: (jnp.arcsin(x), jnp.arccos(x), jnp.arctan(x), jnp.sinh(x), jnp.cosh(x),
                             jnp.arcsinh(x), jnp.arccosh(x + 2), jnp.arctanh(x), jax.scipy.special.erfinv(x)),
                  x, tiles={"x": 1}, exact=False)
    assert not _collectives(spmd)


# -- models: Flax with dropout, Equinox, optax; batch parallel -------------------------------------
def _random_like(shapes, scale: float = 0.3, rng: np.random.Generator = RNG):
    """Arrays of the given ShapeDtypeStructs (no jax compile: numpy values)."""
    return jax.tree_util.tree_map(lambda s: (rng.standard_normal(s.shape) * scale).astype(s.dtype), shapes)


@pytest.mark.slow
def test_flax_dropout_is_bit_exact_batch_tiled():
    import flax.linen as nn
    drop = nn.Dropout(0.5, broadcast_dims=(1,))
    x = RNG.standard_normal((8, 4, 6)).astype(np.float32)
    spmd = _check(lambda x, rng: (drop.apply({}, x, deterministic=False, rngs={"dropout": rng}),
                                  nn.Dropout(0.5).apply({}, x, deterministic=False, rngs={"dropout": rng})),
                  x, KEY, tiles={"x": 0})
    assert {"random_fold_in", "random_bits"} <= {e.prim for e in spmd.program.eqns}


@pytest.mark.slow
def test_flax_lm_with_dropout_and_adamw_batch_parallel():
    import flax.linen as nn
    import optax

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tok, train: bool):
            x = nn.LayerNorm()(nn.Embed(50, 16)(tok))
            x = nn.Dropout(0.25, deterministic=not train)(nn.gelu(nn.Dense(32)(x)))
            return nn.Dense(50)(nn.LayerNorm()(nn.Dense(16)(x)))

    m = LM()
    rng = np.random.default_rng(5)     # its own generator: the values must not depend on which tests ran first
    tok = rng.integers(0, 50, (4, 8)).astype(np.int32)
    params = _random_like(jax.eval_shape(lambda k, t: m.init(k, t, False), KEY, tok), rng=rng)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    state = jax.tree_util.tree_map(np.asarray, opt.init(params))

    def step(params, state, tok, rng):
        def loss(p):
            logits = m.apply(p, tok, True, rngs={"dropout": rng})
            return optax.softmax_cross_entropy_with_integer_labels(logits, tok).mean()
        val, g = jax.value_and_grad(loss)(params)
        up, state = opt.update(g, state, params)
        return val, optax.apply_updates(params, up), state

    args = (params, state, tok, KEY)
    want = jax.jit(step)(*args)
    pjit = partir_emu.jit(step, mesh=Mesh(batch=2), schedule=[ManualPartition({"tok": 0}, axis="batch")])
    got = jax.tree_util.tree_leaves(pjit(*args))
    for g, w in zip(got, jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, np.asarray(w), rtol=2e-5, atol=2e-6)
    # the tolerance sees the dropout mask: another key's mask moves the loss beyond it
    other = jax.jit(step)(params, state, tok, np.array([0, 43], np.uint32))[0]
    assert abs(float(other) - float(got[0])) > 100 * 2e-5 * abs(float(got[0]))
    spmd = pjit.lower(*args).spmd
    assert _local_inputs(spmd, "gather")[0] == (50, 16)
    assert {"all_reduce"} == set(_collectives(spmd))    # the gradients, nothing else
    report = simulate(spmd, load_spec("h100"))           # every new primitive is priced
    assert report.step_s > 0


@pytest.mark.slow
def test_equinox_mlp_with_adam_batch_parallel():
    import equinox as eqx
    import optax

    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    params = jax.tree_util.tree_map(np.asarray, params)
    # eps = 1e-3, not optax's 1e-8: Adam's first step is lr·g/(|g| + eps), which for a gradient that is
    # float32 cancellation noise (|g| ~ 1e-8, e.g. a unit the batch barely reaches) flips with the last
    # bit of g, and a batch-partitioned gradient is summed in another order (another GEMM kernel does
    # the same: OPENBLAS_CORETYPE=Prescott failed here). With eps above the noise the step is
    # well-conditioned and float32 tolerances test the partitioning, not Adam's conditioning.
    opt = optax.adam(1e-2, eps=1e-3)
    state = jax.tree_util.tree_map(np.asarray, opt.init(params))
    rng = np.random.default_rng(292)        # its own: the module's RNG depends on which tests ran first
    x, y = rng.standard_normal((8, 8)).astype(np.float32), rng.standard_normal((8, 4)).astype(np.float32)

    def step(params, state, x, y):
        def loss(p):
            return jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2)
        val, g = jax.value_and_grad(loss)(params)
        up, state = opt.update(g, state, params)
        return val, eqx.apply_updates(params, up), state

    spmd = _check(step, params, state, x, y, tiles={"x": 0, "y": 0}, exact=False)
    assert set(_collectives(spmd)) == {"all_reduce"}
