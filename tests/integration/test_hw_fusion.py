"""The fusion-aware cost model: groups on small traced programs, boundary bytes, the chip's compiler
variants (TPU vs GPU), hand-fused kernels, the report (hfu, mfu, fusion summary) and the DES."""
from __future__ import annotations

import itertools
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from partir_emu.compiler.tracing.trace import trace  # noqa: E402
from partir_emu.core.ir import Eqn, Program, Var  # noqa: E402
from partir_emu.core.mesh import Mesh  # noqa: E402
from partir_emu.core.sharding import Sharding  # noqa: E402
from partir_emu.core.spmd import SpmdProgram  # noqa: E402
from partir_emu.hwmodels import load_spec, simulate  # noqa: E402
from partir_emu.hwmodels.analytical import analyze, compute_times  # noqa: E402
from partir_emu.hwmodels.compute.efficiency import CompilerSpec  # noqa: E402
from partir_emu.hwmodels.compute.fusion import FusionPlan
from partir_emu.hwmodels.compute.kernel_times import group_times
from partir_emu.hwmodels.compute.stack import load_stack
from partir_emu.hwmodels.des import simulate_des  # noqa: E402

F32 = 4
TPU = load_spec("tpu-v4").compiler
GPU = load_spec("a100").compiler


def plan_of(fn, *args, compiler: CompilerSpec = TPU) -> tuple[Program, FusionPlan]:
    p = trace(fn, *args)
    return p, analyze(p).fusion.plan(compiler)


def groups(p: Program, plan: FusionPlan) -> list[list[str]]:
    """The primitives of each group, in program order (duplicated cheap ops left out)."""
    out: dict[int, list[str]] = {}
    for e, g in zip(p.eqns, plan.group_of.tolist()):
        if g >= 0:
            out.setdefault(g, []).append(e.prim)
    return [out[g] for g in sorted(out)]


def spmd_of(p: Program) -> SpmdProgram:
    return SpmdProgram(Mesh(x=1), p, tuple(Sharding.replicated(v.ndim) for v in p.inputs),
                       tuple(Sharding.replicated(len(o.shape)) for o in p.outputs),
                       tuple(v.shape for v in p.inputs), tuple(o.shape for o in p.outputs))


X = jnp.ones((64, 256), jnp.float32)
XB = 64 * 256 * F32          # bytes of X
ROW = 64 * F32               # bytes of one value per row


def test_softmax_is_three_groups_reductions_as_roots():
    p, plan = plan_of(lambda x: jax.nn.softmax(x, axis=-1), X)
    assert groups(p, plan) == [["reduce_max"], ["max", "stop_gradient", "sub", "exp", "reduce_sum"], ["div"]]
    # max: read x, write the row max; then read x and the max, write exp (read by div) and the sum;
    # then read exp and the sum, write the output. Broadcasts are recomputed inside, never written.
    assert plan.bytes.tolist() == [XB + ROW, XB + ROW + XB + ROW, XB + ROW + XB]
    assert plan.bytes.sum() < 0.65 * analyze(p).bytes.sum()


def test_a_stack_runs_its_hand_fused_ops_as_one_kernel_each_under_the_compiler():
    """``hand_fused`` (Megatron's fused scale-mask-softmax): the ``op.`` region the scenario marks is one
    kernel forward and one backward, reading the scores once and writing the probabilities once, where the
    compiler alone makes three groups of it; without the field (or under another op's name) the tag is ignored."""
    import dataclasses

    def f(x):
        with jax.named_scope("kernel:op.scale_mask_softmax"):
            y = jax.nn.softmax(x * 0.5, axis=-1)
        return (y * y).sum()

    p = trace(jax.grad(f), X)
    fwd = [i for i, e in enumerate(p.eqns) if e.kernel == "op.scale_mask_softmax"]
    bwd = [i for i, e in enumerate(p.eqns) if e.kernel == "op.scale_mask_softmax/bwd"]
    assert fwd and bwd
    for hand, kernels in ((("scale_mask_softmax",), 2), ((), None), (("layernorm",), None)):
        plan = analyze(p).fusion.plan(dataclasses.replace(GPU, hand_ops=frozenset(hand)))
        gs = {plan.group_of[i] for i in fwd + bwd} - {-1}
        if kernels:
            assert len(gs) == kernels and plan.hand_kernels == kernels, groups(p, plan)
            assert {plan.group_of[i] for i in fwd} - {-1} != {plan.group_of[i] for i in bwd} - {-1}
        else:
            assert plan.hand_kernels == 0 and len(gs) > 2, groups(p, plan)
    megatron_like = dataclasses.replace(load_stack("megatron-lm"), hand_fused=("scale_mask_softmax",))
    assert megatron_like.compiler(GPU).hand_ops == {"scale_mask_softmax"}
    assert megatron_like.compiler(GPU).variant != GPU.variant      # a plan of its own in the cache


