"""bfloat16 on the runtime: single ops equal jax.jit on CPU bit for bit, bf16 collectives round
every step in the one numpy meaning, arrays survive the job files, and small mixed-precision
programs (float32 master weights cast to bfloat16 for the matmuls, bfloat16 activations and
gradients, Adam in float32) partitioned by batch, model and ZeRO-3-style tactics run on
LocalMesh and pass the verdict against jax.jit; a wrongly partitioned bf16 run fails it.

The programs and inputs here are shared with tests/mpi/test_bf16_mpi.py.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

from partir_emu.core.dtypes import storable
from partir_emu.core.mesh import Mesh
from partir_emu.runtime.local_mesh import LocalMesh

pytestmark = pytest.mark.xdist_group("bf16_runtime")    # its cached programs and references: made once, on one worker

BF16 = np.dtype(ml_dtypes.bfloat16)
D, H, OUT, B = 32, 64, 16, 16         # model sizes of the MLP step (emulation size)
STATE = {"1": "params", "2": "opt"}  # the step returns (loss, params, opt, logits)


def _jax():
    import jax  # why: the MPI test imports this module's builders and jax is not needed there
    return jax


# -- the programs ------------------------------------------------------------------------------
def mlp_step(params, opt, x, y):
    """One mixed-precision train step: bf16 matmuls/activations/layernorm/softmax, f32 loss,
    f32 gradients (through the casts) and Adam in f32. Returns (loss, params, opt, probs)."""
    return _mlp_step(params, opt, x, y, _jax().numpy.bfloat16)


def mlp_step_no_casts(params, opt, x, y):
    """The same step without the bf16 casts: run in float64 it is the verdict's reference (with
    the casts, x64 would still round to bf16; see partir_emu.runtime.verdict)."""
    return _mlp_step(params, opt, x, y, None)


def _mlp_step(params, opt, x, y, bf):
    jax = _jax()
    jnp = jax.numpy
    if bf is None:
        bf = x.dtype

    def loss_fn(p):
        h = x.astype(bf) @ p["w1"].astype(bf) + p["b1"].astype(bf)
        h = jax.nn.gelu(h)
        mu = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mu), axis=-1, keepdims=True)
        h = (h - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"].astype(bf)
        logits = h @ p["w2"].astype(bf)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.sum(logp * y, axis=-1)), jax.nn.softmax(logits, axis=-1).astype(jnp.bfloat16)

    (loss, probs), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    b1, b2, lr, eps = 0.9, 0.999, 1e-2, 1e-8
    m = {k: b1 * opt["m"][k] + (1 - b1) * g[k] for k in params}
    v = {k: b2 * opt["v"][k] + (1 - b2) * jnp.square(g[k]) for k in params}
    new = {k: params[k] - lr * m[k] / (jnp.sqrt(v[k]) + eps) for k in params}
    return loss, new, {"m": m, "v": v}, probs


def mlp_inputs(seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    params = {"w1": (rng.standard_normal((D, H)) / np.sqrt(D)).astype(np.float32),
              "b1": 0.1 * rng.standard_normal(H).astype(np.float32),
              "g": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
              "w2": (rng.standard_normal((H, OUT)) / np.sqrt(H)).astype(np.float32)}
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    opt = {"m": zeros, "v": {k: np.zeros_like(v) for k, v in params.items()}}
    x = rng.standard_normal((B, D)).astype(np.float32)
    y = np.eye(OUT, dtype=np.float32)[rng.integers(0, OUT, B)]
    return params, opt, x, y


def mlp_schedule(strategy: str) -> list:
    """``batch``, ``model``, ``batch+model`` or ``z3`` (params and Adam state on the batch axis)."""
    from partir_emu.compiler.tactics import ManualPartition
    out = []
    if "batch" in strategy or "z3" in strategy:
        out.append(ManualPartition({"x": 0, "y": 0}, axis="batch"))
    if "model" in strategy:
        out.append(ManualPartition({"params/w1": 1, "params/b1": 0, "params/g": 0, "params/w2": 0}, axis="model"))
    if "z3" in strategy:
        out.append(ManualPartition({"params/w1": 0, "params/w2": 0, "opt/*/w1": 0, "opt/*/w2": 0}, axis="batch"))
    return out


@functools.cache
def lowered_mlp(strategy: str, mesh: str):
    """(SpmdProgram, flat inputs, jax.jit outputs, float64 outputs, reduction length)."""
    from partir_emu.api import lower_program, trace
    from partir_emu.runtime.verdict import reduction_length
    jax = _jax()
    args = mlp_inputs()
    prog = trace(mlp_step, *args)
    low = lower_program(prog, Mesh.parse(mesh), mlp_schedule(strategy), STATE)
    flat = [np.asarray(a) for a in jax.tree_util.tree_leaves(args)]
    base = [np.asarray(o) for o in jax.tree_util.tree_leaves(jax.jit(mlp_step)(*args))]
    with jax.enable_x64(True):
        args64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), args)
        ref64 = [np.asarray(o) for o in jax.tree_util.tree_leaves(jax.jit(mlp_step_no_casts)(*args64))]
    return low.spmd, flat, base, ref64, reduction_length(prog)


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- single ops: bit for bit against XLA CPU ------------------------------------------------------
def _ops():
    jax = _jax()
    jnp, lax = jax.numpy, jax.lax
    rng = np.random.default_rng(1)
    a = rng.standard_normal((32, 256)).astype(BF16)
    b = rng.standard_normal((256, 48)).astype(BF16)
    pos = (np.abs(rng.standard_normal((32, 256))) + 0.1).astype(BF16)
    f = 3 * rng.standard_normal((32, 256)).astype(np.float32)
    return {
        "dot": (lambda u, v: u @ v, (a, b)),
        "lax.reduce_sum rows": (lambda u: lax.reduce_sum(u, axes=(1,)), (a,)),
        "lax.reduce_sum cols": (lambda u: lax.reduce_sum(u, axes=(0,)), (a,)),
        "lax.reduce_sum all (tree of 32)": (lambda u: lax.reduce_sum(u, axes=(0, 1)), (a,)),
        "lax.reduce_sum 100 (padded)": (lambda u: lax.reduce_sum(u[0, :100], axes=(0,)), (a,)),
        "jnp.mean": (lambda u: jnp.mean(u, axis=1), (a,)),
        "exp/tanh/logistic": (lambda u: (jnp.exp(u), jnp.tanh(u), jax.nn.sigmoid(u)), (a,)),
        "rsqrt/sqrt/log": (lambda p: (lax.rsqrt(p), jnp.sqrt(p), jnp.log(p)), (pos,)),
        "integer_pow": (lambda u: (u ** 3, u ** 2, u ** -2), (a,)),
        "div/mul/add/pow": (lambda u, p: (u / p, u * p, u + p, p ** u), (a, pos)),
        "convert f32->bf16 (nearest even)": (lambda x: x.astype(jnp.bfloat16), (f,)),
        "convert bf16->f32/int32": (lambda u: (u.astype(jnp.float32), (u * 100).astype(jnp.int32)), (a,)),
        "softmax": (lambda u: jax.nn.softmax(u, axis=-1), (a,)),
        "gelu (tanh)": (jax.nn.gelu, (a,)),
        "layernorm": (lambda u: (u - u.mean(-1, keepdims=True)) * lax.rsqrt(jnp.var(u, -1, keepdims=True) + 1e-5),
                      (a,)),
        "grad of a broadcast": (lambda u: jax.grad(lambda w: jnp.sum((u * w[None, :]).astype(jnp.float32)))(u[0]),
                                (a,)),
    }


@pytest.mark.parametrize("name", list(_ops()))
def test_bf16_op_equals_xla_cpu_bit_for_bit(name):
    from partir_emu.api import trace
    from partir_emu.runtime.interpreter import eval_program
    jax = _jax()
    fn, args = _ops()[name]
    want = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.jit(fn)(*args))]
    got = eval_program(trace(fn, *args), list(args))
    for g, w in zip(got, want):
        assert bit_equal(g, w), f"{name}: {int((g.astype(np.float64) != w.astype(np.float64)).sum())} of {w.size} differ"


def test_bf16_dot_is_float32_accumulation_rounded_once():
    """A long bf16 contraction: summing in bf16 would lose most terms; float32 then one rounding
    is within half a bf16 ulp of the exact (float64) product."""
    from partir_emu.primitives import get
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((4, 4096)).astype(BF16), rng.standard_normal((4096, 3)).astype(BF16)
    out = np.asarray(get("dot_general").impl(a, b, dimension_numbers=(((1,), (0,)), ((), ()))))
    assert out.dtype == np.float32          # the interpreter rounds it to the equation's dtype
    exact = a.astype(np.float64) @ b.astype(np.float64)
    rounded = out.astype(BF16).astype(np.float64)
    assert np.all(np.abs(rounded - exact) <= np.abs(exact) * 2.0 ** -8 + 1e-3)


# -- collectives and files ----------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["direct", "ring", "recursive"])
def test_bf16_all_reduce_rounds_each_step(algorithm):
    """Four members whose sum cancels: bf16 per-step rounding (the semantics) is not the exact
    sum; 'direct' is the group-order bf16 fold exactly, the schedules equal it up to order."""
    from partir_emu.collectives.semantics import reference
    from tests.unit.test_local_mesh import Builder, _dims
    mesh = Mesh(a=4)
    bld = Builder(mesh)
    x = bld.input((4 * 8,), _dims(1, 0, ("a",)), dtype="bfloat16")
    y = bld.eqn("all_reduce", [x], (8,), dtype="bfloat16", axes=("a",), op="sum")
    spmd = bld.build([y], [_dims(1, 0, ())], [(8,)])
    vals = np.arange(32, dtype=np.float32).reshape(4, 8)  # distinct, exactly representable
    vals[:, 0] = [256.0, 1.0, 1.0, -256.0]               # 256+1 rounds to 256 in bf16 (8 mantissa bits)
    inp = vals.reshape(-1).astype(BF16)
    out = LocalMesh(mesh, algorithm).run(spmd, [inp]).outputs[0]
    assert out.dtype == BF16
    fold = reference("all_reduce", list(inp.reshape(4, 8)))[0]
    exact = vals.sum(0)
    assert float(fold[0]) == 0.0 and exact[0] == 2.0    # rounding at every step, in group order
    if algorithm == "direct":
        assert bit_equal(out, fold)
    assert np.array_equal(out[1:].astype(np.float32), exact[1:])   # exact where nothing rounds
    assert float(out[0]) in (0.0, 1.0, 2.0)               # the pairing decides which roundings happen


def test_bf16_arrays_survive_job_files(tmp_path):
    from partir_emu.mpi.jobs import load_inputs, read_job_result, save_inputs, write_job_result
    a = np.random.default_rng(3).standard_normal((5, 7)).astype(BF16)
    i = np.arange(4, dtype=np.int32)
    save_inputs(tmp_path / "in.npz", ["params/a", "x"], [a, i])
    got = load_inputs(tmp_path / "in.npz", ["params/a", "x"])
    assert bit_equal(got[0], a) and bit_equal(got[1], i)
    with np.load(tmp_path / "in.npz", allow_pickle=False) as z:   # stored without pickles, as raw bits
        assert z["params/a"].dtype == np.uint16
    job = {"out": str(tmp_path / "out")}
    write_job_result(job, [a, i, a[0]], {"ok": 1})
    res = read_job_result(job)
    assert len(res["outputs"]) == 3 and all(bit_equal(g, w) for g, w in zip(res["outputs"], [a, i, a[0]]))
    np.savez(tmp_path / "plain.npz", **storable({"x": i}))        # nothing to name: no extra entry
    with np.load(tmp_path / "plain.npz", allow_pickle=False) as z:
        assert z.files == ["x"]


# -- programs on LocalMesh against jax.jit ------------------------------------------------------
CASES = [("batch", "batch=4"), ("model", "model=4"), ("batch+model", "batch=2,model=2"), ("z3", "batch=4"),
         ("z3+model", "batch=2,model=2")]


@pytest.mark.parametrize("strategy,mesh", CASES)
def test_bf16_mlp_step_verifies_against_jit(strategy, mesh):
    from partir_emu.runtime.verdict import judge
    spmd, flat, base, ref64, k = lowered_mlp(strategy, mesh)
    assert any(v.dtype == "bfloat16" for e in spmd.program.eqns for v in e.outputs), "no bf16 in the program"
    assert sum(spmd.stats().count.values()) > 0, "the partitioning needs collectives"
    res = LocalMesh(spmd.mesh, "ring").run(spmd, flat)
    dtypes = [o.dtype for o in res.outputs]
    assert dtypes == [b.dtype for b in base] and BF16 in dtypes and np.dtype(np.float32) in dtypes
    ver = judge(res.outputs, base, ref64, spmd.output_names, k, precision=judge_precision(spmd.program))
    assert ver.verified, ver.summary()


def judge_precision(program) -> str:
    from partir_emu.runtime.verdict import compute_precision
    return compute_precision(program)


def test_bf16_unpartitioned_equals_jit_bit_for_bit_where_expected():
    """One device: the interpreter runs jax's program op by op, so the bf16 activations (softmax)
    equal jax.jit's bit for bit except where XLA orders float32 dot sums otherwise or keeps a
    fused intermediate in float32 (measured: 87.9% equal, the rest within 2 bf16 ulps)."""
    spmd, flat, base, _, _ = lowered_mlp("batch", "batch=1")
    res = LocalMesh(spmd.mesh, "ring").run(spmd, flat)
    probs_ours, probs_jit = res.outputs[-1], base[-1]
    same = probs_ours.view(np.uint16) == probs_jit.view(np.uint16)
    assert same.mean() > 0.8, f"only {same.mean():.1%} of the bf16 probabilities equal jax.jit's"
    ulps = np.abs(probs_ours.view(np.uint16).astype(np.int32) - probs_jit.view(np.uint16).astype(np.int32))
    assert ulps.max() <= 2


def test_wrong_bf16_partitioning_fails_the_verdict():
    """A bf16 all_reduce that takes the max instead of the sum (replicas stay consistent, the
    values are wrong) must fail the bf16 verdict, far above its bound."""
    import dataclasses

    from partir_emu.core.spmd import SpmdProgram
    from partir_emu.runtime.verdict import judge
    spmd, flat, base, ref64, k = lowered_mlp("model", "model=4")
    prog = spmd.program
    eqns = list(prog.eqns)
    idx = [i for i, e in enumerate(eqns) if e.prim == "all_reduce" and e.inputs[0].dtype == "bfloat16"]
    assert idx, "the model-parallel bf16 step has no bf16 all_reduce"
    for i in idx:
        eqns[i] = dataclasses.replace(eqns[i], params={**eqns[i].params, "op": "max"})
    bad = SpmdProgram(spmd.mesh, dataclasses.replace(prog, eqns=tuple(eqns)), spmd.in_shardings, spmd.out_shardings,
                      spmd.global_in_shapes, spmd.global_out_shapes)
    res = LocalMesh(bad.mesh, "ring").run(bad, flat)
    prec = judge_precision(prog)
    ver = judge(res.outputs, base, ref64, bad.output_names, k, precision=prec)
    assert not ver.verified, ver.summary()
    assert ver.worst.err > 3 * ver.worst.bound, ver.summary()


def test_stale_half_of_a_bf16_update_fails_the_verdict():
    """Half of w1 never updated (a lost reduce-scatter block under ZeRO): the bf16 verdict fails."""
    from partir_emu.runtime.verdict import judge
    spmd, flat, base, ref64, k = lowered_mlp("z3", "batch=4")
    good = LocalMesh(spmd.mesh, "ring").run(spmd, flat).outputs
    j, w = spmd.output_names.index("1/w1"), flat[spmd.input_names.index("params/w1")]
    half = [o.copy() for o in good]
    half[j][: D // 2] = w[: D // 2]
    prec = judge_precision(spmd.program)
    assert judge(good, base, ref64, spmd.output_names, k, precision=prec).verified
    ver = judge(half, base, ref64, spmd.output_names, k, precision=prec)
    assert not ver.verified and ver.worst.name == "1/w1", ver.summary()
