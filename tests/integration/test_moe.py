"""Mixture of experts (``scenarios.transformer.moe``, ``--set experts=E``) and the expert tactic ``ep``:
the layer computes what a token-by-token reference of GShard/Switch routing computes (capacity drops
included); the parameter counts are the traced program's and Mixtral 8x7B's published count; the
step verifies against ``jax.jit`` under ep with bp, mp and ZeRO-3; under bp+ep every MoE layer has
exactly one all_to_all over ``expert`` each way per pass (dispatch and combine, forward and
backward) and the experts' weights are never gathered; the all_to_all is priced on the placed
topology as its closed form says, and the analytical model and the DES agree on the step."""
from __future__ import annotations

import functools
import math
from collections import Counter

import jax
import numpy as np
import pytest

from partir_emu.api import trace
from partir_emu.app.cli.main import main
from partir_emu.app.validation.cases import get_suite, run_case
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from partir_emu.hwmodels import simulate
from partir_emu.hwmodels.machine.specs import load_spec
from partir_emu.runtime.local_mesh import LocalMesh
from scenarios import get_scenario
from scenarios.common import count_params
from scenarios.transformer import moe
from tests.conftest import experiment, lowered

SC = get_scenario("transformer")
TINY = "experts=4"          # the tiny preset: 2 layers, both MoE, 4 experts, top-2, capacity 5 of 8 tokens
RNG = np.random.default_rng(24)


# -- the layer's semantics, against a token-by-token reference ---------------------------------------
def _reference(x, p, cfg, act):
    """GShard/Switch routing token by token (float64): choices in order of rank, then of position,
    each taking the next place of its expert until the capacity is reached."""
    e, k, c = cfg["experts"], cfg["top_k"], moe.capacity(cfg)
    y = np.zeros_like(x)
    aux = []
    for g in range(x.shape[0]):
        logits = x[g] @ p["router"]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        gates = np.take_along_axis(probs, idx, -1)
        gates = gates / gates.sum(-1, keepdims=True) if k > 1 else gates
        taken = [0] * e
        for r in range(k):
            for t in range(x.shape[1]):
                ex = idx[t, r]
                if taken[ex] < c:
                    y[g, t] += gates[t, r] * (act(x[g, t] @ p["w_in"][ex]) @ p["w_out"][ex])
                taken[ex] += 1
        chosen = np.zeros(e)
        np.add.at(chosen, idx.reshape(-1), 1.0)
        aux.append(np.mean(chosen / x.shape[1] * probs.mean(0)))
    return y, e * e * np.mean(aux), taken


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 1.0), (2, 0.5)])
def test_routing_matches_a_token_by_token_reference(top_k, capacity_factor):
    cfg = dict(experts=4, top_k=top_k, capacity_factor=capacity_factor, moe_group=8, d_model=6, d_ff=10, mlp="relu",
               bias="0")
    x = RNG.standard_normal((3, 8, 6))
    p = {k: RNG.standard_normal(s) / math.sqrt(s[-2]) for k, s in moe.moe_shapes(cfg).items()}
    want, want_aux, taken = _reference(x, p, cfg, lambda h: np.maximum(h, 0.0))
    with jax.enable_x64(True):
        got, aux = jax.jit(lambda x, p: moe.moe_mlp(x, p, cfg, jax.nn.relu))(x, p)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
    assert float(aux) == pytest.approx(want_aux, rel=1e-12)
    if capacity_factor < 1:           # the capacity (2 of 8 choices) dropped some: a token can leave unchanged
        assert moe.capacity(cfg) == 2 and max(taken) > 2


# -- counts -------------------------------------------------------------------------------------------
def test_counts_match_the_traced_program():
    for over in (TINY, "experts=4,moe_every=2,mlp=swiglu,bias=1", "experts=4,top_k=1,layers_as=loop"):
        cfg = SC.config("tiny", over)
        prog = trace(SC.make_step(cfg), *SC.abstract_inputs(cfg))
        traced = sum(math.prod(v.shape) for n, v in zip(prog.input_names, prog.inputs) if n.startswith("params/"))
        assert traced == SC.param_count(cfg) == count_params(SC.param_shapes(cfg)), over
    dense, mixed = SC.config("tiny"), SC.config("tiny", "experts=4,moe_every=2")
    d, f, e = 16, 32, 4
    # one MoE layer: a router and E experts in place of one MLP and its biases; a token uses 2 experts
    assert SC.param_count(mixed) - SC.param_count(dense) == d * e + (e - 1) * 2 * d * f - (f + d)
    assert SC.model_flops(mixed) - SC.model_flops(dense) == 6 * 8 * 8 * (d * e + 2 * d * f)


