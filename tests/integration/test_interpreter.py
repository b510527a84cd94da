"""The numpy interpreter against jax.jit, one test per primitive family."""
from __future__ import annotations

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partir_emu.compiler.tracing.trace import trace
from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.errors import ArgumentError, UnsupportedPrimitiveError
from partir_emu.primitives import elementwise as _special
from partir_emu.primitives import get, names
from partir_emu.runtime.interpreter import eval_program

RNG = np.random.default_rng(0)


def _f32(*shape, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape) * scale, jnp.float32)


def _i32(*shape, lo=-9, hi=9):
    return jnp.asarray(RNG.integers(lo, hi, shape), jnp.int32)


def check(fn, *args, rtol=1e-5, atol=1e-6):
    """eval_program(trace(fn)) equals jax.jit(fn): same dtypes and shapes, close floats, exact ints."""
    prog = trace(fn, *args)
    got = eval_program(prog, [np.asarray(x) for x in jax.tree_util.tree_leaves(args)])
    ref = [np.asarray(r) for r in jax.tree_util.tree_leaves(jax.jit(fn)(*args))]
    assert len(got) == len(ref)
    for name, g, r in zip(prog.output_names, got, ref):
        assert (g.dtype, g.shape) == (r.dtype, r.shape), name
        if np.issubdtype(r.dtype, np.inexact):
            np.testing.assert_allclose(g, r, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(g, r, err_msg=name)
    return prog


def test_every_supported_primitive_has_a_rule():
    missing = sorted(n for n in names(traceable=True) if get(n).impl is None)
    assert not missing, missing


def test_runtime_does_not_import_jax():
    code = ("import sys, partir_emu.runtime.local_mesh, partir_emu.runtime.engine, partir_emu.runtime.interpreter; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unary_float():
    x = _f32(3, 5)
    check(lambda x: (-x, jnp.exp(x), jnp.exp2(x), jnp.log(jnp.abs(x) + 1), jnp.log1p(jnp.abs(x)), jnp.expm1(x),
                     jnp.tanh(x), jax.nn.sigmoid(x), jax.lax.rsqrt(jnp.abs(x) + 1), jnp.sqrt(jnp.abs(x)),
                     jnp.cbrt(x), jnp.abs(x), jnp.sign(x), jnp.floor(x), jnp.ceil(x), jnp.sin(x), jnp.cos(x),
                     jnp.tan(x), jnp.isfinite(x / (x - x[0, 0])), x ** 3, x ** -2, jnp.square(x),
                     jax.lax.stop_gradient(x), jnp.copy(x)), x)


def test_rounding_and_precision():
    x = jnp.asarray([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997, -0.49999997, 1e5 + 0.3, 65519.0, 7e4, 1e-8, np.nan], jnp.float32)
    check(lambda x: (jnp.round(x), jax.lax.round(x), jnp.round(x, 1), jax.lax.reduce_precision(x, 5, 10),
                     jax.lax.reduce_precision(x, 8, 7), x.astype(jnp.float16)), x)


def test_erf_and_erf_inv_match_jax_to_1e6():
    x = jnp.asarray(np.concatenate([np.linspace(-6, 6, 2001), np.geomspace(1e-30, 3, 200)]), jnp.float32)
    check(jax.scipy.special.erf, x, rtol=1e-6, atol=0)
    y = jnp.asarray(np.linspace(-0.999, 0.999, 1001), jnp.float32)
    check(jax.scipy.special.erfinv, y, rtol=2e-5, atol=1e-6)
    check(jax.scipy.special.erfinv, jnp.asarray([-1.0, 1.0, 0.0], jnp.float32))


def test_erf_and_erfc_float64_against_math():
    x = np.concatenate([np.linspace(-27, 27, 20001), np.geomspace(1e-300, 1, 300), [0.0, np.inf, -np.inf]])
    np.testing.assert_allclose(_special.erf64(x), [math.erf(v) for v in x], rtol=1e-14, atol=0)
    np.testing.assert_allclose(_special.erfc64(x), [math.erfc(v) for v in x], rtol=1e-13, atol=1e-300)
    assert np.isnan(_special.erf64(np.array([np.nan]))).all()


def test_binary_and_comparisons():
    x, y = _f32(4, 3), _f32(4, 3)
    i, j = _i32(4, 3), _i32(4, 3, lo=1, hi=7)
    check(lambda x, y: (x + y, x - y, x * y, x / y, jax.lax.rem(x, y), x % y, jnp.abs(x) ** y, jnp.maximum(x, y),
                        jnp.minimum(x, y), x < y, x <= y, x > y, x >= y, x == y, x != y, jnp.arctan2(x, y),
                        jnp.nextafter(x, y), x + 1.5, 2 * x, 1.0 / x), x, y)
    check(lambda i, j: (i + j, i - j, i * j, jax.lax.div(i, j), jax.lax.div(-i, j), i // j, jax.lax.rem(i, j),
                        i % j, i & j, i | j, i ^ j, ~i, i ** 2, i < j, i == 3, jnp.sign(i), jnp.abs(i),
                        jnp.maximum(i, 0)), i, j)
    b = jnp.asarray(RNG.integers(0, 2, (5,)), bool)
    check(lambda b: (b & ~b, b | b[::-1], b ^ True, jnp.logical_not(b)), b)


def test_select_clamp_convert():
    x, y, z = _f32(3, 4), _f32(3, 4), _f32(3, 4)
    which = _i32(3, 4, lo=0, hi=3)
    check(lambda w, x, y, z: (jax.lax.select_n(w, x, y, z), jnp.where(x > 0, x, 0.0), jax.lax.clamp(-0.5, x, 0.5),
                              jnp.clip(x, y, None), x.astype(jnp.int32), (x * 1e10).astype(jnp.int32),
                              (x * 100).astype(jnp.uint8), x.astype(bool), which.astype(jnp.float32),
                              (x > 0).astype(jnp.float32), x.astype(jnp.float16), jnp.nan_to_num(x / 0.0)),
          which, x, y, z)


def test_shape_ops():
    x = _f32(2, 3, 4)
    check(lambda x: (x.reshape(6, 4), x.reshape(-1), x.T, jnp.transpose(x, (1, 0, 2)), x[:, None], x[None, 0],
                     jnp.squeeze(x[:, :1], 1), jnp.expand_dims(x, 3), jnp.concatenate([x, x * 2], 1),
                     jnp.broadcast_to(x[:, :1], (5, 2, 3, 4)), x[1:, ::2, 1:3], x[..., ::-1],
                     jnp.flip(x, (0, 2)), jnp.split(x, [1, 3], axis=2), jnp.split(x, 3, axis=1),
                     jnp.arange(7), jnp.arange(2.0, 5.0, 0.5), jax.lax.broadcasted_iota(jnp.int32, (3, 5), 1),
                     jnp.eye(3)), x)


def test_pad_with_negative_and_interior():
    x = _f32(3, 4)
    check(lambda x: (jnp.pad(x, ((1, 2), (0, 3))), jnp.pad(x, 1, constant_values=7.0),
                     jax.lax.pad(x, 0.0, ((1, -1, 1), (0, 0, 2))), jax.lax.pad(x, -1.0, ((-2, 3, 0), (2, -3, 1))),
                     jax.lax.pad(x, 0.0, ((0, 0, 0), (-1, -1, 0)))), x)


def test_dynamic_slices():
    x, i = _f32(5, 6), jnp.int32(3)
    check(lambda x, i: (jax.lax.dynamic_slice(x, (i, 1), (2, 3)), jax.lax.dynamic_slice(x, (i + 4, -3), (2, 3)),
                        jax.lax.dynamic_update_slice(x, jnp.ones((2, 2)), (i, i)),
                        jax.lax.dynamic_update_slice(x, jnp.ones((2, 2)), (i + 9, 0)),
                        jax.lax.dynamic_index_in_dim(x, i, 1)), x, i)


def test_reductions_and_scans():
    x, i = _f32(4, 5), _i32(4, 5)
    check(lambda x, i: (x.sum(), x.sum(0), x.max(1), x.min(), jnp.prod(x, 0), jnp.any(x > 1, 1), jnp.all(x > -3),
                        i.sum(1), jnp.prod(i, 0), i.max(0), jnp.argmax(x, 1), jnp.argmin(x, 0), jnp.argmax(i, 0),
                        jnp.cumsum(x, 0), jnp.cumsum(x, 1, dtype=jnp.float32), jnp.cumprod(x, 1),
                        jax.lax.cummax(x, 0), jax.lax.cummin(x, 1, reverse=True), jax.lax.cumsum(x, 1, reverse=True),
                        jnp.cumsum(i, 1), jax.nn.logsumexp(x, 1), jax.nn.softmax(x)), x, i)


def test_dot_general():
    a, b = _f32(2, 3, 4), _f32(2, 4, 5)
    check(lambda a, b: (a @ b, jnp.einsum("bij,bjk->bki", a, b), jnp.einsum("bij,cjk->bick", a, b),
                        jnp.einsum("bij,bij->b", a, a), jnp.tensordot(a, b, ((0, 2), (0, 1))), a[0] @ a[1].T,
                        jnp.dot(a[0, 0], b[0, :, 0])), a, b, rtol=1e-5, atol=1e-5)
    i, j = _i32(3, 4), _i32(4, 2)
    check(lambda i, j: (i @ j, jax.lax.dot(i.astype(jnp.int8), j.astype(jnp.int8),
                                           preferred_element_type=jnp.int32)), i, j)


def test_gather_and_scatter_variants():
    x = _f32(6, 5)
    idx = _i32(3, 2, lo=0, hi=5)
    oob = jnp.asarray([0, 5, -1, 7, 2], jnp.int32)
    check(lambda x, idx, oob: (
        x[idx], x[:, idx[0]], jnp.take_along_axis(x, idx.T[:, :2].repeat(3, 0)[:6] % 5, axis=1),
        jnp.take(x, oob, axis=0, mode="clip"), jnp.take(x, oob, axis=0, mode="fill", fill_value=-1.0),
        x.at[oob].get(mode="fill"), x[oob[1:3], 1:3], x[jnp.array([1, 2]), jnp.array([3, 4])],
        x.at[idx[:, 0]].add(1.0), x.at[oob].add(2.0, mode="drop"), x.at[oob].add(2.0, mode="clip"),
        x.at[:, idx[0]].add(jnp.ones((6, 2))), x.at[idx[:, 0], idx[:, 1]].add(3.0),
        jnp.zeros(4, jnp.int32).at[jnp.array([0, 0, 3])].add(jnp.array([1, 2, 3], jnp.int32))), x, idx, oob)


def test_gather_and_scatter_with_batching_dims():
    """vmap turns indexing into gathers/scatters with operand batching dims (and windows)."""
    x, i = _f32(4, 6, 5), _i32(6, lo=0, hi=4)
    prog = check(lambda x, i: (
        jax.vmap(lambda x, i: x[i], in_axes=(1, 0))(x, i),
        jax.vmap(lambda x, i: jax.lax.dynamic_slice(x, (i, 1), (2, 3)), in_axes=(1, 0))(x, i),
        jax.vmap(lambda x, i: x.at[i].add(1.0), in_axes=(1, 0))(x, i),
        jax.vmap(lambda x, i: x.at[i, 1:3].add(jnp.ones((2,))), in_axes=(2, None))(x, i[:3])), x, i)
    assert any(e.params.get("dimension_numbers", {}).get("operand_batching_dims") for e in prog.eqns)


def test_bfloat16_programs():
    x = _f32(2, 3, 4).astype(jnp.bfloat16)
    check(lambda a: (a @ a.transpose(0, 2, 1), jnp.tanh(a), a.sum(1), a.astype(jnp.float32)), x, rtol=2e-2, atol=2e-2)


def test_embedding_lookup_and_its_grad():
    emb = _f32(11, 8)
    tokens = _i32(4, 6, lo=0, hi=11)

    def loss(emb, tokens):
        h = emb[tokens]                                   # gather
        return jnp.mean(jnp.tanh(h).sum(-1) ** 2)

    prog = check(lambda e, t: (loss(e, t), jax.grad(loss)(e, t)), emb, tokens)
    prims = {e.prim for e in prog.eqns}
    assert {"gather", "scatter-add"} <= prims


def test_mlp_grad_step():
    params = {"w1": _f32(8, 16, scale=0.3), "b1": _f32(16), "w2": _f32(16, 4, scale=0.3), "b2": _f32(4)}
    x, y = _f32(5, 8), jnp.asarray(RNG.integers(0, 4, 5), jnp.int32)

    def loss(params, x, y):
        h = jax.nn.gelu(x @ params["w1"] + params["b1"])
        logits = h @ params["w2"] + params["b2"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    check(step, params, x, y, rtol=1e-5, atol=1e-6)


def test_literal_only_equations_keep_jax_dtypes():
    check(lambda x: (x + jnp.float32(2.0) * 3, jnp.full((2,), 7, jnp.int32), x * 0 + 1e-3), _f32(2))


def test_unsupported_primitive_names_it_and_its_source():
    v, w = Var(0, (3,), "float32"), Var(1, (3,), "float32")
    prog = Program((v,), ("x",), (Eqn("fft", (v,), (w,), {}, source="model.py:12 (f)"),), (w,), ("out",))
    with pytest.raises(UnsupportedPrimitiveError, match=r"'fft'.*model\.py:12"):
        eval_program(prog, [np.ones(3, np.float32)])


def test_wrong_inputs_raise_argument_error():
    prog = trace(lambda x: x + 1, _f32(3))
    with pytest.raises(ArgumentError, match=r"'x'.*float32\[3\].*float32\[4\]"):
        eval_program(prog, [np.ones(4, np.float32)])
    with pytest.raises(ArgumentError, match="takes 1 inputs"):
        eval_program(prog, [])


# -- random chains ---------------------------------------------------------------------
_UNARY = {
    "tanh": jnp.tanh, "exp": lambda x: jnp.exp(jnp.clip(x, -5, 5)), "sin": jnp.sin, "abs": jnp.abs, "neg": jnp.negative,
    "square": jnp.square, "sigmoid": jax.nn.sigmoid, "log1p": lambda x: jnp.log1p(jnp.abs(x)),
    "scale": lambda x: x * 0.5 + 1.0, "relu": jax.nn.relu,
}


def _apply(op, x):
    kind, arg = op
    if kind == "unary":
        return _UNARY[arg](x)
    if kind == "binary":  # with a reversed copy of itself: same shape, different values
        return {"add": jnp.add, "mul": jnp.multiply, "max": jnp.maximum, "sub": jnp.subtract}[arg](x, jnp.flip(x))
    if kind == "reduce":
        if x.ndim <= 1:
            return x
        ax = arg % x.ndim
        return {0: jnp.sum, 1: jnp.max, 2: jnp.min, 3: jnp.mean}[arg % 4](x, axis=ax, keepdims=arg % 2 == 0)
    if kind == "transpose":
        return jnp.transpose(x, np.roll(np.arange(x.ndim), arg % max(x.ndim, 1)))
    if kind == "reshape":
        return x.reshape(-1) if arg % 2 or x.size % 2 else x.reshape(2, -1)
    if kind == "cumsum":
        return jnp.cumsum(x, axis=arg % x.ndim)
    raise AssertionError(kind)


_OPS = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(sorted(_UNARY))),
    st.tuples(st.just("binary"), st.sampled_from(["add", "mul", "max", "sub"])),
    st.tuples(st.sampled_from(["reduce", "transpose", "reshape", "cumsum"]), st.integers(0, 7)),
)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(lambda s: tuple(s) + (2,)),
       ops=st.lists(_OPS, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_random_chains(shape, ops, seed):
    x = jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)

    def fn(x):
        for op in ops:
            x = _apply(op, x)
        return x

    check(fn, x, rtol=1e-5, atol=1e-5)
