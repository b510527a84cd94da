"""The transformer's shape options (head_dim, kv_heads, mlp, block, tied, norm, bias, attention,
precision): each alone and a pairwise covering set, under every strategy, partitioned and run on
the in-process mesh and checked against jax.jit; flash attention's kernel marking; the closed-form
parameter count and model FLOPs; full-size published configs trace and partition.

Emulation runs use strict mode (loss and gradients before Adam, elementwise vs jax.jit): Adam
turns rounding noise in near-zero gradients into updates of size ``lr``, which the normwise
full-step verdict tolerates only in part, and strict mode needs one jax.jit compile instead of
two, which keeps this file near a minute.
"""
from __future__ import annotations

import functools
import itertools
import math

import jax
import numpy as np
import pytest

from partir_emu.api import lower_program, trace
from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from partir_emu.primitives.dot import dot_general_cost
from partir_emu.runtime.local_mesh import LocalMesh
from scenarios import get_scenario
from scenarios.common import STATE_OUTPUTS, count_params

pytestmark = pytest.mark.xdist_group("transformer_shapes")    # its cached programs and references: made once, on one worker

SC = get_scenario("transformer")
MESH = Mesh(batch=2, model=2)
BASE = dict(batch=4, seq=8, layers=1)            # tiny: d_model 16, heads 4, d_ff 32, vocab 32
# every non-default value of every option, alone
SINGLES = [dict(head_dim=8), dict(kv_heads=2), dict(kv_heads=1), dict(mlp="relu"), dict(mlp="swiglu"),
           dict(block="parallel"), dict(tied=1), dict(norm="rmsnorm"), dict(bias="0"), dict(bias="1"),
           dict(attention="flash"), dict(remat="selective"), dict(remat="minimal"), dict(remat="dots"),
           dict(remat="selective", attention="flash"), dict(remat="op"), dict(remat="op", attention="flash", mlp="swiglu")]
FACTORS = {"kv_heads": [4, 2, 1], "mlp": ["gelu", "relu", "swiglu"], "bias": ["mlp", "0", "1"],
           "head_dim": [4, 8], "block": ["serial", "parallel"], "tied": [0, 1],
           "norm": ["layernorm", "rmsnorm"], "attention": ["naive", "flash"], "remat": [0, 1]}
# every pair of values of every two options occurs in some row (test_pairwise_set_covers_every_pair)
PAIRWISE = [dict(zip(FACTORS, row)) for row in [
    (4, "gelu", "mlp", 4, "serial", 1, "layernorm", "flash", 1),
    (4, "relu", "0", 8, "parallel", 0, "rmsnorm", "naive", 0),
    (4, "swiglu", "1", 8, "serial", 1, "rmsnorm", "naive", 1),
    (2, "gelu", "0", 8, "serial", 0, "layernorm", "flash", 0),
    (2, "relu", "1", 4, "parallel", 1, "layernorm", "flash", 1),
    (2, "swiglu", "mlp", 8, "parallel", 0, "rmsnorm", "flash", 0),
    (1, "gelu", "1", 8, "parallel", 0, "rmsnorm", "naive", 0),
    (1, "relu", "mlp", 4, "serial", 1, "layernorm", "naive", 0),
    (1, "swiglu", "0", 4, "parallel", 0, "rmsnorm", "flash", 1),
    (2, "swiglu", "0", 4, "serial", 1, "layernorm", "naive", 0),
]]


