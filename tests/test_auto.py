"""AutomaticPartition: a searched tactic, priced by a cost model, that still computes the right thing."""
from partir_emu import AutomaticPartition, Mesh
from partir_emu.api import lower_program
from partir_emu.app.experiment import verify
from partir_emu.hwmodels.memory import peak_memory
from partir_emu.runtime.local_mesh import LocalMesh
from scenarios.common import STATE_OUTPUTS


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
    # every decision is a family of parameters (one per layer pattern) with its optimizer state
    assert all("layer_*" in fam for fam in res.decisions)
    out = LocalMesh(mesh).run(low.spmd, inputs)
    assert verify(out.outputs, ref, low.spmd.output_names).verified
    assert out.peak_bytes_per_device[0] == res.cost


def test_auto_default_cost_never_worse_than_no_decision(case):
    s, cfg, prog, inputs, ref = case("transformer")
    mesh = Mesh(batch=2, model=2)
    low = lower_program(prog, mesh, s.strategy("bp", mesh, cfg) + [AutomaticPartition("model")], STATE_OUTPUTS)
    ((_, res),) = low.final_state.auto_results
    assert res.cost <= res.baseline and res.evaluations >= 2
    out = LocalMesh(mesh).run(low.spmd, inputs)
    assert verify(out.outputs, ref, low.spmd.output_names).verified
