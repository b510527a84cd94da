"""scenarios/: steps run and train, sizes resolve, strategies address the real input names."""
from __future__ import annotations

import fnmatch
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partir_emu.compiler.auto.tactic import AutomaticPartition
from partir_emu.compiler.tactics import REPLICATED, ManualPartition
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from scenarios import adam_init, adam_update, get_scenario, input_names, list_scenarios, resolve_size

pytestmark = pytest.mark.xdist_group("scenarios")    # its cached programs and references: made once, on one worker

SCENARIOS = ["mlp", "transformer"]
MESHES = [Mesh(batch=2, model=2), Mesh(batch=4, model=2), Mesh(pod=2, batch=2, model=2)]
FULL_PRESETS = [("mlp", "full"), ("transformer", "t32"), ("transformer", "t48")]
# Documented in the scenario modules' docstrings (computed from the formula, checked below).
DOCUMENTED_COUNTS = {("mlp", "full"): 1_073_905_664, ("transformer", "t32"): 2_780_124_160,
                     ("transformer", "t48"): 5_752_510_464}


@pytest.fixture(scope="module", params=SCENARIOS)
def tiny(request):
    sc = get_scenario(request.param)
    cfg = sc.config("tiny")
    return sc, cfg, jax.jit(sc.make_step(cfg))


def _names_and_shapes(sc, cfg):
    shapes = sc.input_shapes(cfg)
    return list(shapes), shapes


# -- registry and sizes ----------------------------------------------------------------------------

def test_registry():
    assert set(SCENARIOS) <= set(list_scenarios())
    for name in list_scenarios():
        assert get_scenario(name).name == name
    with pytest.raises(ScenarioError, match=r"'nope'.*mlp.*transformer"):
        get_scenario("nope")


def test_resolve_size_overrides():
    sc = get_scenario("mlp")
    assert resolve_size(sc, "tiny", "batch=128, hidden=1024") == dict(sc.presets["tiny"], batch=128, hidden=1024)
    assert resolve_size("mlp", "tiny", {"layers": 3})["layers"] == 3
    assert resolve_size(sc, "tiny", "") == sc.presets["tiny"]
    assert sc.config() == sc.presets["tiny"]


@pytest.mark.parametrize("overrides, needle", [
    ("bach=128", r"'bach'.*valid names: batch, d_in, hidden, d_out, layers"),
    ("batch=1.5", r"'batch'.*positive integer.*'1.5'"),
    ("batch=abc", r"'batch'.*'abc'"),
    ("hidden=0", r"'hidden'.*positive integer"),
    ("layers=-2", r"'layers'"),
    ("batch", r"NAME=INT.*valid names"),
    ({"batch": True}, r"'batch'"),
    ({"batch": 2.0}, r"'batch'"),
])
def test_resolve_size_errors(overrides, needle):
    with pytest.raises(ScenarioError, match=needle):
        resolve_size(get_scenario("mlp"), "tiny", overrides)


def test_resolve_size_bad_preset_and_constraint():
    with pytest.raises(ScenarioError, match=r"'huge'.*tiny, small, t32, t48"):
        resolve_size("transformer", "huge", None)
    with pytest.raises(ScenarioError, match=r"d_model=16 is not divisible by heads=3"):
        resolve_size("transformer", "tiny", "heads=3")


# -- the steps ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_step_runs_under_jit(tiny):
    sc, cfg, step = tiny
    params, opt, batch = sc.make_inputs(cfg, seed=0)
    for leaf in jax.tree.leaves((params, opt, batch)):
        assert isinstance(leaf, np.ndarray) and leaf.dtype in (np.float32, np.int32)
    loss, new_params, new_opt = step(params, opt, batch)
    assert loss.shape == () and loss.dtype == jnp.float32 and np.isfinite(float(loss))
    assert jax.tree.structure(new_params) == jax.tree.structure(params)
    assert jax.tree.structure(new_opt) == jax.tree.structure(opt)
    for a, b in zip(jax.tree.leaves((params, opt)), jax.tree.leaves((new_params, new_opt))):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert int(new_opt["count"]) == 1
    # abstract_inputs mirrors make_inputs exactly
    abstract = sc.abstract_inputs(cfg)
    assert jax.tree.structure(abstract) == jax.tree.structure((params, opt, batch))
    for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves((params, opt, batch))):
        assert (a.shape, a.dtype) == (r.shape, r.dtype)
    # reproducible
    again = sc.make_inputs(cfg, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves((params, opt, batch))))


