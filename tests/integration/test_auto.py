"""AutomaticPartition (compiler/auto*.py): a Monte Carlo tree search over the decisions of one
axis, priced by the analytical model, that finds what experts write by hand.

Every comparison is against a *manual* strategy priced by the same model (never against the
search's own baseline, which it beats by construction): on the transformer it finds Megatron
(the same collectives as ``bp+mp``) or something cheaper; on the MLP it matches or beats every
manual strategy on the same data tactics; it respects a memory limit; its price is the price of
the program it leaves (state semantics, also with a manual tactic after it); it is deterministic.
"""
import json

import pytest

from partir_emu import AutomaticPartition, ManualPartition, Mesh
from partir_emu.api import analytical_cost, lower_program
from partir_emu.app.cli.main import main
from partir_emu.app.experiment import Experiment, verify
from partir_emu.errors import TacticError
from partir_emu.hwmodels.compute.memory import peak_memory
from partir_emu.runtime.local_mesh import LocalMesh
from scenarios.common import STATE_OUTPUTS

TOL = 1e-9


def price(low, hardware: str = "tpu-v4"):
    return analytical_cost(AutomaticPartition("model", hardware=hardware))(low.spmd)


def lowered(scenario: str, size: str, mesh: str, strategy: str, auto: AutomaticPartition | None = None,
            overrides: str | None = None):
    """``strategy`` lowered; with ``auto`` the strategy's own AutomaticPartition replaced by it."""
    exp = Experiment(scenario, strategy, Mesh.parse(mesh), size, overrides)
    sched = exp.schedule
    if auto is not None:
        sched = [auto if isinstance(t, AutomaticPartition) else t for t in sched]
    return lower_program(exp.program, exp.mesh, sched, dict(exp.scenario.state_outputs)), exp


def the_result(low):
    ((_, res),) = low.final_state.auto_results
    return res