@pytest.fixture(scope="module", autouse=True)
def _quick_xla():
    """jax.jit without most of XLA's optimisation passes: the reference computes the same step and
    compiles in about half the time (this file compiles ~30 tiny steps)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def _label(opts: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in opts.items())


def _run_all_strategies(opts: dict, *, strict: bool = True) -> dict[str, object]:
    """Trace once, then every strategy: lower, run on LocalMesh, judge against one jax.jit reference."""
    overrides = dict(BASE, **opts)
    base = Experiment("transformer", "bp", MESH, "tiny", overrides, strict=strict)
    refs = None
    verdicts = {}
    for name in sorted(SC.strategies):
        exp = Experiment("transformer", name, MESH, "tiny", overrides, strict=strict)
        exp.__dict__["program"] = base.program          # the same traced step for every strategy
        low = exp.lower()
        inputs = exp.inputs(low.spmd.input_names)
        if refs is None:
            refs = base.references(inputs)
        res = LocalMesh(MESH).run(low.spmd, inputs)
        verdicts[name] = exp.check(res.outputs, inputs, low.spmd.output_names, refs)
    return verdicts


# -- option parsing -------------------------------------------------------------------------------

def test_defaults_are_the_original_model():
    cfg = SC.config("tiny")
    assert cfg == dict(SC.presets["tiny"], head_dim=4, kv_heads=4)
    assert (cfg["precision"], cfg["mlp"], cfg["block"], cfg["tied"], cfg["norm"], cfg["bias"],
            cfg["attention"]) == ("f32", "gelu", "serial", 0, "layernorm", "mlp", "naive")
    for preset in ("t32", "t48"):
        full = SC.config(preset)
        assert (full["precision"], full["attention"], full["remat"]) == ("bf16", "flash", "1")
    # remat is a choice: 0/1 as before, or a recompute policy
    assert [SC.config("tiny", f"remat={r}")["remat"] for r in (0, 1, "selective", "minimal")] == ["0", "1", "selective", "minimal"]
    with pytest.raises(ScenarioError, match="remat"):
        SC.config("tiny", "remat=some")
    # strings and ints both work; a switch or choice given as an int is normalised
    cfg = SC.config("tiny", "precision=bf16, mlp=swiglu, bias=1, tied=1, head_dim=8, kv_heads=2")
    assert (cfg["precision"], cfg["mlp"], cfg["bias"], cfg["tied"], cfg["head_dim"]) == ("bf16", "swiglu", "1", 1, 8)
    assert SC.config("tiny", {"bias": 0, "norm": "rmsnorm"})["bias"] == "0"


@pytest.mark.parametrize("overrides, needle", [
    ("precision=fp16", r"'precision'.*one of f32\|bf16.*'fp16'"),
    ("mlp=geglu", r"'mlp'.*gelu\|relu\|swiglu.*'geglu'"),
    ("block=sequential", r"'block'.*serial\|parallel"),
    ("norm=batchnorm", r"'norm'.*layernorm\|rmsnorm"),
    ("bias=2", r"'bias'.*mlp\|0\|1.*'2'"),
    ("attention=paged", r"'attention'.*naive\|flash\|ring.*'paged'"),
    ("tied=yes", r"'tied'.*tied=0 or tied=1"),
    ("kv_heads=3", r"kv_heads=3 does not divide heads=4"),
    ("head_dim=0", r"'head_dim'.*positive integer"),
    ("heads=3", r"d_model=16 is not divisible by heads=3.*head_dim"),
])
def test_bad_options(overrides, needle):
    with pytest.raises(ScenarioError, match=needle):
        SC.config("tiny", overrides)


def test_heads_need_not_divide_d_model_with_head_dim():
    cfg = SC.config("tiny", "heads=3,head_dim=8,kv_heads=1")
    assert SC.param_shapes(cfg)["layer_0"]["attn"]["w_q"] == (16, 24)
    assert SC.param_shapes(cfg)["layer_0"]["attn"]["w_k"] == (16, 8)


# -- every option under every strategy ---------------------------------------------------------------

def test_pairwise_set_covers_every_pair():
    want = {(a, x, b, y) for a, b in itertools.combinations(FACTORS, 2) for x in FACTORS[a] for y in FACTORS[b]}
    got = {(a, row[a], b, row[b]) for row in PAIRWISE for a, b in itertools.combinations(FACTORS, 2)}
    assert want == got


@pytest.mark.slow
@pytest.mark.parametrize("opts", SINGLES + PAIRWISE, ids=_label)
def test_option_partitions_and_verifies(opts):
    verdicts = _run_all_strategies(opts)
    assert set(verdicts) >= {"bp", "mp", "z2", "z3", "bp+mp", "bp+mp+z2", "bp+mp+z3", "bp+auto"}
    bad = {name: v.summary() for name, v in verdicts.items() if not v.verified}
    assert not bad, bad


def test_megatron_kv_sharding_follows_kv_heads():
    """k/v projections are column-parallel when kv_heads divides the model axis, else replicated."""
    def model_dims(opts: dict, mesh: Mesh) -> dict[str, int | None]:
        cfg = SC.config("tiny", dict(BASE, **opts))
        [mp] = SC.strategy("mp", mesh, cfg)
        return {k: mp.inputs.get(f"params/layer_*/{k}") for k in ("attn/w_q", "attn/w_k", "attn/w_v", "attn/w_o")}

    assert model_dims({}, MESH) == {"attn/w_q": 1, "attn/w_k": 1, "attn/w_v": 1, "attn/w_o": 0}
    assert model_dims(dict(kv_heads=2), MESH) == {"attn/w_q": 1, "attn/w_k": 1, "attn/w_v": 1, "attn/w_o": 0}
    assert model_dims(dict(kv_heads=1), MESH) == {"attn/w_q": 1, "attn/w_k": None, "attn/w_v": None, "attn/w_o": 0}
    cfg = SC.config("tiny", dict(BASE, mlp="swiglu", bias="1", tied=1))
    [mp] = SC.strategy("mp", MESH, cfg)
    assert {k.rsplit("/", 1)[-1]: d for k, d in mp.inputs.items() if k.startswith("params/layer_*/mlp/")} == \
        {"w_gate": 1, "w_up": 1, "w_down": 0, "b_gate": 0, "b_up": 0}
    assert "params/unembed/w" not in mp.inputs and "params/embed/tokens" not in mp.inputs


@pytest.mark.slow
def test_grouped_query_with_more_model_devices_than_kv_heads():
    """kv_heads=2 on a model axis of 4: k/v replicated, the query heads still split 4 ways."""
    mesh = Mesh(batch=1, model=4)
    exp = Experiment("transformer", "mp", mesh, "tiny", dict(BASE, heads=8, d_model=32, kv_heads=2,
                                                               attention="flash"), strict=True)
    low = exp.lower()
    inputs = exp.inputs(low.spmd.input_names)
    v = exp.check(LocalMesh(mesh).run(low.spmd, inputs).outputs, inputs, low.spmd.output_names,
                  exp.references(inputs))
    assert v.verified, v.summary()


# -- bf16 ------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("opts", [dict(precision="bf16", attention="flash", mlp="swiglu", norm="rmsnorm",
                                       kv_heads=2, tied=1, block="parallel", remat=1)], ids=_label)
def test_bf16_partitions_and_verifies(opts):
    verdicts = _run_all_strategies(opts, strict=False)
    bad = {name: v.summary() for name, v in verdicts.items() if not v.verified}
    assert not bad, bad


def test_bf16_program_dtypes():
    """Master weights, Adam state and loss stay float32; matmuls take bfloat16."""
    cfg = SC.config("tiny", dict(BASE, precision="bf16", attention="flash"))
    prog = trace(SC.make_step(cfg), *SC.abstract_inputs(cfg))
    assert all(v.dtype in ("float32", "int32") for v in prog.inputs)
    assert all(v.dtype in ("float32", "int32") for v in prog.outputs)
    dots = [e for e in prog.eqns if e.prim == "dot_general"]
    assert dots and all(x.dtype == "bfloat16" for e in dots for x in e.inputs)
    # the softmax runs in float32 inside the kernel: its exps are float32
    assert all(e.outputs[0].dtype == "float32" for e in prog.eqns if e.prim == "exp" and e.kernel)


# -- flash attention ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("precision, tol", [("f32", 1e-5), ("bf16", 5e-2)])
def test_flash_equals_naive_under_jit(precision, tol):
    opts = dict(BASE, precision=precision, kv_heads=2)
    naive, flash = SC.config("tiny", dict(opts, attention="naive")), SC.config("tiny", dict(opts, attention="flash"))
    inputs = SC.make_inputs(naive, seed=3)
    (ln, gn), (lf, gf) = (jax.jit(SC.make_step(c, grads_only=True))(*inputs) for c in (naive, flash))
    assert float(lf) == pytest.approx(float(ln), rel=tol)
    for a, b in zip(jax.tree.leaves(gn), jax.tree.leaves(gf)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(a)) + 1e-12


@functools.cache
def _flash_program(remat: int):
    cfg = SC.config("tiny", dict(BASE, attention="flash", remat=remat, layers=2))
    return cfg, trace(SC.make_step(cfg), *SC.abstract_inputs(cfg))


def test_flash_kernel_is_marked_and_seals_the_scores():
    for remat in (0, 1):
        cfg, prog = _flash_program(remat)
        s = cfg["seq"]
        kernels = [e.kernel for e in prog.eqns]
        # besides the flash kernel, the framework ops an eager stack runs as single kernels (op.*)
        assert {k for k in kernels if not k.startswith("op.")} == {"", "flash_attention", "flash_attention/bwd"}
        assert {k for k in kernels if k.startswith("op.")} == {
            f"op.{name}{bwd}" for name in ("layernorm", "gelu", "cross_entropy") for bwd in ("", "/bwd")} | {"op.adam"}
        # per layer: q·k and p·v forward (twice with remat: the recomputation), and the backward's
        # recomputed scores, dv, dp, dq, dk
        dots = [e.kernel for e in prog.eqns if e.prim == "dot_general" and e.kernel]
        assert dots.count("flash_attention") == 2 * cfg["layers"] * (1 + remat)
        assert dots.count("flash_attention/bwd") == 5 * cfg["layers"]
        # no [.., s, s] value crosses the kernel boundary, either way
        producer = {o: e for e in prog.eqns for o in e.outputs}
        square = 0
        for e in prog.eqns:
            for x in (*e.inputs, *e.outputs):
                if getattr(x, "shape", ())[-2:] == (s, s):
                    square += 1
                    p = producer.get(x)
                    assert e.kernel and (p is None or p.kernel), (e.prim, e.kernel, p and p.prim, x.shape)
        assert square > 0
    # the same count of backward equations with and without remat; twice the forward with it
    fwd = [sum(e.kernel == k for e in _flash_program(r)[1].eqns) for r in (0, 1) for k in ("flash_attention",)]
    bwd = [sum(e.kernel == "flash_attention/bwd" for e in _flash_program(r)[1].eqns) for r in (0, 1)]
    assert fwd[1] == 2 * fwd[0] and bwd[0] == bwd[1]


# -- parameter count and model FLOPs ---------------------------------------------------------------

@pytest.mark.parametrize("opts", SINGLES + PAIRWISE, ids=_label)
def test_param_count_closed_form(opts):
    cfg = SC.config("tiny", dict(BASE, **opts))
    params = SC.make_params(cfg, np.random.default_rng(0))
    assert sum(x.size for x in jax.tree.leaves(params)) == SC.param_count(cfg) == count_params(SC.param_shapes(cfg))


def _traced_matmul_flops(sc, cfg) -> int:
    prog = trace(sc.make_step(cfg), *sc.abstract_inputs(cfg))
    return int(sum(dot_general_cost(e)[0] for e in prog.eqns if e.prim == "dot_general"))


@pytest.mark.parametrize("opts", [{}, PAIRWISE[2], PAIRWISE[4]], ids=lambda o: _label(o) or "default")
def test_model_flops_equal_the_traced_matmuls(opts):
    """Without recomputation and with naive attention, every matmul the step does is a model FLOP:
    6·N per token for the weights (forward, and both gradients) and 12·L·H·Q·T for attention."""
    cfg = SC.config("tiny", dict(BASE, **dict(opts, attention="naive", remat=0)))
    assert _traced_matmul_flops(SC, cfg) == SC.model_flops(cfg)
    # flash recomputes the scores in its backward (hardware FLOPs, not model FLOPs): 2·b·H·s²·Q more
    flash = SC.config("tiny", dict(BASE, **dict(opts, attention="flash", remat=0)))
    extra = 2 * cfg["layers"] * cfg["batch"] * cfg["heads"] * cfg["seq"] ** 2 * cfg["head_dim"]
    assert _traced_matmul_flops(SC, flash) == SC.model_flops(flash) + extra


def test_mlp_model_flops():
    sc = get_scenario("mlp")
    cfg = sc.config("tiny")
    # the first layer's input gradient is not computed (the data is not differentiated); the
    # PaLM count includes it anyway
    assert _traced_matmul_flops(sc, cfg) == sc.model_flops(cfg) - 2 * cfg["batch"] * cfg["d_in"] * cfg["hidden"]


def test_model_flops_of_a_published_model():
    """MaxText's 22B config: about 6·N·tokens with N ≈ 22 B, plus attention."""
    cfg = SC.config("t32", MAXTEXT_22B)
    n = 48 * (4 * 6144 * 6144 + 2 * 6144 * 24576) + 6144 * 32768
    tokens = 1024 * 1024
    assert SC.model_flops(cfg) == 6 * n * tokens + 12 * 48 * 24 * 256 * 1024 * tokens
    assert 21.5e9 < SC.param_count(cfg) < 22.5e9