def test_mixtral_preset_is_the_published_model():
    cfg = SC.config("mixtral-8x7b")
    # mistralai/Mixtral-8x7B-v0.1 has 46,702,792,704 parameters; ours adds learned positions (seq x d)
    assert SC.param_count(cfg) - cfg["seq"] * cfg["d_model"] == 46_702_792_704
    # 12.9 B active (Jiang et al. 2024): the matmuls' parameters and the input table
    active = SC.model_flops(cfg) / (6 * cfg["batch"] * cfg["seq"]) - 12 * 32 * 4096 * cfg["seq"] / 6
    assert abs(active + 32000 * 4096 - 12.9e9) < 0.01 * 12.9e9
    assert "mixtral-8x7b" in SC.simulation_only and moe.capacity(cfg) == 320


# -- partitioned runs ---------------------------------------------------------------------------------
@functools.cache
def _run(strategy: str, mesh: str):
    exp, spmd = lowered("transformer", strategy, mesh, TINY)
    inputs = exp.inputs(spmd.input_names)
    return exp, spmd, inputs, LocalMesh(exp.mesh).run(spmd, inputs).outputs


@pytest.mark.parametrize("strategy, mesh", [("bp+ep", "batch=2,expert=2"), ("bp+mp+ep", "expert=2,model=2"),
                                            ("bp+ep+z3", "batch=2,expert=2")])