def test_layernorm_groups_and_bytes():
    def ln(x, g, b):
        m = x.mean(-1, keepdims=True)
        xc = x - m
        v = (xc * xc).mean(-1, keepdims=True)
        return xc * jax.lax.rsqrt(v + 1e-5) * g + b

    p, plan = plan_of(ln, X, jnp.ones(256), jnp.ones(256))
    gs = groups(p, plan)
    assert len(gs) == 3 and gs[0] == ["reduce_sum"] and gs[1][-1] == "reduce_sum" and "rsqrt" in gs[2]
    # xc leaves the second group (the output needs it) and is read by the third, once each way
    assert plan.bytes.tolist() == [XB + ROW, XB + ROW + XB + ROW, XB + ROW + 2 * 256 * F32 + XB]


def _dense(x, w, b):
    return jax.nn.gelu(x.astype(jnp.bfloat16) @ w + b)


W = jnp.ones((256, 512), jnp.bfloat16)
BIAS = jnp.ones(512, jnp.bfloat16)


def test_matmul_bias_gelu_epilogue_on_tpu_and_gpu():
    p, tpu = plan_of(_dense, X, W, BIAS, compiler=TPU)
    _, gpu = plan_of(_dense, X, W, BIAS, compiler=GPU)
    # TPU: the convert fuses into the dot's operand and bias + gelu into its output: one kernel
    assert groups(p, tpu) == [[e.prim for e in p.eqns if e.prim != "broadcast_in_dim"]]
    # GPU: cuBLAS reads its operands as they are (the convert is its own kernel); bias + gelu are its epilogue
    gg = groups(p, gpu)
    assert gg[0] == ["convert_element_type"] and gg[1][0] == "dot_general" and "tanh" in gg[1] and len(gg) == 2
    out, consts = 64 * 512 * 2, 4 * 2           # gelu's four bf16 scalar constants are program constants
    assert tpu.bytes.tolist() == [XB + W.nbytes + BIAS.nbytes + consts + out]
    assert gpu.bytes.tolist() == [XB + 64 * 256 * 2, 64 * 256 * 2 + W.nbytes + BIAS.nbytes + consts + out]


def test_gpu_epilogue_takes_no_residual_add_tpu_does():
    def block(x, w, r):
        return jax.nn.relu(x @ w) + r

    x, w, r = jnp.ones((64, 256)), jnp.ones((256, 512)), jnp.ones((64, 512))
    p, tpu = plan_of(block, x, w, r, compiler=TPU)
    _, gpu = plan_of(block, x, w, r, compiler=GPU)
    assert len(groups(p, tpu)) == 1
    assert groups(p, gpu) == [["dot_general", "max"], ["add"]]      # relu is an epilogue, the residual is not


def test_kernel_tagged_region_is_one_group_and_its_inside_costs_no_bytes():
    def f(x):
        with jax.named_scope("kernel:flash"):
            y = jnp.exp(x) * 2.0
            s = y @ y.T                      # [64, 64]: stays inside the kernel
            z = jax.nn.softmax(s, axis=-1) @ y
        return z + 1.0

    p, plan = plan_of(f, X, compiler=GPU)        # GPU would not fuse any of it without the tag
    gs = groups(p, plan)
    assert len(gs) == 2 and gs[0].count("dot_general") == 2 and "reduce_max" in gs[0] and gs[1] == ["add"]
    assert plan.hand_kernels == 1
    assert plan.bytes.tolist() == [XB + XB, XB + XB]      # read x, write z; then z + 1


