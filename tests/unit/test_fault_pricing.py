"""Faults reach every price: the replay's analytical figure, and collectives whose members run apart."""
from __future__ import annotations

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels.des import DesOptions
from partir_emu.hwmodels.machine.links import link_factors
from partir_emu.hwmodels.machine.placement import place
from partir_emu.hwmodels.machine.specs import load_spec
from partir_emu.hwmodels.network.comm import CommModel
from partir_emu.hwmodels.validation.replay import expected_rows, replay


def _trace():
    """Two ring all-reduces over one 8-GPU NVSwitch node (the transfers their schedules predict)."""
    mesh = Mesh(x=8)
    head = {"format": "partir-emu-message-trace", "version": 2, "mesh": mesh.to_json(), "devices": 8,
            "ranks": 8, "devices_per_rank": 1, "algorithm": "ring",
            "collectives": {"1": {"prim": "all_reduce", "axes": ["x"], "bytes": 1 << 22, "itemsize": 4},
                            "2": {"prim": "all_reduce", "axes": ["x"], "bytes": 1 << 20, "itemsize": 4}}}
    return head, np.concatenate([expected_rows(head, c, 4) for c in (1, 2)])


def test_replay_prices_the_analytical_figure_with_its_faults():
    head, rows = _trace()
    spec = load_spec("h100")
    pl = place(Mesh(x=8), spec)
    clean = replay(head, rows, spec)
    slow = replay(head, rows, spec, options=DesOptions(degraded_links={"0-nvswitch0": 0.5}))
    factors = link_factors(pl.topology, {"0-nvswitch0": 0.5}, ())
    model = CommModel(pl, "ring", link_factors=factors)
    want = sum(model.cost("all_reduce", ("x",), b).time_s for b in (1 << 22, 1 << 20))
    assert slow.analytical_comm_s == pytest.approx(want, rel=1e-12)
    # GPU 0's NVLink port at half bandwidth is every ring step's bottleneck: both models slow down alike
    assert slow.analytical_comm_s > 1.2 * clean.analytical_comm_s
    assert slow.comm_s == pytest.approx(slow.analytical_comm_s, rel=1e-3)


def _one_all_reduce(p: int, nbytes: int):
    from partir_emu.core.ir import Eqn, Program, Var
    from partir_emu.core.sharding import Sharding
    from partir_emu.core.spmd import SpmdProgram
    x, y = Var(0, (nbytes // 4,), "float32"), Var(1, (nbytes // 4,), "float32")
    prog = Program((x,), ("x",), (Eqn("all_reduce", (x,), (y,), {"axes": ("x",), "op": "sum"}),), (y,), ("y",))
    return SpmdProgram(Mesh(x=p), prog, (Sharding.replicated(1),), (Sharding.replicated(1),), (x.shape,), (y.shape,))


def test_early_next_step_messages_on_a_slow_nic_are_priced(monkeypatch):
    """32 H100 (4 nodes), rail all-reduce of 64 MB, GPU 0's NIC at 1/4 both ways. Members away from
    GPU 0 finish each cross-node step early and send their next step's message to it at once; it
    shares GPU 0's slow inbound link with the message GPU 0 still waits for (measured in the DES:
    0.482 ms for that step instead of 0.322). The analytical price follows (async_steps); without the
    early messages' share it is the lock-step 1.221 ms against the DES's 1.541 ms."""
    from partir_emu.hwmodels.analytical import Analyzer, simulate
    from partir_emu.hwmodels.des import simulate_des
    from partir_emu.hwmodels.network import async_steps
    spmd = _one_all_reduce(32, 64_000_000)
    slow = {"0-leaf0": 0.25}
    des = simulate_des(spmd, "h100", algorithms="rail", degraded_links=slow)
    ana = simulate(spmd, "h100", algorithms="rail", degraded_links=slow, analyzer=Analyzer())
    assert ana.step_s == pytest.approx(des.step_s, rel=1e-3)
    monkeypatch.setattr(async_steps, "_interference",
                        lambda cur, r, f0, nxt, rho, bw, memo: (np.zeros(len(bw)), np.zeros(len(nxt.x))))
    blind = simulate(spmd, "h100", algorithms="rail", degraded_links=slow, analyzer=Analyzer())
    assert blind.step_s < 0.85 * des.step_s


@pytest.mark.parametrize("kind,shape,alg,dpn", [
    ("all_reduce", (16,), "ring", None), ("all_reduce", (32,), "hierarchical", 8), ("all_reduce", (32,), "rail", 8),
    ("all_reduce", (8,), "tree", None), ("reduce_scatter", (4, 4), "torus", None), ("all_to_all", (8,), "ring", None),
])
def test_messages_step_by_step_equal_the_whole_table(kind, shape, alg, dpn):
    """Large tables are merged one step shape at a time (memory); the result is the one-pass merge's."""
    from partir_emu.collectives.algorithms import build_schedule
    from partir_emu.hwmodels.network import messages
    n = 3 * 1024 * 1024 + (12 if kind == "all_reduce" else 0)      # all_reduce: uneven chunks
    sched = build_schedule(kind, shape, n, alg, itemsize=4, devices_per_node=dpn)
    whole = messages._messages(sched)
    step = messages._messages_by_step(sched)
    assert whole.p == step.p
    for a in ("ptr", "pair", "nbytes"):
        np.testing.assert_array_equal(getattr(whole, a), getattr(step, a))
