"""What makes a study's placement searches cheap must not change what they choose:

- the lower bounds of a step (:mod:`partir_emu.hwmodels.bounds`) are never above the step, on every
  placement, with any subset of the collectives priced;
- a pruned search (``prune=True``) chooses the placement and step of the full search, and does skip
  placements;
- the steps a search keeps (``Analyzer.searches``) serve a spec that differs only in what no step
  reads (its HBM capacity), and never one whose compute or network differs (a stale hit would give
  the old spec's steps: the fresh search of the edited spec tells);
- the memory lifetimes kept per program (``compute.memory._lifetimes``) are those of the program asked about;
- a study (all of the above together) prices every configuration as it is priced alone.

Cost: about 15 s (two tiny transformers lowered, 32 chips, priced on two chips)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from partir_emu.app.study.whatif import WhatIf, apply
from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.bounds import StepBound
from partir_emu.hwmodels.compute import memory
from partir_emu.hwmodels.machine.search import enumerate_placements, search_placement
from partir_emu.hwmodels.machine.specs import load_spec
from tests.loop_programs import layers_spmd

SPECS = ("tpu-v4", "h100")


@functools.cache
def lowered(strategy: str, mesh: str):
    from partir_emu.app.experiment import Experiment
    return Experiment("transformer", strategy, Mesh.parse(mesh), "tiny", "batch=64").lower().spmd


@pytest.fixture(scope="module")
def megatron():
    return lowered("bp+mp+z3", "batch=8,model=4")


@pytest.mark.parametrize("hw", SPECS)
@pytest.mark.parametrize("overlap", [True, False])
def test_the_bound_is_never_above_the_step(megatron, hw, overlap):
    an = Analyzer()
    spec = an.spec(hw)
    places, _ = enumerate_placements(megatron.mesh, an.topology(spec, megatron.mesh.size))
    keys = an.wire_keys(megatron.program, spec)
    bound = StepBound.of(an.entry(megatron.program), spec, overlap, None, 1, 1.0)
    assert bound is not None and len(places) > 2
    priced = []
    for p in places:
        step = an.step(megatron, spec, placement=p, overlap=overlap)
        model = an.comm_model(megatron, p)
        priced.append((step, np.array([model.cost(*k).time_s for k in keys])))
    rng = np.random.default_rng(0)
    tight = 0
    for fitted in range(len(places)):                 # the chain fitted on each placement's prices in turn
        bound.fit(priced[fitted][1])
        for step, prices in priced:
            full = bound.value(prices)
            assert full <= step * (1 + 1e-12), (full, step)
            tight += full >= 0.9 * step
            for _ in range(4):                        # some collectives not priced yet (taken as 0)
                known = rng.random(len(prices)) < 0.5
                assert bound.value(np.where(known, prices, 0.0)) <= full * (1 + 1e-12)
    assert tight, "the bound is nowhere near a step: it would never prune"


@pytest.mark.parametrize("hw", SPECS)
@pytest.mark.parametrize("mesh", ["batch=8,model=4", "batch=16,model=2"])
def test_a_pruned_search_chooses_what_the_full_search_chooses(hw, mesh):
    spmd = lowered("bp+mp+z3", mesh)
    full = search_placement(spmd, hw, Analyzer(), overlap=True)
    pruned = search_placement(spmd, hw, Analyzer(), overlap=True, prune=True)
    assert (pruned.mapping, pruned.step_s) == (full.mapping, full.step_s)
    assert set(pruned.candidates) <= set(full.candidates)
    no_overlap = search_placement(spmd, hw, Analyzer(), overlap=False, prune=True)
    assert no_overlap.mapping == search_placement(spmd, hw, Analyzer(), overlap=False).mapping


def test_pruning_skips_placements(megatron):
    choice = search_placement(megatron, "tpu-v4", Analyzer(), overlap=True, prune=True)
    assert len(choice.candidates) < len(enumerate_placements(megatron.mesh,
                                                             Analyzer().topology(load_spec("tpu-v4"), 32))[0])


def test_no_bound_for_loops_or_several_streams(megatron):
    an = Analyzer()
    spec = an.spec("tpu-v4")
    assert StepBound.of(an.entry(megatron.program), spec, True, None, 2, 1.0) is None
    looped = layers_spmd()
    assert an.entry(looped.program).costs.loops
    assert StepBound.of(an.entry(looped.program), spec, True, None, 1, 1.0) is None


def test_kept_steps_serve_only_a_spec_no_step_can_tell_apart(megatron):
    an = Analyzer()
    calls = []
    step = an.step

    def counted(*a, **k):
        calls.append(1)
        return step(*a, **k)

    an.step = counted                                     # type: ignore[method-assign]
    base = search_placement(megatron, apply("tpu-v4", WhatIf()), an, overlap=True)
    n = len(calls)
    more_hbm = search_placement(megatron, apply("tpu-v4", WhatIf.parse("hbm_gb=64")), an, overlap=True)
    assert len(calls) == n, "a spec with more HBM only searched again"
    assert more_hbm.candidates == base.candidates
    for edit in ("ici_bw*2", "hbm_bw*2", "flops*2"):
        spec = apply("tpu-v4", WhatIf.parse(edit))
        n = len(calls)
        kept = search_placement(megatron, spec, an, overlap=True)
        fresh = search_placement(megatron, spec, Analyzer(), overlap=True)
        assert kept.candidates == fresh.candidates
        if edit != "flops*2":     # (the tiny program's kernels are not bound by the matrix rate: same steps)
            assert fresh.candidates != base.candidates and len(calls) > n, f"{edit}: tpu-v4's steps taken for it"
    # a pruned search's steps (some placements skipped) do not serve a full search
    an2 = Analyzer()
    pruned = search_placement(megatron, "h100", an2, overlap=True, prune=True)
    again = search_placement(megatron, "h100", an2, overlap=True)
    assert len(again.candidates) > len(pruned.candidates)


def test_kept_lifetimes_are_the_programs_own(megatron):
    other = lowered("bp+mp+z3", "batch=16,model=2")
    policy = load_spec("tpu-v4").stack.saved_activations
    memory._LIFETIMES.clear()
    want = {id(p): (memory.peak_memory(p.program, policy=policy), memory.breakdown_at(p.program, 5, policy=policy))
            for p in (megatron, other)}
    memory._LIFETIMES.clear()
    stale = (megatron.program, *memory._lifetimes(megatron.program, policy))
    memory._LIFETIMES[(id(other.program), policy)] = stale          # another program's, under this one's id
    for p in (other, megatron, other):
        assert (memory.peak_memory(p.program, policy=policy),
                memory.breakdown_at(p.program, 5, policy=policy)) == want[id(p)]


def test_a_study_prices_each_configuration_as_one_by_one():
    """The study (pruned searches, kept steps across what-ifs, one Analyzer) against each configuration
    priced alone with a new Analyzer and a full search; a cold copy prices the same rows again."""
    from partir_emu.app.cli.simulate import choose_placement
    from partir_emu.app.study.evaluate import GIB, Study
    from partir_emu.app.study.space import Config
    from partir_emu.hwmodels.analytical import simulate
    configs = [Config("transformer", "tiny", "batch=64", "bp+mp+z3", Mesh(batch=8, model=4), hw, WhatIf.parse(w) if w
                      else WhatIf()) for hw in SPECS for w in ("", "hbm_gb=64", "ici_bw*2", "hbm_bw*2,hbm_gb=64")]
    study = Study()
    rows = study.run(configs)
    assert 0 < study.analyse_s < study.price_s
    for c, r in zip(configs, rows):
        _, spmd, flops = study.lowered(c)
        spec = study.spec(c.hardware, c.what_if)
        an = Analyzer()
        alone = simulate(spmd, spec, choose_placement(spmd, spec, None, an, overlap=True).placement, overlap=True,
                         analyzer=an, model_flops=flops)
        assert (r.figures["step_s"], r.figures["peak_gib"], r.figures["placement"]) == \
            (alone.step_s, alone.peak_bytes_per_device / GIB, alone.placement), c
    again = study.cold_copy().run(configs)
    assert [r.to_json() for r in again] == [r.to_json() for r in rows]