def test_value_used_by_two_groups_is_written_once():
    def f(x):
        y = jnp.exp(x)                       # read by two reductions, each closing its own group
        return y.sum(-1), y.max(-1), y * 2

    p, plan = plan_of(f, X)
    gs = groups(p, plan)
    assert gs[0] == ["exp", "reduce_sum"] and gs[1:] == [["reduce_max"], ["mul"]]
    # exp is written once by its group and read by each of the two others
    assert plan.bytes.tolist() == [XB + XB + ROW, XB + ROW, XB + XB]


def test_without_a_compiler_table_every_equation_is_its_own_group():
    p = trace(lambda x: jax.nn.softmax(x, axis=-1), X)
    pc = analyze(p)
    plan = pc.fusion.plan(CompilerSpec())
    assert plan.group_of.tolist() == list(range(len(p.eqns)))
    assert plan.bytes.tolist() == pc.bytes.tolist()


def test_group_time_is_on_its_last_equation_and_bounded_by_its_bytes():
    p = trace(lambda x: jax.nn.softmax(x, axis=-1), X)
    pc = analyze(p)
    spec = load_spec("a100")
    plan = pc.fusion.plan(spec.compiler)
    times = compute_times(pc, spec)
    gt = group_times(plan, spec)
    assert times[plan.last].tolist() == gt.tolist() and times.sum() == pytest.approx(gt.sum(), rel=1e-12)
    assert (times > 0).sum() == plan.num_groups
    for b, t in zip(plan.bytes.tolist(), gt.tolist()):
        assert b / spec.hbm_bw_bytes_per_s + spec.compiler.kernel_launch_s < t


def test_report_by_op_kind_hfu_mfu_and_fusion_summary():
    p = trace(_dense, X, W, BIAS)
    spmd = spmd_of(p)
    r = simulate(spmd, "tpu-v4", model_flops=2 * 64 * 256 * 512)
    assert set(r.by_op_kind) >= {"matmul", "elementwise"}
    assert r.by_op_kind["matmul"]["time_s"] == pytest.approx(r.step_s, rel=1e-12)    # one group, a dot's
    assert r.by_op_kind["elementwise"]["time_s"] == 0 and r.by_op_kind["elementwise"]["count"] > 5
    assert r.hfu == pytest.approx(2 * 64 * 256 * 512 / (r.step_s * 275e12), rel=1e-12)
    assert r.mfu == pytest.approx(r.hfu, rel=1e-12)
    assert r.fusion["kernels"] == 1 and r.fusion["bytes_saved"] > 0 and r.hbm_traffic_bytes == r.fusion["fused_bytes"]
    j = r.to_json()
    assert {"hfu", "mfu", "fusion"} <= set(j) and "HFU" in r.table() and "fusion: 1 kernels" in r.table()
    assert simulate(spmd, "tpu-v4").mfu is None and "MFU -" in simulate(spmd, "tpu-v4").table()


def _coll_program(dtype: str) -> SpmdProgram:
    ids = itertools.count()
    x = Var(next(ids), (1024, 1024), dtype)
    y = Var(next(ids), (1024, 1024), dtype)
    z = Var(next(ids), (1024, 1024), dtype)
    eqns = (Eqn("exp", (x,), (y,)), Eqn("all_reduce", (y,), (z,), {"axes": ("x",), "op": "sum"}))
    p = Program((x,), ("x",), eqns, (z,), ("z",))
    return SpmdProgram(Mesh(x=8), p, (Sharding.replicated(2),), (Sharding.replicated(2),), ((1024, 1024),),
                       ((1024, 1024),))


def test_collectives_are_priced_in_their_element_dtype():
    f32 = simulate(_coll_program("float32"), "tpu-v4")
    bf16 = simulate(_coll_program("bfloat16"), "tpu-v4")
    assert f32.collectives[0].nbytes == 2 * bf16.collectives[0].nbytes == 1024 * 1024 * 4
    assert bf16.comm_s < 0.6 * f32.comm_s


@pytest.mark.parametrize("hardware", ["tpu-v4", "a100"])
def test_des_sees_the_same_groups(hardware):
    p = trace(lambda x: jax.nn.softmax(x @ x.T, axis=-1), X)
    spmd = spmd_of(p)
    ana = simulate(spmd, hardware)
    des = simulate_des(spmd, hardware)
    assert des.step_s == pytest.approx(ana.step_s, rel=1e-9)


