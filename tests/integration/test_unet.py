"""scenarios/unet/scenario.py: sizes and their errors, the closed-form parameter count and model FLOPs against
the real parameters and the traced program, every strategy against jax.jit on LocalMesh, the
spatial strategy's halo exchanges (one per conv layer's forward, shared by its weight gradient, and
one per input gradient) and gathers (attention only), and `simulate` / `simulate-des`."""
from __future__ import annotations

import functools
import json
from collections import Counter

import jax
import numpy as np
import pytest

from partir_emu.api import trace
from partir_emu.app.cli.main import main
from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from partir_emu.primitives.conv import conv_cost
from partir_emu.primitives.dot import dot_general_cost
from partir_emu.runtime.local_mesh import LocalMesh
from scenarios import get_scenario, list_scenarios
from scenarios.unet import scenario as unet
from tests.conftest import experiment, lowered

pytestmark = pytest.mark.xdist_group("unet")    # its cached programs and references: made once, on one worker

SC = unet.SCENARIO
# strategy -> a 4-device mesh it runs on
MESHES = {"bp": "batch=4", "z3": "batch=4", "bp+z3": "batch=4", "mp": "batch=2,model=2", "bp+mp": "batch=2,model=2",
          "spatial": "spatial=4", "bp+spatial": "batch=2,spatial=2", "bp+spatial+z3": "batch=2,spatial=2",
          "bp+auto": "batch=2,model=2"}


def test_registered_with_every_strategy():
    assert "unet" in list_scenarios() and get_scenario("unet") is SC
    assert set(SC.strategies) == set(MESHES)


@pytest.mark.parametrize("overrides, needle", [
    ("mult=102", r"mult=102 has a 0 digit"),
    ("image=9", r"image=9 is not divisible by 2\^\(levels-1\) = 2"),
    ("groups=3", r"groups=3 does not divide"),
    ("heads=3", r"heads=3 does not divide"),
    ("channels=2,groups=2,heads=2", r"channels=2 must be even and >= 4"),
])
def test_config_errors(overrides, needle):
    with pytest.raises(ScenarioError, match=needle):
        SC.config("tiny", overrides)


def test_spatial_strategy_errors():
    cfg = SC.config("tiny")
    with pytest.raises(ScenarioError, match=r"mesh axis 'spatial'"):
        SC.strategy("spatial", Mesh(batch=4), cfg)
    with pytest.raises(ScenarioError, match=r"lowest resolution 8 .* not divisible by axis 'spatial' of size 16"):
        SC.strategy("spatial", Mesh(spatial=16), cfg)
    with pytest.raises(ScenarioError, match=r"needs a data axis besides 'spatial'"):
        SC.strategy("bp+spatial", Mesh(spatial=4), cfg)
    with pytest.raises(ScenarioError, match=r"groups=2 divisible by the 'model' axis \(size 4\)"):
        SC.strategy("mp", Mesh(model=4), SC.config("tiny", "groups=2,heads=1"))
    # one head on a model axis of 2: attention stays replicated on it, the convs are sharded
    mp = SC.strategy("mp", Mesh(model=2), SC.config("tiny", "heads=1"))[0]
    assert "params/*/conv1/w" in mp.inputs and not any("attn" in k for k in mp.inputs)


# -- counts ----------------------------------------------------------------------------------------
VARIANTS = [None, "mult=121,res_blocks=2", "heads=4,groups=2,attn_res=16", "mult=1,image=8"]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_param_count_closed_form(overrides):
    cfg = SC.config("tiny", overrides)
    params = SC.make_params(cfg, np.random.default_rng(0))
    assert sum(x.size for x in jax.tree.leaves(params)) == SC.param_count(cfg) == unet.count_params(SC.param_shapes(cfg))


def test_published_sizes():
    """DDPM's CIFAR-10 (35.7 M) and 256×256 (114 M) models, less their key biases (see the docstring)."""
    assert SC.param_count(SC.config("ddpm32")) == unet.count_params(SC.param_shapes(SC.config("ddpm32"))) == 35_744_771
    assert SC.param_count(SC.config("ddpm256")) == 113_670_147
    assert round(SC.param_count(SC.config("ddpm32")) / 1e5) == 357 and round(SC.param_count(SC.config("ddpm256")) / 1e6) == 114


