"""AutomaticPartition on every scenario: ``bp+auto`` (the data axes as ``bp`` tiles them, then the
``model`` axis searched) is priced no higher than any manual strategy that tiles the data axes the
same way and uses ``model`` (``bp``, ``bp+mp``, ``bp+emb``, ``bp+edge``, ``bp+mq``, ...), by the
same cost the search uses (partir_emu.api.analytical_cost on its hardware: step time, within the
chip's memory). The search's decisions are its own: nothing here tells it what the manual
strategies do. The strictly-better case is tests/test_auto.py's t48 one."""
from __future__ import annotations

import pytest

import partir_emu as pe
from partir_emu.api import analytical_cost
from partir_emu.compiler.api import lower_program
from partir_emu.compiler.tactics import AutomaticPartition
from partir_emu.errors import ScenarioError
from scenarios.common import get_scenario

MESH = pe.Mesh(batch=2, model=2)

# (scenario, preset, --set overrides): emulation sizes, where every strategy builds on MESH
CASES = [("mlp", "small", None), ("transformer", "small", None), ("unet", "tiny", None), ("gns", "tiny", None),
         ("inference", "tiny", "phase=decode"), ("inference", "tiny", "phase=prefill")]


def _manual(sc) -> list[str]:
    """The manual strategies with ``bp``'s data tactics that use the model axis."""
    return [s for s in sc.strategies if s.split("+")[0] == "bp" and s not in ("bp+auto",)
            and not any(p.startswith("z") for p in s.split("+"))]


@pytest.mark.parametrize("scenario,preset,overrides", CASES)
def test_bp_auto_is_priced_no_higher_than_any_manual_strategy(scenario, preset, overrides):
    sc = get_scenario(scenario)
    cfg = sc.config(preset, overrides)
    prog = pe.trace(sc.build_step(cfg), *sc.abstract_inputs(cfg))
    schedule = sc.strategies["bp+auto"](MESH, cfg)
    auto = next(t for t in schedule if isinstance(t, AutomaticPartition))
    price = analytical_cost(auto)
    low = lower_program(prog, MESH, schedule, dict(sc.state_outputs), cost_model=analytical_cost)
    got = price(low.spmd)
    manual = {}
    for s in _manual(sc):
        try:
            tactics = sc.strategies[s](MESH, cfg)
        except ScenarioError:           # needs another mesh axis (unet's bp+spatial: a 'spatial' axis)
            continue
        manual[s] = price(lower_program(prog, MESH, tactics, dict(sc.state_outputs)).spmd)
    assert manual, scenario
    fitting = {s: p for s, p in manual.items() if p.peak_bytes <= p.capacity}
    best = min(fitting.values() or manual.values(), key=lambda p: p.value)
    assert got.peak_bytes <= got.capacity or not fitting
    assert got.value <= best.value * (1 + 1e-9), (
        f"{scenario}: bp+auto {got.value:.6g} s > best manual {best.value:.6g} s "
        f"({ {s: round(p.value, 9) for s, p in manual.items()} })")
    (label, result) = low.final_state.auto_results[-1]
    assert result.evaluations >= 1 and result.seconds > 0