# -- eager stacks (PyTorch without torch.compile): one kernel per framework op --------------------
EAGER = load_spec("h100").with_stack(load_stack("pytorch-fsdp")).kernels


def _eager_block(x, w, b, g, beta):
    """``x + gelu(layernorm(x) @ w + b)`` with the ops tagged as the transformer scenario tags them."""
    with jax.named_scope("kernel:op.layernorm"):
        m = x.mean(-1, keepdims=True)
        xc = x - m
        h = xc * jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + 1e-5) * g + beta
    y = h.reshape(8, 8, 256).reshape(64, 256) @ w + b
    with jax.named_scope("kernel:op.gelu"):
        y = 0.5 * y * (1.0 + jnp.tanh(0.79788456 * (y + 0.044715 * y * y * y)))
    return x + y


def test_eager_stack_runs_each_framework_op_as_one_kernel():
    """Under pytorch-fsdp (eager): the LayerNorm is one kernel (read x, write h), the dot takes its bias
    add (cuBLASLt's epilogue: read h, w, b; write y), the GELU one kernel (read y, write it), the
    residual add one (read x and y, write the output); the reshapes are views and cost nothing. The
    bytes are that closed form. The chip's XLA grouping of the same program ignores the op tags."""
    vec = jnp.ones(256)
    args = (X, jnp.ones((256, 256)), vec, vec, vec)
    assert EAGER.eager and not load_spec("h100").kernels.eager
    p, plan = plan_of(_eager_block, *args, compiler=EAGER)
    assert groups(p, plan) == [
        ["reduce_sum", "broadcast_in_dim", "div", "sub", "mul", "reduce_sum", "broadcast_in_dim", "div", "add",
         "rsqrt", "mul", "broadcast_in_dim", "mul", "broadcast_in_dim", "add"],      # its broadcasts inside
        ["dot_general", "add"],
        ["mul", "mul", "mul", "mul", "add", "mul", "tanh", "add", "mul"],
        ["add"]]
    W, V = 256 * 256 * F32, 256 * F32
    assert plan.bytes.tolist() == [XB + 2 * V + XB, XB + W + V + XB, XB + XB, 2 * XB + XB]
    # the same program under the chip's own (XLA) compiler: the op tags are no kernels there
    untagged = Program(p.inputs, p.input_names, tuple(Eqn(e.prim, e.inputs, e.outputs, e.params, e.source)
                                                      for e in p.eqns), p.outputs, p.output_names, p.consts)
    xla = analyze(p).fusion.plan(GPU)
    assert groups(p, xla) == groups(untagged, analyze(untagged).fusion.plan(GPU))
    assert xla.bytes.tolist() == analyze(untagged).fusion.plan(GPU).bytes.tolist() and xla.hand_kernels == 0


def test_fusion_cache_keys_on_every_compiler_field_fuse_reads():
    """A program's FusionCache keeps one plan per ``CompilerSpec.variant``: asked for TPU, then GPU, then
    TPU again, each is the plan ``fuse`` makes afresh (no stale plan of the other chip's compiler), and
    every field but the launch overhead (which prices kernels, never groups them) changes the key."""
    import dataclasses

    import numpy as np

    from partir_emu.hwmodels.compute.fusion import fuse

    p = trace(_dense, X, W, BIAS)
    cache = analyze(p).fusion
    for compiler in (TPU, GPU, TPU, CompilerSpec(loop_fusion=True, eager=True, matmul_epilogue="bias")):
        got, fresh = cache.plan(compiler), fuse(p, cache._flops, cache._bytes, compiler)
        for f in dataclasses.fields(FusionPlan):
            assert np.array_equal(np.asarray(getattr(got, f.name)), np.asarray(getattr(fresh, f.name))), f.name
    other = {"loop_fusion": False, "matmul_operand_fusion": not TPU.matmul_operand_fusion, "matmul_epilogue": "bias",
             "eager": True, "hand_ops": frozenset({"layer_norm"}), "kernel_launch_s": 1.0}
    assert {f.name for f in dataclasses.fields(CompilerSpec)} == set(other), "a new CompilerSpec field: key it?"
    for name, value in other.items():
        changed = dataclasses.replace(TPU, **{name: value}).variant != TPU.variant
        assert changed == (name != "kernel_launch_s"), name