# -- full-size published configs: trace and partition -----------------------------------------------

MEGATRON_1_7B = dict(batch=512, seq=2048, d_model=2304, heads=24, d_ff=4 * 2304, layers=24, vocab=51200, tied=1,
                     mlp="gelu", norm="layernorm", bias=1, attention="naive", precision="bf16", remat=1)
MAXTEXT_22B = dict(batch=1024, seq=1024, d_model=6144, heads=24, head_dim=256, d_ff=24576, layers=48,
                   vocab=32768, tied=1, mlp="relu", norm="rmsnorm", bias=0, block="parallel", precision="bf16",
                   attention="flash", remat=1)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, mesh", [(MEGATRON_1_7B, "batch=32"), (MAXTEXT_22B, "batch=64")],
                         ids=["megatron-1.7b", "maxtext-22b"])
def test_published_config_traces_and_partitions(overrides, mesh):
    m = Mesh.parse(mesh)
    cfg = SC.config("t32", overrides)
    prog = trace(SC.make_step(cfg), *SC.abstract_inputs(cfg))
    low = lower_program(prog, m, SC.strategy("bp", m, cfg), STATE_OUTPUTS)
    assert {e.prim for e in low.spmd.collectives()} == {"all_reduce"}
    assert math.isclose(sum(math.prod(v.shape) for v, n in zip(prog.inputs, prog.input_names)
                            if n.startswith("params/")), SC.param_count(cfg))


