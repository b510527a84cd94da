"""The mutation catalogue (docs/validation.md): deliberate errors that the validation must catch.

**Analytical-only errors** (:data:`ANALYTICAL`): each is applied by monkeypatching (no file is edited)
and must make ``validate`` FAIL (median > MEDIAN_MAX, max > MAX_MAX or a ranking differs) on a small
subset of the default suite chosen for it, while the same subset PASSES without it. The DES must not
move under the mutation (its step times are compared with the unmutated run): the error is in code
only the analytical model runs, so the DES is an independent check of it.

**Errors in code both models share** (:data:`SHARED`: schedules, routes, topology, algorithm choice,
link faults) move both models alike, so ``validate`` cannot see them; each must make a named
closed-form test fail (the test function is called here, in-process, under the mutation).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from partir_emu.app.programs import ProgramCache
from partir_emu.app.validation.cases import SUITES, run_suite
from partir_emu.collectives.schedule import CollectiveSchedule
from partir_emu.collectives.transfers import TransferTable
from partir_emu.hwmodels import analytical, pricing
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.machine import links
from partir_emu.hwmodels.machine.topology import Topology, pad_routes
from partir_emu.hwmodels.network import choice as algorithm_choice
from partir_emu.hwmodels.network import comm, contention, messages
from partir_emu.hwmodels.validation.des import Case
from partir_emu.hwmodels.validation.report import ValidationReport
from tests.unit import (
    test_collectives_schedule,
    test_des_collectives,
    test_hw_collectives,
    test_hw_topology,
)

pytestmark = pytest.mark.xdist_group("mutations")    # its cached programs and references: made once, on one worker

Patch = Callable[[pytest.MonkeyPatch], None]


# -- analytical-only mutations ---------------------------------------------------------------------------------
def _final_price(make: Callable[[comm.CommModel], Callable]) -> Patch:
    """Mutate the price the analytical model reports for a collective, not the algorithm choice: the
    choice (``CommModel.schedule``) prices its candidates on the same fabric, and the DES replays the
    schedule it picks, so a mutation there would move both models. ``make(model)`` returns the
    mutated ``price(axes, choice, sched)``, used only inside ``CommModel._compute``'s final pricing (the
    choice keeps its winner's price for ``_compute`` to reuse; the patch drops it so the final price is
    asked for again, mutated)."""
    def patch(mp: pytest.MonkeyPatch) -> None:
        final = [False]
        orig_schedule, orig_compute, orig_price = (comm.CommModel.schedule, comm.CommModel._compute,
                                                   comm.CommModel._price)

        def schedule(self, *args, **kw):
            was, final[0] = final[0], False
            try:
                return orig_schedule(self, *args, **kw)
            finally:
                final[0] = was
                self._priced.clear()     # the choice's own price of its winner is not reused: the final price is mutated

        def compute(self, *args, **kw):
            was, final[0] = final[0], True
            try:
                return orig_compute(self, *args, **kw)
            finally:
                final[0] = was

        def price(self, axes, choice, sched):
            if not final[0]:
                return orig_price(self, axes, choice, sched)
            mutated = self.__dict__.get("_mutated_price")
            if mutated is None:
                mutated = self.__dict__["_mutated_price"] = make(self)
            return mutated(axes, choice, sched)
        mp.setattr(comm.CommModel, "schedule", schedule)
        mp.setattr(comm.CommModel, "_compute", compute)
        mp.setattr(comm.CommModel, "_price", price)
    return patch


def _on(fabric: contention.Fabric) -> Callable:
    """``price(axes, choice, sched)`` on ``fabric`` (every group over ``axes``)."""
    return lambda axes, choice, sched: fabric.price(sched, *fabric.groups(axes, choice.chips))


def _allreduce_bw() -> Patch:
    """All-reduce priced at 0.8x the link bandwidth (seconds per byte / 0.8; latencies as they are)."""
    class SlowFabric(contention.Fabric):
        def _build_pattern(self, chips, pairs, p):
            pat = super()._build_pattern(chips, pairs, p)
            return dataclasses.replace(pat, inv_bw=pat.inv_bw / 0.8)

    def make(m: comm.CommModel) -> Callable:
        plain, slow = (_on(cls(m.placement.topology, m.link_factors, m.placement))
                       for cls in (contention.Fabric, SlowFabric))
        return lambda axes, choice, sched: (slow if sched.kind == "all_reduce" else plain)(axes, choice, sched)
    return _final_price(make)


def _hops(extra: int) -> Patch:
    """Every message's route latency priced with ``extra`` hops more (or fewer) than it crosses."""
    class HopFabric(contention.Fabric):
        def _build_pattern(self, chips, pairs, p):
            pat = super()._build_pattern(chips, pairs, p)
            hop = float(self.router.latency.min())
            return dataclasses.replace(pat, lat=np.maximum(pat.lat + extra * hop * (pat.inv_bw > 0), 0.0))
    return _final_price(lambda m: _on(HopFabric(m.placement.topology, m.link_factors, m.placement)))