def test_tiny_loss_decreases(tiny):
    sc, cfg, step = tiny
    params, opt, batch = sc.make_inputs(cfg, seed=1)
    losses = []
    for _ in range(3):
        loss, params, opt = step(params, opt, batch)
        losses.append(float(loss))
    assert losses[0] > losses[1] > losses[2], losses


def test_input_names(tiny):
    sc, cfg, _ = tiny
    names = sc.input_names(cfg)
    assert names == input_names(*sc.make_inputs(cfg))
    assert len(names) == len(set(names))
    assert "opt/count" in names
    expected = {
        "mlp": ["params/layer_1/w_in", "opt/mu/layer_1/w_out", "opt/nu/layer_0/b_in", "batch/x", "batch/y"],
        "transformer": ["params/embed/tokens", "params/embed/pos", "params/layer_1/attn/w_q",
                        "params/layer_0/ln1/scale", "opt/mu/layer_1/mlp/w_in", "params/final_ln/bias",
                        "params/unembed/w", "batch/tokens", "batch/targets"],
    }[sc.name]
    assert set(expected) <= set(names)


@pytest.mark.slow
@pytest.mark.parametrize("scenario, preset", FULL_PRESETS)
def test_full_size_param_count(scenario, preset):
    sc = get_scenario(scenario)
    cfg = sc.config(preset)
    assert preset in sc.simulation_only
    params, opt, batch = sc.abstract_inputs(cfg)
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    assert counted == sc.param_count(cfg) == DOCUMENTED_COUNTS[(scenario, preset)]
    assert sum(math.prod(x.shape) for x in jax.tree.leaves((opt["mu"], opt["nu"]))) == 2 * counted
    assert all(x.shape[0] == cfg["batch"] for x in jax.tree.leaves(batch))


def test_full_size_traces_abstractly():
    sc = get_scenario("transformer")
    cfg = sc.config("t32", "layers=2")          # full widths, few layers: keeps the test fast
    loss, params, opt = jax.eval_shape(sc.make_step(cfg), *sc.abstract_inputs(cfg))
    assert loss.shape == ()
    assert params["unembed"]["w"].shape == (cfg["d_model"], cfg["vocab"])


def test_adam_matches_reference():
    rng = np.random.default_rng(0)
    p = {"a": rng.standard_normal((3, 4)).astype(np.float32)}
    g = {"a": rng.standard_normal((3, 4)).astype(np.float32)}
    state = adam_init(p)
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    m, v = np.zeros_like(p["a"]), np.zeros_like(p["a"])
    ref = p["a"].astype(np.float64)
    new_p = p
    for t in (1, 2):
        new_p, state = adam_update(g, state, new_p, lr=lr, b1=b1, b2=b2, eps=eps)
        m = b1 * m + (1 - b1) * g["a"]
        v = b2 * v + (1 - b2) * g["a"] ** 2
        ref = ref - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    np.testing.assert_allclose(np.asarray(new_p["a"]), ref, rtol=1e-5, atol=1e-6)
    assert int(state["count"]) == 2


# -- strategies --------------------------------------------------------------------------------------