@pytest.mark.slow
@pytest.mark.parametrize("model,overrides", [(2, None), (4, None), (2, "layers_as=loop")])
def test_transformer_bp_auto_finds_megatron_or_cheaper(model, overrides):
    mesh = f"batch=2,model={model}"
    auto, exp = lowered("transformer", "small", mesh, "bp+auto", overrides=overrides)
    mp, _ = lowered("transformer", "small", mesh, "bp+mp", overrides=overrides)
    pa, pm = price(auto), price(mp)
    # what Megatron is: 2 all_reduces over model per layer per pass (forward, backward), nothing else on model
    layers = exp.cfg["layers"]
    assert {k: v for k, v in pm.counts.items() if "model" in k} == {"all_reduce over model": 4 * layers}
    res = the_result(auto)
    assert res.decisions and pa.counts.get("all_reduce over model", 0) > 0       # model is used
    assert pa.value <= pm.value * (1 + TOL), (res.report("auto"), pm.value)
    megatron = {k: v for k, v in pa.counts.items() if "model" in k} == {"all_reduce over model": 4 * layers}
    assert megatron or pa.value < pm.value * (1 - TOL)
    # the search's price is the price of the program it leaves
    assert res.cost == pytest.approx(pa.value, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("size,mesh", [("tiny", "batch=2,model=2"), ("small", "batch=2,model=2"),
                                       ("full", "batch=8,model=4")])
def test_mlp_auto_matches_or_beats_every_manual_strategy_on_the_same_data_tactics(size, mesh):
    auto, _ = lowered("mlp", size, mesh, "bp+auto")
    res = the_result(auto)
    assert res.stopped == "exhausted"            # the MLP's space is small: every strategy was priced
    pa = price(auto)
    manual = {s: price(lowered("mlp", size, mesh, s)[0]).value for s in ("bp", "bp+mp")}
    assert pa.value <= min(manual.values()) * (1 + TOL), (res.report("auto"), manual)
    if size != "tiny":        # at tiny sizes Megatron's all_reduces cost more than they save: bp wins
        assert manual["bp+mp"] < manual["bp"] and res.decisions


@pytest.mark.slow
def test_memory_limit_makes_the_search_pick_a_strategy_that_fits():
    free, _ = lowered("mlp", "small", "batch=2,model=2", "bp+auto")
    fastest = the_result(free)
    peak = price(free).peak_bytes
    limited, _ = lowered("mlp", "small", "batch=2,model=2", "bp+auto",
                         AutomaticPartition("model", memory_limit=peak - 1, budget=200))
    res = the_result(limited)
    p = price(limited)
    assert res.stopped == "exhausted" and res.fits and res.memory_limit == peak - 1
    assert p.peak_bytes <= peak - 1 < price(free).peak_bytes
    assert res.decisions != fastest.decisions and p.value > fastest.cost      # the fastest did not fit


def test_nothing_fits_keeps_the_least_overflow_and_says_so():
    low, _ = lowered("mlp", "small", "batch=2,model=2", "bp+auto", AutomaticPartition("model", memory_limit=1024))
    res = the_result(low)
    assert not res.fits and "NO candidate fits" in res.report("auto")


@pytest.mark.slow
def test_priced_after_the_manual_tactics_that_follow():
    """``bp + auto + z3``: each candidate is priced after ZeRO-3 (the tactic after it), so the
    search's price is the final program's."""
    exp = Experiment("mlp", "bp+mp+z3", Mesh.parse("batch=2,model=2"), "small")
    bp, _, z3 = exp.schedule
    low = lower_program(exp.program, exp.mesh, [bp, AutomaticPartition("model"), z3], dict(exp.scenario.state_outputs))
    res = the_result(low)
    assert low.spmd.meta["tactics"][-1] == z3.name
    assert res.cost == pytest.approx(price(low).value, rel=1e-12)


@pytest.mark.slow
def test_families_a_manual_tactic_tiled_before_are_not_searched():
    exp = Experiment("transformer", "bp", Mesh.parse("batch=2,model=2"), "tiny")
    attn = ManualPartition({"params/*/attn/w_q": 1, "opt/*/attn/w_q": 1}, axis="model", name="attn")
    low = lower_program(exp.program, exp.mesh, [*exp.schedule, attn, AutomaticPartition("model", budget=12)],
                        dict(exp.scenario.state_outputs))
    res = the_result(low)
    assert not any("/attn/" in fam for fam in res.decisions)       # propagation from w_q decided attention
    assert low.spmd.meta["tactics"][-2] == "attn"


@pytest.mark.slow
def test_deterministic_for_a_seed_and_within_the_budget():
    runs = [the_result(lowered("transformer", "tiny", "batch=2,model=2", "bp+auto",
                               AutomaticPartition("model", budget=10, seed=s))[0]) for s in (3, 3)]
    a, b = runs
    assert (a.decisions, a.cost, a.evaluations, a.candidates) == (b.decisions, b.cost, b.evaluations, b.candidates)
    assert a.stopped == "budget" and a.evaluations == 10


@pytest.mark.slow
def test_the_report_says_why_against_the_runner_up():
    low, exp = lowered("transformer", "small", "batch=2,model=2", "bp+auto", AutomaticPartition("model", budget=16))
    res = the_result(low)
    # the winner, written as a manual tactic, is the same program
    again = lower_program(exp.program, exp.mesh, [*exp.schedule[:-1], res.as_tactic()], dict(exp.scenario.state_outputs))
    assert price(again).value == res.cost
    text = res.report("auto:model")
    assert res.runner_up is not None and res.runner_up != res.decisions
    assert "vs the runner-up" in text and "vs the baseline" in text and "over model" in text
    assert res.to_json()["why"] == res.why()


def test_auto_with_memory_cost_beats_bp_and_verifies(case):
    s, cfg, prog, inputs, ref = case("mlp")
    mesh = Mesh(batch=2, model=2)
    bp = s.strategy("bp", mesh, cfg)
    base = lower_program(prog, mesh, bp, STATE_OUTPUTS)
    auto = AutomaticPartition("model", inputs="params/*", cost=lambda spmd: peak_memory(spmd).peak_bytes)
    low = lower_program(prog, mesh, bp + [auto], STATE_OUTPUTS)
    ((label, res),) = low.final_state.auto_results
    assert res.decisions and res.cost < res.baseline
    assert res.baseline == peak_memory(base.spmd).peak_bytes
    assert peak_memory(low.spmd).peak_bytes == res.cost
    # every decision is a family of parameters (one per layer pattern, or the last layer's own) with its optimizer state
    assert all("layer_" in fam for fam in res.decisions)
    out = LocalMesh(mesh).run(low.spmd, inputs)
    assert verify(out.outputs, ref, low.spmd.output_names).verified
    assert out.peak_bytes_per_device[0] == res.cost


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [None, "layers_as=loop"])
def test_transformer_auto_under_a_memory_limit_shards_model_and_verifies(case, overrides):
    """At the tiny size nothing on ``model`` is cheapest (Megatron's all_reduces cost more than the
    compute they save); a memory limit below that strategy's peak forces sharding, and whatever the
    search picks still computes the step."""
    s, cfg, prog, inputs, ref = case("transformer", overrides)
    mesh = Mesh(batch=2, model=2)
    bp = s.strategy("bp", mesh, cfg)
    peak = price(lower_program(prog, mesh, bp, STATE_OUTPUTS)).peak_bytes
    low = lower_program(prog, mesh, bp + [AutomaticPartition("model", memory_limit=peak - 1, budget=24)], STATE_OUTPUTS)
    res = the_result(low)
    assert res.fits and res.decisions and price(low).peak_bytes < peak
    out = LocalMesh(mesh).run(low.spmd, inputs)
    assert verify(out.outputs, ref, low.spmd.output_names).verified