@pytest.mark.parametrize("overrides", VARIANTS[:3])
def test_model_flops_equal_the_traced_convs_and_matmuls(overrides):
    """Every conv and matmul the step traces, by the primitives' own costs, is model_flops less the
    input gradients of conv_in and temb/dense0 (their inputs are data; the count includes them),
    plus what the stride-2 input gradient costs beyond its MACs: it runs a 3×3 conv over the dilated
    cotangent at the input's resolution, (2r)² outputs where the forward had r²."""
    cfg = SC.config("tiny", overrides)
    prog = trace(SC.make_step(cfg), *SC.abstract_inputs(cfg))
    traced = sum(conv_cost(e)[0] for e in prog.eqns if e.prim == "conv_general_dilated") + \
        sum(dot_general_cost(e)[0] for e in prog.eqns if e.prim == "dot_general")
    b, ch, k, img = cfg["batch"], cfg["channels"], cfg["in_ch"], cfg["image"]
    dilated = sum(2 * b * 9 * c * c * ((2 * r) ** 2 - r * r) for kind, c, _, r in unet._walk(cfg) if kind == "down")
    assert traced == SC.model_flops(cfg) - 2 * b * (9 * k * ch * img * img + ch * 4 * ch) + dilated
    assert SC.model_flops(cfg) == 6 * b * unet.macs_per_image(cfg)


@pytest.mark.slow
def test_tiny_step_trains():
    cfg = SC.config("tiny")
    step = jax.jit(SC.make_step(cfg))
    params, opt, batch = SC.make_inputs(cfg, seed=1)
    losses = []
    for _ in range(3):
        loss, params, opt = step(params, opt, batch)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[0] > losses[1] > losses[2], losses


# -- every strategy against jax.jit ---------------------------------------------------------------------
@functools.cache
def _references(overrides: str | None = None) -> tuple:
    """(inputs, (jax.jit outputs, float64 outputs)) of the tiny step: the same for every strategy."""
    exp = experiment("unet", "bp", "batch=1", None, overrides)
    inputs = exp.inputs()
    return inputs, exp.references(inputs)


@functools.cache
def _run(strategy: str, overrides: str | None = None) -> tuple[Experiment, object, object]:
    """What ``partir-emu run`` does (``run_local``), with the references computed once."""
    exp, spmd = lowered("unet", strategy, MESHES[strategy], overrides)
    inputs, refs = _references(overrides)
    outputs = LocalMesh(exp.mesh).run(spmd, inputs).outputs
    return exp, spmd, exp.check(outputs, inputs, spmd.output_names, refs)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(MESHES))
def test_strategy_matches_jax(strategy):
    exp, spmd, ver = _run(strategy)
    assert ver.verified, ver.to_json()["worst"]
    axes = Counter((e.prim, e.params["axes"]) for e in spmd.collectives())
    if strategy == "bp":
        assert set(axes) == {("all_reduce", ("batch",))}
    if "z3" in strategy:
        assert axes[("all_gather", ("batch",))] and axes[("reduce_scatter", ("batch",))]
    if "mp" in strategy:
        # one all-reduce per res block (conv2's pending sum) and per attention block (o), forward and
        # backward (the input gradient of conv1 / q,k,v), plus what the replicated layers' gradients need
        kinds = [x for x in unet._walk(exp.cfg) if x[0] in ("res", "attn")]
        assert axes[("all_reduce", ("model",))] >= 2 * len(kinds)
        assert not any(p == "all_gather" for p, _ in axes)
    if "spatial" in strategy:
        _check_exchanges(spmd, exp.cfg)
        assert ("all_gather", ("batch",)) in axes if "z3" in strategy else not axes[("all_gather", ("batch",))]


@pytest.mark.slow
def test_bf16_spatial_matches_jax():
    """precision=bf16: bf16 convs (and their halo rows) with float32 master weights, verified against
    jax.jit relative to its own bf16 error."""
    _, spmd, ver = _run("bp+spatial", "precision=bf16")
    assert ver.verified, ver.to_json()["worst"]
    convs = [e for e in spmd.program.eqns if e.prim == "conv_general_dilated"]
    permutes = [e for e in spmd.collectives() if e.prim == "collective_permute"]
    assert {e.inputs[0].dtype for e in convs} == {"bfloat16"} and {e.inputs[0].dtype for e in permutes} == {"bfloat16"}
    assert len(permutes) == len([e for e in _run("bp+spatial")[1].collectives() if e.prim == "collective_permute"])


def _producer(spmd) -> dict:
    return {o: e for e in spmd.program.eqns for o in e.outputs}


@pytest.mark.slow
def test_spatial_has_one_halo_exchange_per_conv_layer():
    """Convention (``compiler/lowering/halo.py``): an exchange is one concatenate of [rows from the previous
    block, own block, rows from the next], fed by at most one ``collective_permute`` per direction.
    A conv layer of the step has exactly one exchange for its forward conv, which its weight
    gradient reuses, and one for its input gradient (none for conv_in, whose input is data):
    2 permutes for a 3×3 stride-1 conv, 1 for the stride-2 downsampling (forward: the next block's
    first row; input gradient: the previous block's last row)."""
    exp, spmd, _ = _run("spatial")
    _check_exchanges(spmd, exp.cfg)