def test_recompute_policies_recompute_what_they_say():
    """The traced step's matmul FLOPs order the policies: none < dots (every dot output kept: only
    elementwise work is recomputed) <= selective (the attention core's two dots again) <= minimal (the
    dots with batch dimensions, i.e. attention's, again) < full (every forward dot again)."""
    flops = {}
    for remat in ("0", "dots", "op", "selective", "minimal", "1"):
        exp = Experiment("transformer", "bp", Mesh(batch=1), "tiny", dict(BASE, layers=2, remat=remat))
        prog = exp.program
        flops[remat] = sum(dot_general_cost(e)[0] for e in prog.eqns if e.prim == "dot_general")
    assert flops["0"] == flops["dots"] < flops["selective"] <= flops["minimal"] < flops["1"], flops
    # op (torchtitan's per-op SAC) with a flash core: of a layer's six dots q, k, v, o, in, out the
    # 2nd, 4th and 6th are not kept and the kernel keeps its output and log-sum-exp (no second flash
    # forward); the backward needs k again (the kernel's input) and o's output (the residual sum the
    # second norm's backward reads), not out's (the next layer's input is kept): what is recomputed
    # is the k and o projections, 2·tokens·d·(kv_heads + heads)·head_dim FLOPs per layer
    def dot_flops(remat):
        exp = Experiment("transformer", "bp", Mesh(batch=1), "tiny",
                         dict(BASE, layers=2, remat=remat, attention="flash"))
        return exp.cfg, sum(dot_general_cost(e)[0] for e in exp.program.eqns if e.prim == "dot_general")
    (cfg, none), (_, op) = dot_flops("0"), dot_flops("op")
    k_and_o = 2 * cfg["batch"] * cfg["seq"] * cfg["d_model"] * (cfg["kv_heads"] + cfg["heads"]) * cfg["head_dim"]
    assert op - none == cfg["layers"] * k_and_o, (op, none)