def _analytical_long_way() -> Patch:
    """The analytical model's torus routes (``Router.route_matrix``, array form) forget the shorter way
    round a wrapped dim: every hop goes the + way."""
    class LongWay(links.Router):
        def _torus_matrix(self, src, dst):
            topo = self.topology
            coords, step, nxt = self._torus_tables()
            dims, wrap = np.array(topo.dims), np.array(topo.wrap)
            delta = coords[dst] - coords[src]
            delta = np.where(wrap[None, :], np.mod(delta, dims), delta)
            return pad_routes([_walk(step, nxt, int(s), d) for s, d in zip(src.tolist(), delta.tolist())])

    def make(m: comm.CommModel) -> Callable:
        router = LongWay(m.placement.topology, m.link_factors)
        return _on(contention.Fabric(m.placement.topology, m.link_factors, m.placement, router=router))
    return _final_price(make)


def _walk(step: np.ndarray, nxt: np.ndarray, chip: int, delta: list[int]) -> tuple[int, ...]:
    """The link ids from ``chip`` taking ``delta[d]`` hops along each dim in order (sign: direction)."""
    out = []
    for d, n in enumerate(delta):
        way = int(n < 0)
        for _ in range(abs(n)):
            out.append(int(step[chip, d, way]))
            chip = int(nxt[chip, d, way])
    return tuple(out)


def _one_group(gpu_only: bool) -> Patch:
    """The link load counts the flows of the representative group only (the other groups' flows go
    missing), everywhere or on GPU fabrics only (NIC and leaf links then look unshared)."""
    def make(m: comm.CommModel) -> Callable:
        fab = contention.Fabric(m.placement.topology, m.link_factors, m.placement)
        if gpu_only and m.placement.topology.kind != "gpu":
            return _on(fab)

        def price(axes, choice, sched):
            token, chips = fab.groups(axes, choice.chips)
            return fab.price(sched, token, chips[:1])
        return price
    return _final_price(make)


def _fabric_faults(keep: Callable[[float], bool]) -> Patch:
    """The analytical price drops the link faults ``keep`` rejects (degraded: factor > 0; failed: 0)."""
    def make(m: comm.CommModel) -> Callable:
        kept = {k: f for k, f in m.link_factors.items() if keep(f)}
        return _on(contention.Fabric(m.placement.topology, kept, m.placement))
    return _final_price(make)


def _simulate_without(name: str, value: object) -> Patch:
    """``Analyzer.simulate`` prices as if ``name`` were ``value`` (e.g. one stream, no stragglers)."""
    def patch(mp: pytest.MonkeyPatch) -> None:
        orig = Analyzer.simulate

        @functools.wraps(orig)               # keeps the signature validate reads the inputs it takes from
        def simulate(self, *args, **kw):
            assert name in kw, f"the analytical model was not given {name}"
            kw[name] = value
            return orig(self, *args, **kw)
        mp.setattr(Analyzer, "simulate", simulate)
    return patch


def _no_straggler_scale(mp: pytest.MonkeyPatch) -> None:
    """The analytical model computes every chip at full speed whatever the stragglers."""
    mp.setattr(analytical, "straggler_scale", lambda stragglers, num_devices: 1.0)


def _streams_unshared(mp: pytest.MonkeyPatch) -> None:
    """Collectives in flight on several streams are priced as if they shared no link."""
    mp.setattr(pricing.Contention, "of", classmethod(lambda cls, model, keys: None))


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    apply: Patch
    cases: Callable[[Case], bool]        # the default-suite cases that must catch it


def _mech(*names: str) -> Callable[[Case], bool]:
    return lambda c: c.mechanism in names