@pytest.mark.slow
def test_show_and_simulate_print_what_the_search_chose_and_why(capsys, tmp_path):
    report = tmp_path / "sim.json"
    assert main(["simulate", "mlp", "--strategy", "bp+auto", "--size", "small", "--quiet",
                 "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "auto:model: 1 decision(s)" in out and "params/layer_*/w_in -> dim 1" in out and "vs the runner-up" in out
    (auto,) = json.loads(report.read_text())["auto"]
    assert auto["label"] == "auto:model" and auto["decisions"] == {"params/layer_*/w_in": 1}
    assert auto["stopped"] == "exhausted" and auto["evaluations"] >= 2 and auto["why"]
    assert main(["show", "mlp", "--strategy", "bp+auto", "--size", "small", "--quiet"]) == 0
    assert "auto:model: 1 decision(s)" in capsys.readouterr().out


@pytest.mark.slow
def test_t48_as_a_loop_on_512_chips_beats_every_manual_strategy(case):
    """The full-size preset with its layers as one loop (374 equations: an evaluation takes
    milliseconds, so the whole budget runs): the search finds a strategy the analytical model
    prices below every manual one with the same data tactic (Megatron, Megatron + vocab-parallel
    embeddings, Megatron + ZeRO-3): Megatron's all_reduces become reduce_scatter + all_gather
    around a d_model-sharded residual stream, so norms and adds run on shards."""
    mesh, ov = "batch=64,model=8", "layers_as=loop"
    auto, _ = lowered("transformer", "t48", mesh, "bp+auto", overrides=ov)
    res = the_result(auto)
    manual = {s: price(lowered("transformer", "t48", mesh, s, overrides=ov)[0]).value
              for s in ("bp+mp", "bp+mp+emb", "bp+mp+z3")}
    pa = price(auto)
    assert res.fits and pa.peak_bytes <= 32 * 2**30
    assert pa.value < min(manual.values()) * (1 - TOL), (res.report("auto"), manual)
    assert res.cost == pytest.approx(pa.value, rel=1e-12)
    # the same decisions, written by hand on the tiny loop form, compute the step
    s, cfg, prog, inputs, ref = case("transformer", ov)
    small = Mesh(batch=2, model=2)
    written = {**res.decisions, **{"opt/*/" + f.split("/", 1)[1]: d for f, d in res.decisions.items()}}
    low = lower_program(prog, small, s.strategy("bp", small, cfg) + [ManualPartition(written, axis="model")],
                        STATE_OUTPUTS)
    out = LocalMesh(small).run(low.spmd, inputs)
    assert verify(out.outputs, ref, low.spmd.output_names).verified


@pytest.mark.parametrize("bad,match", [(dict(budget=0), "budget=0"), (dict(seconds=0), "seconds=0"),
                                       (dict(rollouts=-1), "rollouts=-1"), (dict(polish=-2), "polish=-2"),
                                       (dict(memory_limit=0), "memory_limit=0"),
                                       (dict(inputs="nope/*"), "match no input")])
def test_bad_search_settings_say_what_to_give(bad, match):
    with pytest.raises(TacticError, match=match):
        lowered("mlp", "tiny", "batch=2,model=2", "bp+auto", AutomaticPartition("model", **bad))


def test_a_memory_limit_needs_a_cost_that_reports_memory():
    with pytest.raises(TacticError, match="memory_limit=1048576 but the cost function returns no peak memory") as exc:
        lowered("mlp", "tiny", "batch=2,model=2", "bp+auto",
                AutomaticPartition("model", memory_limit=2**20, cost=lambda spmd: 1.0))
    assert "cannot be lowered" not in str(exc.value)


def test_polish_generalises_a_decision_to_its_role_and_drops_decisions():
    """The local descent after the tree (compiler.auto_search.polish): a family's role is the last two
    components of its glob, so one block's convolution decision extends to every block's; its moves
    are those generalisations first, then each decision dropped."""
    from partir_emu.compiler.auto.search import role
    assert role("params/up_*/block_*/conv2/w [3, 3, 256, 256]") == "conv2/w" == role("params/down_1/block_0/conv2/w")
    assert role("params/mid/block_*/conv1/w") != role("params/mid/block_*/conv2/w")
    assert role("batch/edges") == "batch/edges"
