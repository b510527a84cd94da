"""The inference scenario: prefill and decode over a KV cache (scenarios/inference/scenario.py), its
strategies (bp, mp, mq) verified against jax.jit on LocalMesh, the MQ layout (the cache stays
sharded on batch, no collective carries it), the closed forms, and the generalized Scenario
record (a state argument other than Adam's)."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from partir_emu.api import lower_program, trace
from partir_emu.app.experiment import Experiment, run_local
from partir_emu.compiler.tactics import ManualPartition
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from scenarios import get_scenario, list_scenarios
from scenarios.common import count_params

SC = get_scenario("inference")
PHASES = ("prefill", "decode")
CASES = [("bp", "batch=4"), ("mp", "model=4"), ("mq", "model=4"), ("bp+mp", "batch=2,model=2"),
         ("bp+mq", "batch=2,model=2"), ("mq+ws", "batch=2,model=2"), ("bp+auto", "batch=2,model=2")]


def test_registered_with_its_own_state():
    assert "inference" in list_scenarios()
    cfg = SC.config()
    names = SC.input_names(cfg)
    assert "cache/pos" in names and "cache/layer_1/v" in names and "batch/tokens" in names
    assert not any(n.startswith("opt/") for n in names)
    assert SC.arg_names == ("params", "cache", "batch") and dict(SC.state_outputs) == {"1": "cache"}
    params, cache, batch = SC.make_inputs(cfg, seed=0)
    assert SC.input_shapes(cfg)["cache/layer_0/k"] == cache["layer_0"]["k"].shape == (8, 8, 1, 4)
    assert SC.state_bytes(cfg) == sum(x.nbytes for x in (cache["pos"], *[a for v in cache.values()
                                                                           if isinstance(v, dict) for a in v.values()]))
    # the training scenarios keep Adam's state and names
    tr = get_scenario("transformer")
    assert tr.arg_names == ("params", "opt", "batch") and dict(tr.state_outputs) == {"1": "params", "2": "opt"}
    assert tr.state_bytes(tr.config()) == 2 * 4 * tr.param_count(tr.config()) + 4


@pytest.mark.parametrize("over", ["", "phase=prefill", "mlp=swiglu,block=parallel,tied=1,norm=rmsnorm",
                                  "kv_heads=2", "kv_heads=4,phase=prefill"])
def test_param_count_closed_form_matches_traced_program(over):
    cfg = SC.config("tiny", over)
    prog = trace(SC.make_step(cfg), *SC.abstract_inputs(cfg))
    traced = sum(math.prod(v.shape) for n, v in zip(prog.input_names, prog.inputs) if n.startswith("params/"))
    assert traced == SC.param_count(cfg) == count_params(SC.param_shapes(cfg))


def test_full_presets_are_palms_sizes():
    # PaLM (Chowdhery et al. 2022, Table 1): 540.35 B and 62.50 B parameters; ours adds a learned
    # position table (cache_len * d) that PaLM's RoPE does not have
    for preset, published in (("palm540b-decode", 540.35e9), ("palm62b-decode", 62.50e9)):
        cfg = SC.config(preset)
        n = SC.param_count(cfg)
        assert abs(n - published) / published < 2e-3, (preset, n)
        assert n == count_params(SC.param_shapes(cfg))
        assert cfg["kv_heads"] == 1 and preset in SC.simulation_only


def test_model_flops_formula():
    cfg = SC.config("tiny", "phase=prefill")
    d, f, L, V, T, H, Q = 16, 32, 2, 32, 8, 4, 4
    n = L * (2 * d * H * Q + 2 * d * Q + 2 * d * f) + d * V
    # the logits of the last position only: the unembedding once per sequence
    assert SC.model_flops(cfg) == 2 * (n - d * V) * 8 * 6 + 2 * d * V * 8 + 4 * L * H * Q * T * 8 * 6
    dec = SC.config("tiny")
    assert SC.model_flops(dec) == 2 * n * 8 + 4 * L * H * Q * T * 8


@pytest.mark.slow
def test_decode_continues_prefill():
    """Prefill of a prompt then decode of one more token gives the logits that prefill of the
    longer prompt gives for its last position (the cache is written and read where it should)."""
    import jax

    cfg = SC.config("tiny", "phase=prefill,prompt_len=5")
    params, cache, batch = SC.make_inputs(cfg, seed=3)
    longer = np.concatenate([batch["tokens"], batch["tokens"][:, :1]], axis=1)
    _, filled = jax.jit(SC.make_step(cfg))(params, cache, batch)
    assert int(filled["pos"]) == 5
    dec = SC.config("tiny", "prompt_len=5")
    logits, after = jax.jit(SC.make_step(dec))(params, filled, {"tokens": longer[:, 5:]})
    full = SC.config("tiny", "phase=prefill,prompt_len=6")
    ref, ref_cache = jax.jit(SC.make_step(full))(params, cache, {"tokens": longer})
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(after["layer_1"]["k"]), np.asarray(ref_cache["layer_1"]["k"]), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("strategy,mesh", CASES)
def test_strategy_verifies_against_jax_jit(strategy, mesh, phase):
    exp = Experiment("inference", strategy, Mesh.parse(mesh), overrides={"phase": phase})
    rep = run_local(exp)
    assert rep["verified"], rep["verdict"]
    assert rep["worst_output"] is not None


@pytest.mark.slow
@pytest.mark.parametrize("strategy,mesh,phase", [("mp", "model=4", "decode"), ("bp+mq", "batch=2,model=2", "prefill")])
def test_bf16_weights_and_cache_verify(strategy, mesh, phase):
    exp = Experiment("inference", strategy, Mesh.parse(mesh), overrides=f"precision=bf16,phase={phase}")
    assert {x.dtype.name for x in exp.inputs() if x.dtype.kind != "i"} == {"bfloat16"}
    rep = run_local(exp)
    assert rep["verified"], rep["verdict"]


def _cache_ins(spmd) -> dict[str, int]:
    return {n: i for i, n in enumerate(spmd.input_names) if n.startswith("cache/layer_")}


def _collectives_touching_cache(collectives, cfg) -> list:
    """Collectives whose operand or result has the cache's trailing dims [cache_len, kv, head_dim]."""
    tail = (cfg["cache_len"], cfg["kv_heads"], cfg["head_dim"])
    return [e for e in collectives
            if any(tuple(v.shape[-3:]) == tail for v in (*e.inputs, *e.outputs) if len(v.shape) >= 3)]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("mesh", ["model=4", "batch=2,model=2"])
