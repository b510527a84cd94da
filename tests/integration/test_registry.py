"""The primitive registry: one entry per primitive with every facet, and ``sort`` added end to end
(one entry in partir_emu/primitives/reduce.py) as the proof that a primitive touches one place."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir_emu
from partir_emu import ManualPartition, Mesh
from partir_emu.compiler.tracing.trace import trace
from partir_emu.core.ir import Eqn, Var
from partir_emu.core.registry import KINDS, register
from partir_emu.core.spmd import COLLECTIVE_PRIMS, COMM_PRIMS
from partir_emu.errors import EmulationError, UnsupportedPrimitiveError
from partir_emu.primitives import get, lookup, registered, rule_for
from partir_emu.runtime.interpreter import eval_eqn, eval_program

RNG = np.random.default_rng(8)


# -- every entry has its facets ----------------------------------------------------------------
def test_traceable_entries_have_every_facet():
    for name, p in registered().items():
        assert p.name == name and p.kind in KINDS, name
        if p.traceable:
            assert p.rule is not None and p.impl is not None and p.cost is not None, name
            assert p.per_device is None and not p.communicates, name


def test_spmd_entries_have_cost_and_kind_and_are_not_traceable():
    for name in (*COLLECTIVE_PRIMS, "axis_index"):
        p = lookup(name)
        assert p.cost is not None and p.kind in KINDS and not p.traceable, name
    for name in COMM_PRIMS:
        assert lookup(name).communicates and lookup(name).kind == "collective" and lookup(name).impl is None
    for name in ("all_slice", "to_partial", "axis_index"):
        assert lookup(name).per_device is not None and not lookup(name).communicates, name
    assert {n for n, p in registered().items() if p.communicates} == set(COMM_PRIMS)


def _mlp_step():
    def loss(params, x, y):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        return jnp.mean((jnp.tanh(h @ params["w2"]) - y) ** 2)

    def step(params, opt, x, y):
        val, g = jax.value_and_grad(loss)(params, x, y)
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], g)
        v = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["v"], g)
        new = jax.tree_util.tree_map(lambda p, m, v: p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), params, m, v)
        return val, new, {"m": m, "v": v}

    params = {"w1": np.ones((8, 16), np.float32), "b1": np.zeros(16, np.float32), "w2": np.ones((16, 4), np.float32)}
    zeros = jax.tree_util.tree_map(np.zeros_like, params)
    return step, (params, {"m": zeros, "v": zeros}, np.ones((6, 8), np.float32), np.ones((6, 4), np.float32))


def _attention():
    def attn(q, k, v, tokens, table):
        s = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1])
        mask = jnp.tril(jnp.ones(s.shape[-2:], bool))
        p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
        emb = table[tokens]
        return jnp.einsum("bqk,bkd->bqd", p, v) + emb, jax.nn.logsumexp(s, axis=-1), jnp.argmax(s, axis=-1)

    q = np.ones((2, 5, 8), np.float32)
    return attn, (q, q, q, np.zeros((2, 5), np.int32), np.ones((11, 8), np.float32))


@pytest.mark.parametrize("make", [_mlp_step, _attention], ids=["mlp_adam_step", "attention"])
def test_every_primitive_of_real_steps_has_a_full_entry(make):
    fn, args = make()
    prog = trace(fn, *args)
    prims = {e.prim for e in prog.eqns}
    assert len(prims) > 8
    for name in prims:
        p = lookup(name)
        assert p.traceable and p.rule and p.impl and p.cost and p.kind in KINDS, name
    for e in prog.eqns:
        rule_for(e)     # every rule accepts its equations
        lookup(e.prim).cost(e)


@pytest.mark.parametrize("fn, name", [(lambda x: jax.lax.lgamma(x.astype(jnp.float32)), "lgamma"),
                                      (lambda x: jax.lax.cumlogsumexp(x.astype(jnp.float32)), "cumlogsumexp")])
def test_unregistered_primitive_is_named(fn, name):
    assert get(name) is None
    with pytest.raises(UnsupportedPrimitiveError, match=f"primitive '{name}' at .*test_registry.py"):
        trace(fn, np.arange(6, dtype=np.int32))


def test_rule_for_names_a_primitive_without_an_entry_and_its_source():
    x, y = Var(0, (4,), "float32"), Var(1, (4,), "float32")
    with pytest.raises(UnsupportedPrimitiveError, match=r"'fft' at model\.py:3 has no sharding rule"):
        rule_for(Eqn("fft", (x,), (y,), {}, "model.py:3"))
    with pytest.raises(UnsupportedPrimitiveError, match="'axis_index' at .* has no sharding rule"):
        rule_for(Eqn("axis_index", (), (y,), {"axis": "a"}, "lowering"))


def test_a_collective_cannot_run_on_one_device():
    x, y = Var(0, (4,), "float32"), Var(1, (4,), "float32")
    with pytest.raises(EmulationError, match="cannot run on one device"):
        eval_eqn(Eqn("all_reduce", (x,), (y,), {"axes": ("a",), "op": "sum"}), [np.ones(4, np.float32)])


def test_register_twice_is_an_error():
    with pytest.raises(ValueError, match="'sort' is registered twice"):
        register(lookup("sort"))


# -- sort, end to end ---------------------------------------------------------------------------
def _keys(shape=(4, 9)):
    """Floats with ties, ±0.0, ±inf and NaNs of both signs: every case of jax's sort order."""
    x = RNG.integers(-3, 4, shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[RNG.choice(flat.size, 8, replace=False)] = [np.nan, -np.nan, -0.0, 0.0, np.inf, -np.inf, -0.0, np.nan]
    return x


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def _run_batch_tiled(fn, *args):
    """fn through partir_emu.jit on Mesh(batch=2) with dim 0 of every input tiled, and through
    jax.jit: the results must be bit-identical. Returns the lowered program."""
    names = [f"a{i}" for i in range(len(args))]
    wrapped = eval(f"lambda {', '.join(names)}: fn({', '.join(names)})", {"fn": fn})
    pjit = partir_emu.jit(wrapped, mesh=Mesh(batch=2), schedule=[ManualPartition(dict.fromkeys(names, 0),
                                                                                   axis="batch")])
    got = jax.tree_util.tree_leaves(pjit(*args))
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        np.testing.assert_array_equal(_bits(g), _bits(w))
    return pjit.lower(*args).spmd


def _sorts_stay_local(spmd) -> None:
    sorts = [e for e in spmd.program.eqns if e.prim == "sort"]
    assert sorts and all(e.inputs[0].shape[0] == 2 for e in sorts)   # the batch dim stays tiled
    assert not spmd.collectives(), [e.prim for e in spmd.collectives()]


def test_jnp_sort_batch_tiled():
    x = _keys()
    spmd = _run_batch_tiled(lambda x: (jnp.sort(x, axis=1), jnp.sort(x, axis=-1, descending=True)), x)
    _sorts_stay_local(spmd)


def test_jnp_argsort_batch_tiled():
    x = _keys()
    _sorts_stay_local(_run_batch_tiled(lambda x: (jnp.argsort(x, axis=1), jnp.argsort(-x, axis=1)), x))


@pytest.mark.parametrize("num_keys", [1, 2])
def test_lax_sort_two_operands_batch_tiled(num_keys):
    k = _keys((4, 3, 10))
    v = RNG.integers(0, 3, (4, 3, 10)).astype(np.int32)   # ties in the second key too
    spmd = _run_batch_tiled(lambda k, v: jax.lax.sort((k, v), dimension=2, num_keys=num_keys), k, v)
    _sorts_stay_local(spmd)
    spmd = _run_batch_tiled(lambda k, v: jax.lax.sort((v, k), dimension=1, num_keys=num_keys), k, v)
    _sorts_stay_local(spmd)


def test_sorting_the_tiled_dim_gathers_it_first():
    spmd = _run_batch_tiled(lambda x: jnp.sort(x, axis=0), _keys())
    assert [e.prim for e in spmd.collectives()] == ["all_gather"]


def test_sort_is_priced():
    prog = trace(lambda x: jnp.sort(x, axis=1), _keys((4, 16)))
    (e,) = [e for e in prog.eqns if e.prim == "sort"]
    assert lookup("sort").kind == "reduction" and lookup("sort").cost(e) == (4 * 16 * 4, 2 * 4 * 16 * 4)


def test_sort_on_one_device_matches_jax():
    x = _keys((5, 7))
    prog = trace(lambda x: (jnp.sort(x, axis=0), jnp.argsort(x, axis=0)), x)
    got = eval_program(prog, [x])
    for g, w in zip(got, jax.jit(lambda x: (jnp.sort(x, axis=0), jnp.argsort(x, axis=0)))(x)):
        np.testing.assert_array_equal(_bits(g), _bits(np.asarray(w)))


def test_jnp_stack_and_its_gradient_batch_tiled():
    """jax has ``stack`` and ``unstack`` primitives (the gradient of a stack is an unstack)."""
    a, b = RNG.standard_normal((4, 6)).astype(np.float32), RNG.standard_normal((4, 6)).astype(np.float32)

    def f(a, b):
        return jnp.stack([a, b]), jnp.stack([a, b], axis=1), jnp.stack([a * b], axis=-1), jnp.unstack(a, axis=1)

    def g(a, b):
        return jax.grad(lambda a, b: jnp.sum(jnp.stack([a, 2 * b], axis=1) ** 2), argnums=(0, 1))(a, b)

    assert {"stack", "unstack"} <= {e.prim for e in trace(g, a, b).eqns}
    assert not _run_batch_tiled(f, a, b).collectives()
    assert not _run_batch_tiled(g, a, b).collectives()