def _apply(tactics: list[ManualPartition], names: list[str], shapes: dict, mesh: Mesh):
    """Simulate the manual part of the schedule: name -> {dim: [axes]}; check every rule the brief sets."""
    tiling: dict[str, dict[int, list[str]]] = {n: {} for n in names}
    for t in tactics:
        if isinstance(t, AutomaticPartition):   # searched at partition time: nothing to check statically
            assert t.axis in mesh.axis_names and t.name
            continue
        assert t.axis in mesh.axis_names and t.name and not t.allow_unmatched
        for pat in t.inputs:
            assert any(fnmatch.fnmatchcase(n, pat) for n in names), (t.name, pat)
        for i, dim in t.resolve(names).items():   # raises TacticError on an unmatched pattern
            if dim is REPLICATED:
                continue
            name = names[i]
            assert 0 <= dim < len(shapes[name]), (t.name, name, dim)
            assert all(t.axis not in axes for axes in tiling[name].values()), (t.name, name)
            tiling[name].setdefault(dim, []).append(t.axis)
    for name, dims in tiling.items():
        for dim, axes in dims.items():
            assert shapes[name][dim] % mesh.group_size(axes) == 0, (name, shapes[name], dim, axes)
    return tiling


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_strategies_match_inputs(scenario, mesh):
    sc = get_scenario(scenario)
    cfg = sc.config("tiny")
    names, shapes = _names_and_shapes(sc, cfg)
    assert set(sc.strategies) >= {"bp", "mp", "z2", "z3", "bp+mp", "bp+mp+z3"}
    daxes = [a for a in mesh.axis_names if a != "model"]
    params = [n for n in names if n.startswith("params/")]
    for strat in sc.strategies:
        tactics = sc.strategy(strat, mesh, cfg)
        assert tactics == sc.strategies[strat](mesh), strat     # static defaults == shape-checked choice
        tiling = _apply(tactics, names, shapes, mesh)
        parts = strat.split("+")
        if "bp" in parts or "z2" in parts or "z3" in parts:
            assert [t.axis for t in tactics[:len(daxes)]] == daxes
            for n in names:
                if n.startswith("batch/"):
                    assert tiling[n] == {0: daxes}
        if "mp" in parts:
            mp = [t for t in tactics if t.axis == "model" and t.name.startswith("mp")]
            assert len(mp) == 1
        if "emb" in parts:     # the vocabulary dims on model, optimizer state alike
            assert tiling["params/embed/tokens"].get(0) == ["model"] and tiling["opt/mu/embed/tokens"].get(0) == ["model"]
            assert tiling["params/unembed/w"].get(1) == ["model"]
        for p in params:
            opt_names = [f"opt/mu/{p[7:]}", f"opt/nu/{p[7:]}"]
            model_dims = {d for d, axes in tiling[p].items() if "model" in axes}
            if "mp" in parts or "emb" in parts:       # optimizer state sharded like its parameter on model
                for o in opt_names:
                    assert {d for d, axes in tiling[o].items() if "model" in axes} == model_dims
            if "z3" in parts or "z2" in parts:
                for o in opt_names:     # every optimizer state is sharded over all data axes
                    assert sorted(a for axes in tiling[o].values() for a in axes if a != "model") == sorted(daxes)
                    if len(shapes[o]) >= 2 and model_dims:
                        assert all(d not in model_dims for d, axes in tiling[o].items() if set(axes) - {"model"})
            data_on_param = [a for axes in tiling[p].values() for a in axes if a != "model"]
            assert sorted(data_on_param) == (sorted(daxes) if "z3" in parts else []), (strat, p)
        assert tiling["opt/count"] == {}