def test_mq_keeps_the_cache_sharded_on_batch(mesh, phase):
    strategy = "mq" if mesh == "model=4" else "bp+mq"
    exp = Experiment("inference", strategy, Mesh.parse(mesh), overrides={"phase": phase})
    spmd = exp.lower().spmd
    for name, i in _cache_ins(spmd).items():
        assert "model" in spmd.in_shardings[i].dims[0], (name, spmd.in_shardings[i])
        out = spmd.output_names.index("1/" + name.removeprefix("cache/"))
        assert spmd.out_shardings[out] == spmd.in_shardings[i], name
    assert _collectives_touching_cache(spmd.collectives(), exp.cfg) == []


@pytest.mark.parametrize("phase", PHASES)
def test_mq_moves_queries_and_attention_outputs_only(phase):
    """Pope et al.'s multi-query layout: per layer one all_to_all of the queries (heads -> batch)
    and one of the attention output back; the residual stream's all_gather and reduce_scatter;
    no collective carries a weight (or, above, the cache)."""
    exp = Experiment("inference", "mq", Mesh.parse("model=4"), overrides={"phase": phase})
    spmd = exp.lower().spmd
    cfg, layers = exp.cfg, exp.cfg["layers"]
    prims = Counter(e.prim for e in spmd.collectives())
    assert prims == {"all_to_all": 2 * layers, "all_gather": 2 * layers, "reduce_scatter": 2 * layers}
    b, s, heads, dh = cfg["batch"], (cfg["prompt_len"] if phase == "prefill" else 1), cfg["heads"], cfg["head_dim"]
    a2a = [tuple(e.inputs[0].shape) for e in spmd.collectives() if e.prim == "all_to_all"]
    assert set(a2a) == {(b, s, 1, heads // 4, dh), (b // 4, s, 1, heads, dh)}
    weights = {tuple(shape) for n, shape in SC.input_shapes(cfg).items() if n.startswith("params/")}
    for e in spmd.collectives():
        assert all(len(v.shape) == 3 and v.shape[0] in (b, b // 4) for v in (*e.inputs, *e.outputs)
                   if e.prim != "all_to_all"), e
        assert not {tuple(v.shape) for v in (*e.inputs, *e.outputs)} & weights, e


@pytest.mark.parametrize("phase", PHASES)
def test_mq_ws_shards_every_weight_on_both_axes_and_moves_activations_only(phase):
    """Pope et al.'s 2D weight-stationary layout with multi-query attention (``mq+ws``): every
    layer matrix is tiled on both axes (d_model by the data axis, heads or d_ff by ``model``), the
    cache on batch by both, and no collective carries a weight or the cache: what moves is the
    activations (and the norms' statistics), as in the paper's Fig. 4b/5."""
    exp = Experiment("inference", "mq+ws", Mesh.parse("batch=2,model=2"), overrides={"phase": phase})
    spmd = exp.lower().spmd
    for i, name in enumerate(spmd.input_names):
        if name.startswith("params/layer_") and len(spmd.program.inputs[i].shape) == 2 and "w_k" not in name \
                and "w_v" not in name:
            assert set(spmd.in_shardings[i].axes()) == {"batch", "model"}, (name, spmd.in_shardings[i])
    for name, i in _cache_ins(spmd).items():
        assert set(spmd.in_shardings[i].dims[0]) == {"batch", "model"}, (name, spmd.in_shardings[i])
    weights = {tuple(shape) for n, shape in SC.input_shapes(exp.cfg).items() if n.startswith("params/")}
    for e in spmd.collectives():
        assert not {tuple(v.shape) for v in (*e.inputs, *e.outputs)} & weights, e
    assert _collectives_touching_cache(spmd.collectives(), exp.cfg) == []


@pytest.mark.slow
def test_palm540b_decode_fits_64_chips_with_2d_weight_stationary():
    """Pope et al. serve PaLM 540B on 64 TPU v4 chips: weights on all 64 (2D weight-stationary); ``bp+mq``
    keeps a copy per data group and does not fit 32 GiB, ``mq+ws`` does (priced, not run)."""
    from partir_emu.hwmodels import simulate
    peak = {}
    for st in ("bp+mq", "mq+ws"):
        exp = Experiment("inference", st, Mesh.parse("batch=4,model=16"), "palm540b-decode")
        peak[st] = simulate(exp.lower().spmd, "tpu-v4").peak_bytes_per_device
    cap = 32 * 2**30
    assert peak["mq+ws"] < cap < peak["bp+mq"], peak


def _split(exp: Experiment, cache_first: bool) -> list:
    (mq,) = exp.schedule
    cache = ManualPartition({k: d for k, d in mq.inputs.items() if k.startswith("cache/")}, axis="model")
    heads = ManualPartition({k: d for k, d in mq.inputs.items() if k.startswith("params/")}, axis="model")
    low = lower_program(exp.program, exp.mesh, [cache, heads] if cache_first else [heads, cache], {"1": "cache"})
    return low.spmd.collectives()


def test_mq_as_two_tactics_gathers_the_cache_or_the_weights():
    """Why ``mq`` is one tactic (scenarios/inference/strategies.py): heads first, the queries'
    tiling wins at the attention einsum and the cache is all-gathered there (the check above can
    fail); cache first, the batch tiling takes the residual stream and every attention and MLP
    weight is all-gathered."""
    exp = Experiment("inference", "mq", Mesh.parse("model=4"))
    gathered = _collectives_touching_cache(_split(exp, cache_first=False), exp.cfg)
    assert gathered and {e.prim for e in gathered} == {"all_gather"}
    weights = {tuple(shape) for n, shape in SC.input_shapes(exp.cfg).items()
               if n.startswith("params/layer_") and len(shape) == 2}
    by_cache = _split(exp, cache_first=True)
    assert {e.prim for e in by_cache} == {"all_gather"}
    assert {tuple(e.outputs[0].shape) for e in by_cache} == weights - {(16, 4)}   # all but w_k, w_v


def test_mq_says_its_seeds_meet_so_the_compiler_reshards_without_a_warning():
    """``mq`` is one tactic whose seeds are meant to meet (``meet="reshard"``): the conflicts between
    them are recorded as intended and resharded, not warned about ("split the tactic" would be the
    wrong advice, see the test above). The same tactic with the default ``meet="warn"`` lowers to
    the same program and warns, naming the tactic; an unknown ``meet`` is refused."""
    import dataclasses

    from partir_emu.errors import TacticError
    exp = Experiment("inference", "mq", Mesh.parse("model=4"), overrides={"phase": "decode"})
    (mq,) = exp.schedule
    assert mq.meet == "reshard"
    low = lower_program(exp.program, exp.mesh, [mq], {"1": "cache"})
    assert low.warnings == []
    intended = [c for c in low.final_state.conflicts if c.within_tactic]
    assert intended and all(c.intended for c in intended)
    assert "intended (meet=reshard)" in low.final_state.pretty()
    plain = lower_program(exp.program, exp.mesh, [dataclasses.replace(mq, meet="warn")], {"1": "cache"})
    assert [e.prim for e in plain.spmd.collectives()] == [e.prim for e in low.spmd.collectives()]
    lines = plain.warnings
    assert lines and all("tactic 'mq:model'" in ln and "split the tactic" in ln for ln in lines)
    with pytest.raises(TacticError, match="meet='sometimes'"):
        ManualPartition({"cache/*": 0}, axis="model", meet="sometimes")


def test_mp_replicates_a_multi_query_cache_on_model():
    exp = Experiment("inference", "mp", Mesh.parse("model=4"))
    spmd = exp.lower().spmd
    for i in _cache_ins(spmd).values():
        assert spmd.in_shardings[i].axes() == ()
    gqa = Experiment("inference", "mp", Mesh.parse("model=2"), overrides="kv_heads=2")
    spmd = gqa.lower().spmd
    assert all(spmd.in_shardings[i].dims[2] == ("model",) for i in _cache_ins(spmd).values())


def test_strategy_tactics_are_manual_partitions_in_order():
    tactics = SC.strategy("bp+mq", Mesh.parse("batch=2,model=2"), SC.config())
    assert [t.name for t in tactics] == ["bp:batch", "mq:model"]
    assert next(iter(tactics[1].inputs)) == "cache/layer_*"        # the cache's seed first
    assert all(isinstance(t, ManualPartition) for t in tactics)
    assert tactics == SC.strategies["bp+mq"](Mesh.parse("batch=2,model=2"))


@pytest.mark.parametrize("strategy,mesh,over,needle", [
    ("bp+mq", "batch=4,model=4", None, "batch 8"),
    ("mp", "model=3", None, "heads=4"),
    ("mq", "batch=2", None, "model"),
    ("bp", "batch=2", "phase=prefill,prompt_len=9", "cache_len"),
    ("bp", "batch=2", "kv_heads=3", "kv_heads=3"),
])
def test_bad_input_names_the_value(strategy, mesh, over, needle):
    with pytest.raises(ScenarioError, match=needle):
        SC.strategy(strategy, Mesh.parse(mesh), SC.config("tiny", over))