def test_expert_parallel_step_verifies(strategy, mesh):
    exp, spmd, inputs, outputs = _run(strategy, mesh)
    ver = exp.check(outputs, inputs, spmd.output_names)
    assert ver.verified, ver.to_json()["worst"]
    a2a = [c for c in spmd.collectives() if c.prim == "all_to_all"]
    assert len(a2a) == 2 * 2 * 2 and {c.params["axes"] for c in a2a} == {("expert",)}     # 2 layers x 2 x 2 passes
    gathered = [c for c in spmd.collectives() if c.prim == "all_gather" and "expert" in c.params["axes"]
                and c.inputs[0].ndim == 3 and c.inputs[0].shape[0] == 4 // 2]          # an [E/2, ., .] expert block
    assert not gathered


def test_gshard_structure_one_all_to_all_each_way_per_pass():
    _, spmd, _, _ = _run("bp+ep", "batch=2,expert=2")
    seq = [(c.source.split("'")[1], "to experts" if c.params["split_dim"] == 0 else "to tokens")
           for c in spmd.collectives() if c.prim == "all_to_all"]
    forward = [(moe.DISPATCH, "to experts"), (moe.COMBINE, "to tokens")] * 2
    backward = [(moe.COMBINE, "to experts"), (moe.DISPATCH, "to tokens")] * 2
    assert seq == forward + backward
    for c in spmd.collectives():
        if c.prim == "all_to_all":       # [E, G/4, C, d] <-> [E/2, G/2, C, d]: 8 sequences over 4 devices
            assert {c.inputs[0].shape, c.outputs[0].shape} == {(4, 2, 5, 16), (2, 4, 5, 16)}
    # the experts' gradients are summed over batch only: each device has every token of its experts
    grads = Counter(c.params["axes"] for c in spmd.collectives() if c.prim == "all_reduce" and c.inputs[0].ndim == 3)
    assert grads == {("batch",): 4}
    names = [n for n, s in zip(spmd.input_names, spmd.in_shardings) if "/moe/w_" in n]
    assert names and all(s.dims[0] == ("expert",) for n, s in zip(spmd.input_names, spmd.in_shardings) if n in names)


def test_dense_strategies_run_the_experts_unsplit():
    """bp alone: the tags are transparent, every device routes its own sequences through all experts."""
    exp, spmd = lowered("transformer", "bp", "batch=4", TINY)
    assert {c.prim for c in spmd.collectives()} == {"all_reduce"}


# -- pricing --------------------------------------------------------------------------------------------
def test_all_to_all_priced_as_its_closed_form_on_the_placed_topology():
    """H100: the expert axis inside a node, the batch across nodes; an all_to_all posts every pair at
    once through the NVSwitch: 7 of the 8 blocks leave each GPU, over its one NVLink port."""
    _, spmd = lowered("transformer", "bp+ep", "batch=2,expert=8", "experts=8,batch=16")
    spec = load_spec("h100")
    rep = simulate(spmd, spec, overlap=False)
    nv = spec.network
    rows = [r for r in rep.collectives if r.prim == "all_to_all"]
    assert len(rows) == 8
    for r in rows:
        assert r.algorithm == "direct"
        assert r.time_s == pytest.approx(2 * nv.nvlink_latency_s + 7 * (r.nbytes / 8) / nv.nvlink_bw_bytes_per_s,
                                         rel=1e-9)


def test_validate_cases_of_expert_parallelism_agree():
    cases = [c for c in get_suite("default") if "ep" in c.strategy.split("+")]
    assert len(cases) == 2
    for case in cases:
        r = run_case(case, _programs())
        assert r.rel_err < 0.02, (case, r.analytical_s, r.des_s)


@functools.cache
def _programs():
    from partir_emu.app.programs import ProgramCache
    return ProgramCache(None)


def test_full_size_mixtral_is_priced():
    """Two of Mixtral's layers on 256 v4 chips (8 experts over ``expert``, ZeRO-3 over batch): each layer
    has 6 all_to_alls of [E, G/256, C, d] (forward, its recomputation under remat, backward) and fits."""
    exp = experiment("transformer", "bp+ep+z3", "batch=32,expert=8", "mixtral-8x7b", "layers=2")
    rep = simulate(_programs().spmd(exp), "tpu-v4", overlap=True, model_flops=SC.model_flops(exp.cfg) / 256)
    a2a = [r for r in rep.collectives if r.prim == "all_to_all"]
    assert len(a2a) == 2 * 6 and {r.axes for r in a2a} == {("expert",)}
    # [E, G, C, d] in bf16 with G = 512 x 4096 / 1,024 tokens a group / 256 chips, C = 2 x 1,024 x 1.25 / 8
    assert {r.nbytes for r in a2a} == {8 * 8 * 320 * 4096 * 2}
    assert rep.fits and 0 < rep.mfu < rep.hfu < 1


def test_list_shows_the_expert_strategies_and_keys(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "also bp+ep, bp+mp+ep, bp+ep+z3: with --set experts=E" in out and "mixtral-8x7b (simulation only)" in out
    assert all(k in out for k in moe.NAMES)


# -- errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, mesh, over, match", [
    ("bp+ep", "batch=4", TINY, "needs mesh axis 'expert'"),
    ("bp+ep", "batch=2,expert=2", "", "no experts for 'ep'"),
    ("bp+ep", "batch=1,expert=8", TINY, "4 experts .* not divisible by axis 'expert' of size 8"),
])
def test_bad_expert_strategies_are_named(strategy, mesh, over, match):
    with pytest.raises(ScenarioError, match=match):
        SC.strategy(strategy, Mesh.parse(mesh), SC.config("tiny", over))


@pytest.mark.parametrize("over, match", [
    ("experts=4,moe_every=3", "moe_every=3 is more than layers=2"),
    ("experts=4,moe_group=3", "moe_group=3 does not divide seq=8"),
    ("experts=4,capacity_factor=nan", "must be a positive number"),
    ("experts=4,capacity_factor=0", "must be a positive number"),
    ("top_k=2", r"\['top_k'\] without experts"),
    ("experts=2,top_k=3", "top_k <= experts"),
    ("experts=4,layers_as=loop,moe_every=2", "needs moe_every=1"),
    ("experts=4,pipeline=2,microbatches=2", "pipeline with experts is not supported"),
])
def test_bad_expert_configs_are_named(over, match):
    with pytest.raises(ScenarioError, match=match):
        SC.config("tiny", over)