@pytest.mark.slow
def test_full_size_spatial_exchanges_and_gathers():
    """DDPM's CIFAR-10 model (lowered only): the same one exchange per conv layer and direction, and
    every all_gather, reduce_scatter and all_to_all over ``spatial`` is self-attention's."""
    exp = Experiment("unet", "bp+spatial", Mesh(batch=16, spatial=4), "ddpm32")
    spmd = exp.lower().spmd
    _check_exchanges(spmd, exp.cfg)
    others = [e for e in spmd.collectives() if e.prim not in ("collective_permute", "all_reduce")]
    assert others and all("attn_block" in (e.source or "") and e.params["axes"] == ("spatial",) for e in others)


def _check_exchanges(spmd, cfg) -> None:
    """See test_spatial_has_one_halo_exchange_per_conv_layer."""
    prod = _producer(spmd)
    layers = list(unet._walk(cfg))
    n_layers = 2 * sum(k == "res" for k, *_ in layers) + sum(k in ("down", "up") for k, *_ in layers) + 2
    n_down = sum(k == "down" for k, *_ in layers)
    exchanges: dict = {}          # concatenate output -> its permutes
    for e in spmd.program.eqns:
        if e.prim != "conv_general_dilated":
            continue
        ext = [a for a in e.inputs if a in prod and prod[a].prim == "concatenate"
               and any(prod.get(p) is not None and prod[p].prim == "collective_permute" for p in prod[a].inputs)]
        is_wgrad = tuple(e.outputs[0].shape[:2]) == (3, 3)
        assert len(ext) == 1, f"conv {e.outputs[0].shape} reads {len(ext)} exchanged operands"
        permutes = [p for p in prod[ext[0]].inputs if prod.get(p) is not None and prod[p].prim == "collective_permute"]
        if is_wgrad:
            assert ext[0] in exchanges, "a weight gradient exchanged its own input instead of reusing the forward's"
        else:
            assert ext[0] not in exchanges
            exchanges[ext[0]] = permutes
    sizes = Counter(len(p) for p in exchanges.values())
    assert len(exchanges) == 2 * n_layers - 1
    assert sizes == {2: 2 * n_layers - 1 - 2 * n_down, 1: 2 * n_down}
    permutes = [e for e in spmd.collectives() if e.prim == "collective_permute"]
    assert len(permutes) == sum(len(p) for p in exchanges.values())
    assert {e.params["axes"] for e in permutes} == {("spatial",)}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["spatial", "bp+spatial"])
def test_spatial_gathers_only_in_attention(strategy):
    """No activation is gathered over ``spatial`` for a conv, a norm, the down/upsampling or the loss:
    the only all_gathers are self-attention's (every query reads every key and value: the
    documented gap), and the rows of the image stay tiled up to the loss."""
    _, spmd, _ = _run(strategy)
    gathers = [e for e in spmd.collectives() if e.prim == "all_gather"]
    assert gathers and all("attn_block" in (e.source or "") for e in gathers), \
        sorted({e.source for e in gathers if "attn_block" not in (e.source or "")})
    assert all(e.params["axes"] == ("spatial",) for e in gathers)
    assert not [e for e in spmd.collectives() if e.prim == "all_to_all"]
    convs = [e for e in spmd.program.eqns if e.prim == "conv_general_dilated"]
    rows = SC.config("tiny")["image"] // Mesh.parse(MESHES[strategy]).axis_size("spatial")
    assert convs[0].inputs[0].shape[1] == rows + 2          # own rows + one from each neighbour


# -- the CLI: simulate, simulate-des ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("hardware, strategy, mesh", [("tpu-v4", "bp+spatial", "batch=16,spatial=4"),
                                                       ("h100", "z3", "batch=16")])
def test_simulate_full_preset(capsys, tmp_path, hardware, strategy, mesh):
    rep = tmp_path / "s.json"
    assert main(["simulate", "unet", "--size", "ddpm32", "--strategy", strategy, "--mesh", mesh,
                 "--hardware", hardware, "--report", str(rep), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"unet / {strategy} on" in out and "MFU" in out
    r = json.loads(rep.read_text())
    assert r["hardware"] == hardware and 0 < r["comm_s"] and 0 < r["step_s"] < 1 and r["fits"]
    if "spatial" in strategy:
        assert any(c["prim"] == "collective_permute" for c in r["collectives"])


@pytest.mark.slow
def test_simulate_des_tiny(capsys):
    assert main(["simulate-des", "unet", "--strategy", "bp+spatial", "--mesh", "batch=2,spatial=2",
                 "--hardware", "tpu-v4", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "DES (" in out and "analytical:" in out