def test_megatron_dims():
    mesh = Mesh(batch=2, model=2)
    sc = get_scenario("transformer")
    names, shapes = _names_and_shapes(sc, sc.config("tiny"))
    tiling = _apply(sc.strategies["mp"](mesh), names, shapes, mesh)
    want = {"attn/w_q": {1: ["model"]}, "attn/w_k": {1: ["model"]}, "attn/w_v": {1: ["model"]},
            "attn/w_o": {0: ["model"]}, "mlp/w_in": {1: ["model"]}, "mlp/b_in": {0: ["model"]},
            "mlp/w_out": {0: ["model"]}, "mlp/b_out": {}, "ln1/scale": {}}
    for suffix, t in want.items():
        for prefix in ("params/layer_1/", "opt/mu/layer_1/", "opt/nu/layer_0/"):
            assert tiling[prefix + suffix] == t, prefix + suffix
    assert tiling["params/embed/tokens"] == {} and tiling["params/unembed/w"] == {}

    sc = get_scenario("mlp")
    names, shapes = _names_and_shapes(sc, sc.config("tiny"))
    tiling = _apply(sc.strategies["mp"](mesh), names, shapes, mesh)
    assert tiling["params/layer_0/w_in"] == {1: ["model"]} and tiling["params/layer_1/w_out"] == {0: ["model"]}
    assert tiling["params/layer_1/b_in"] == {0: ["model"]} and tiling["params/layer_1/b_out"] == {}


def test_bp_mp_z3_stacks_axes():
    mesh = Mesh(pod=2, batch=2, model=2)
    sc = get_scenario("transformer")
    names, shapes = _names_and_shapes(sc, sc.config("tiny"))
    tiling = _apply(sc.strategies["bp+mp+z3"](mesh), names, shapes, mesh)
    assert tiling["params/layer_0/attn/w_q"] == {1: ["model"], 0: ["pod", "batch"]}
    assert tiling["opt/nu/layer_0/attn/w_o"] == {0: ["model"], 1: ["pod", "batch"]}
    assert tiling["params/layer_0/mlp/b_in"] == {0: ["model", "pod", "batch"]}
    assert tiling["params/embed/tokens"] == {0: ["pod", "batch"]}
    z2 = _apply(sc.strategies["z2"](mesh), names, shapes, mesh)
    assert z2["params/unembed/w"] == {} and z2["opt/mu/unembed/w"] == {0: ["pod", "batch"]}


def test_zero_dim_falls_back_when_indivisible():
    sc = get_scenario("mlp")
    cfg = sc.config("tiny", "d_in=12,d_out=12")
    mesh = Mesh(batch=8)
    names, shapes = _names_and_shapes(sc, cfg)
    tactics = sc.strategies["z3"](mesh, cfg)
    tiling = _apply(tactics, names, shapes, mesh)
    assert tiling["params/layer_0/w_in"] == {1: ["batch"]}      # [12, 32]: dim 0 does not divide by 8
    assert tiling["params/layer_0/w_out"] == {0: ["batch"]}     # [32, 12]
    assert tiling["params/layer_0/b_out"] == {}                 # [12]: nothing divides, stays replicated
    assert sc.strategies["z3"](mesh)[-1].inputs["params/layer_*/w_in"] == 0   # static default


def test_strategy_errors():
    sc = get_scenario("transformer")
    cfg = sc.config("tiny")
    for strat in ("mp", "bp+mp", "bp+mp+z3"):
        with pytest.raises(ScenarioError, match=r"needs mesh axis 'model'"):
            sc.strategies[strat](Mesh(batch=4))
    for strat in ("bp", "z3"):
        with pytest.raises(ScenarioError, match=r"needs a data axis"):
            sc.strategies[strat](Mesh(model=2), cfg)
    with pytest.raises(ScenarioError, match=r"no strategy 'dp'.*bp"):
        sc.strategy("dp", Mesh(batch=2))
    with pytest.raises(ScenarioError, match=r"heads=4 is not divisible.*size 8"):
        sc.strategies["mp"](Mesh(model=8), cfg)
    with pytest.raises(ScenarioError, match=r"batch 8 is not divisible"):
        sc.strategies["bp"](Mesh(batch=3), cfg)


def test_names_agree_with_compiler(tiny):
    trace = pytest.importorskip("partir_emu.compiler.tracing.trace")
    if not hasattr(trace, "input_names"):
        pytest.skip("partir_emu.compiler.tracing.trace.input_names not available")
    sc, cfg, _ = tiny
    assert trace.input_names(sc.make_step(cfg), sc.make_inputs(cfg)) == sc.input_names(cfg)
