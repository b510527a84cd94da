"""Lock-step spans (:mod:`partir_emu.hwmodels.des.lockstep`): steps priced ahead on reserved links.

A span must change nothing but the number of events: every figure of the aggregated DES equals the
reference path (``aggregate=False``, which never takes spans) on the cases that take spans and on
those that break them (another collective needs a reserved link while a step is transmitting, or
while it is on the wire) or cancel them (the collective goes on member by member). The cases come
from the validation suite: concurrent streams, stragglers, degraded and failed links, NIC sharing.
"""
from __future__ import annotations

import collections

import pytest

from partir_emu.app.programs import ProgramCache
from partir_emu.app.validation.cases import case_program, get_suite
from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels import Placement, load_spec
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.des import DesOptions, lockstep
from partir_emu.hwmodels.des.model import Simulation
from partir_emu.hwmodels.des.network import spans as network_mod
from tests.integration.test_des_scale import _same
from tests.unit.test_des_collectives import one_collective, ring_topo


@pytest.fixture
def watch(monkeypatch):
    """Record every flow network built and how each span ended early (transmitting, on the wire,
    cancelled)."""
    nets: list = []
    ends: collections.Counter = collections.Counter()
    init = network_mod.FlowNetwork.__init__

    def track(self, *a, **kw):
        init(self, *a, **kw)
        nets.append(self)
    monkeypatch.setattr(network_mod.FlowNetwork, "__init__", track)
    brk, cancel = lockstep.Span.break_at, lockstep.Span.cancel

    def break_at(self, now):
        k = next((i for i, st in enumerate(self.steps) if st.t2 > now), len(self.steps) - 1)
        ends["transmitting" if now < self.steps[k].t1 else "on the wire"] += 1
        brk(self, now)

    def cancelled(self, now):
        ends["cancelled"] += 1
        cancel(self, now)
    monkeypatch.setattr(lockstep.Span, "break_at", break_at)
    monkeypatch.setattr(lockstep.Span, "cancel", cancelled)
    return nets, ends


def _ring(p: int, nbytes: int):
    placement = Placement(Mesh(x=p), ring_topo(p))
    return one_collective(placement.mesh, "all_reduce", ("x",), nbytes), load_spec("tpu-v4"), placement


def test_a_ring_runs_in_a_few_spans_with_the_reference_answer(watch):
    nets, _ = watch
    spmd, spec, placement = _ring(64, 1 << 24)
    fast, ref = _same(spmd, spec, placement, "ring")
    net = nets[0]                                  # the aggregated run's network (built first)
    steps = fast.collectives[0].steps
    assert steps == 126
    assert net.spans_taken == 1 and net.spans_broken == 0        # 126 steps, one span, one event
    assert fast.events * 20 < ref.events
    assert fast.events < 10


def test_a_span_holds_at_most_max_steps(watch, monkeypatch):
    nets, _ = watch
    monkeypatch.setattr(lockstep, "MAX_STEPS", 16)
    spmd, spec, placement = _ring(64, 1 << 20)
    _same(spmd, spec, placement, "ring")
    assert nets[0].spans_taken == -(-126 // 16)


# validate cases whose spans are broken or cancelled (streams, stragglers, faults, NIC sharing)
BREAKING = [(m, s, h, mesh, streams) for m, s, h, mesh, streams in [
    ("streams", "bp+mp", "tpu-v4", "batch=8,model=8", 2),
    ("streams", "bp+mp+z3", "tpu-v4", "batch=16,model=4", 2),
    ("streams", "bp+mp", "h100", "batch=8,model=8", 2),
    ("straggler", "bp+mp", "tpu-v4", "batch=2,model=4", 1),
    ("straggler", "bp+mp", "tpu-v4", "batch=64,model=4", 1),
    ("degraded-link", "bp", "h100", "batch=64", 1),
    ("failed-link", "bp", "tpu-v4", "batch=64", 1),
    ("failed-link", "bp+mp", "tpu-v4", "batch=64,model=4", 1),
    ("nic-sharing", "bp+mp", "h100", "batch=16,model=4", 2),
]]


def _cases():
    out = []
    for c in get_suite("default"):
        key = (c.mechanism, c.strategy, c.hardware, c.mesh, c.comm_streams)
        if key in BREAKING and key not in [k for k, _ in out]:
            out.append((key, c))
    assert sorted(k for k, _ in out) == sorted(BREAKING), "a case left the validation suite: pick another that breaks spans"
    return [c for _, c in out]


@pytest.mark.slow
def test_broken_and_cancelled_spans_give_the_reference_answer(watch):
    nets, ends = watch
    programs = ProgramCache()
    for case in _cases():
        spmd = case_program(case, programs)
        spec = load_spec(case.hardware, case.spec_overrides()) if case.hw_overrides else load_spec(case.hardware)
        placement = Analyzer().placement(spmd.mesh, spec, case.placement, case.slice_tuple())
        before = len(nets)
        _same(spmd, spec, placement, overlap=case.overlap, **case.inputs())
        assert nets[before].spans_taken > 0, case
    # every way a span ends early was taken
    assert ends["transmitting"] > 0 and ends["on the wire"] > 0 and ends["cancelled"] > 0, ends


def test_spans_need_the_flow_network_and_no_per_message_overhead():
    spmd, spec, placement = _ring(16, 1 << 20)
    for opts, spans in [(DesOptions(), True), (DesOptions(message_overhead_s=1e-6), False),
                        (DesOptions(aggregate=False), False), (DesOptions(trace=True), False)]:
        sim = Simulation(spmd, spec, placement, False, "ring", opts)
        sim.run()
        assert (getattr(sim.network, "spans_taken", 0) > 0) == spans, opts