ANALYTICAL = (
    Mutation("allreduce-bw-x0.8", "all-reduce priced at 0.8x bandwidth", _allreduce_bw(),
             lambda c: c.mechanism == "closed-form" and c.strategy == "bp" and c.preset == "full"),
    Mutation("hop-too-many", "every message priced one hop longer", _hops(+1),
             lambda c: c.mechanism == "closed-form" and c.preset == "small"),
    Mutation("hop-too-few", "every message priced one hop shorter", _hops(-1),
             lambda c: c.mechanism == "closed-form" and c.preset == "small"),
    Mutation("analytical-routes-long-way", "analytical torus routes ignore the shorter way round",
             _analytical_long_way(), lambda c: c.mechanism == "closed-form" and c.hardware == "tpu-v4"
             and c.devices >= 64 and c.preset != "small"),
    Mutation("missing-flows", "link load counts one group's flows only", _one_group(False),
             _mech("group-contention")),
    Mutation("one-stream", "analytical prices 1 stream when more are asked", _simulate_without("comm_streams", 1),
             _mech("streams")),
    Mutation("streams-unshared", "collectives in flight share no link", _streams_unshared,
             lambda c: c.comm_streams > 1),
    Mutation("stragglers-ignored", "stragglers not priced (every chip at full speed)", _no_straggler_scale,
             _mech("straggler")),
    Mutation("degraded-ignored", "degraded-link factors not applied", _fabric_faults(lambda f: f == 0.0),
             _mech("degraded-link")),
    Mutation("failed-not-rerouted", "failed links priced as healthy (no detour)", _fabric_faults(lambda f: f > 0.0),
             _mech("failed-link")),
    Mutation("nic-sharing-ignored", "GPU NIC/leaf links priced per group (unshared)", _one_group(True),
             _mech("nic-sharing")),
)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Every case any mutation uses, run once without mutations: {case: result}."""
    cases = [c for c in SUITES["default"] if any(m.cases(c) for m in ANALYTICAL)]
    programs = ProgramCache(tmp_path_factory.mktemp("programs"))
    rep = run_suite(cases, programs=programs)
    return programs, {r.case: r for r in rep.results}


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ANALYTICAL, ids=lambda m: m.name)
def test_validate_catches_analytical_mutation(mutation, baseline, monkeypatch):
    programs, base = baseline
    cases = [c for c in SUITES["default"] if mutation.cases(c)]
    assert len(cases) >= 2
    clean = ValidationReport(mutation.name, tuple(base[c] for c in cases), 0.0, 0.0)
    assert clean.passed(), f"the subset fails even without the mutation: {clean.failures()}"
    mutation.apply(monkeypatch)
    rep = run_suite(cases, programs=programs)
    for r in rep.results:      # the DES runs none of the mutated code (with overlap it replays the order the
        if r.case.overlap:     # analytical schedule picked from its prices, so only there may it move)
            continue
        assert r.des_s == pytest.approx(base[r.case].des_s, rel=1e-12), r.case.label
    assert not rep.passed(), (f"{mutation.name} ({mutation.what}) passes validate: median "
                              f"{100 * rep.median_rel_err:.2f}%, max {100 * rep.max_rel_err:.2f}%")


# -- mutations of code both models share: caught by closed-form tests ----------------------------------------
def _route_long_way(mp: pytest.MonkeyPatch) -> None:
    """Torus routing (``Topology._torus_walk``, the one walk both models' routes come from) forgets to
    take the shorter way round a wrapped dim (always the + way)."""
    def torus_walk(self, src, dst):
        coords, step, nxt, dims, wrap = self._walk_tables()
        delta = coords[dst] - coords[src]
        delta = np.where(wrap, np.mod(delta, dims), delta)
        out = np.full((len(src), max(int(np.abs(delta).sum(axis=1).max(initial=0)), 1)), -1, dtype=np.int64)
        for f in range(len(src)):
            cur, pos = int(src[f]), 0
            for d in range(len(self.dims)):
                way = int(delta[f, d] < 0)
                for _ in range(abs(int(delta[f, d]))):
                    out[f, pos], cur, pos = step[cur, d, way], int(nxt[cur, d, way]), pos + 1
        return out
    mp.setattr(Topology, "_torus_walk", torus_walk)


def _route_via_spine(mp: pytest.MonkeyPatch) -> None:
    """GPU routing sends same-leaf cross-node traffic up to the spine and back (two hops too many)."""
    orig = Topology._gpu_route

    def gpu_route(self, src, dst):
        r = orig(self, src, dst)
        if len(r) == 2 and r[0].kind == "ib" and (r[0].dst, "spine") in self._by_ends:
            leaf = r[0].dst
            return [r[0], self._by_ends[(leaf, "spine")], self._by_ends[("spine", leaf)], r[1]]
        return r
    mp.setattr(Topology, "_gpu_route", gpu_route)


def _torus_bw(mp: pytest.MonkeyPatch) -> None:
    """Torus links built at 0.8x the spec's bandwidth."""
    orig = Topology.torus.__func__

    def torus(cls, dims, wrap=None, *, link_bw_bytes_per_s, **kw):
        return orig(cls, dims, wrap, link_bw_bytes_per_s=0.8 * link_bw_bytes_per_s, **kw)
    mp.setattr(Topology, "torus", classmethod(torus))


def _ring_bytes(mp: pytest.MonkeyPatch) -> None:
    """The ring all-reduce schedule moves 25 % more bytes per transfer than its chunks hold."""
    orig = CollectiveSchedule.table

    def table(self):
        t = orig(self)
        if self.kind != "all_reduce" or self.algorithm != "ring":
            return t
        return TransferTable(t.ptr, t.src, t.dst, t.chunk, t.count, t.reduce, nbytes=t.nbytes * 5 // 4)
    mp.setattr(CollectiveSchedule, "table", table)


def _no_bidir(mp: pytest.MonkeyPatch) -> None:
    """The algorithm choice runs a one-way ring where the runtime runs the bidirectional ring."""
    orig = algorithm_choice.candidates

    def candidates(kind, group, topology, algorithm=None, nbytes=None):
        out = orig(kind, group, topology, algorithm, nbytes)
        return [dataclasses.replace(c, algorithm="ring") if c.algorithm == "bidir_ring" else c for c in out]
    mp.setattr(algorithm_choice, "candidates", candidates)
    mp.setattr(comm, "candidates", candidates)


def _degrade_twice(mp: pytest.MonkeyPatch) -> None:
    """The shared Router applies a degraded link's factor twice."""
    orig = links.Router.__init__

    def init(self, topology, link_factors=None):
        orig(self, topology, {k: f * f for k, f in (link_factors or {}).items()})
    mp.setattr(links.Router, "__init__", init)


SHARED: tuple[tuple[str, Patch, tuple[Callable[[], None], ...]], ...] = (
    ("route-long-way-round", _route_long_way, (
        test_hw_topology.test_dimension_order_routing_takes_the_short_way_round,
        test_hw_collectives.test_2d_torus_all_reduce_dimension_wise)),
    ("route-via-spine", _route_via_spine, (test_hw_collectives.test_hierarchical_fat_tree_vs_rail_optimized,)),
    ("torus-bw-x0.8", _torus_bw, (
        lambda: test_hw_collectives.test_ring_all_reduce(8),
        test_hw_collectives.test_2d_torus_all_reduce_dimension_wise)),
    ("ring-schedule-bytes", _ring_bytes, (
        lambda: test_hw_collectives.test_ring_all_reduce(8),
        lambda: test_collectives_schedule.test_ring_traffic_closed_forms(4))),
    ("no-bidir-ring", _no_bidir, (
        lambda: test_hw_collectives.test_bidirectional_ring_all_reduce_is_default_on_a_wrapped_dim(8),)),
    ("degrade-twice", _degrade_twice, (test_des_collectives.test_degraded_link_slows_every_ring_step,)),
)


def _forget() -> None:
    """Drop what was computed (on either side of a mutation) and kept between calls: the schedules'
    message arrays (a built schedule is immutable and kept too, but no mutation here changes how one is
    built; analyzers are per call, so no prices or placements survive one)."""
    messages._MESSAGES.clear()
    messages._held[0] = 0


@pytest.mark.parametrize("name, patch, tests", SHARED, ids=[s[0] for s in SHARED])
def test_closed_form_tests_catch_shared_mutation(name, patch, tests):
    for test in tests:
        test()                                   # passes on the code as it is
    with pytest.MonkeyPatch.context() as mp:
        patch(mp)
        try:
            for test in tests:
                _forget()
                with pytest.raises(AssertionError):
                    test()
        finally:
            _forget()                            # nothing computed under the mutation may outlive it
