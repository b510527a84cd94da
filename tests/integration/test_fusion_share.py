"""Fusion groupings shared by programs of one structure (:class:`partir_emu.hwmodels.compute.fusion_plan.Groupings`)
give each program the plan its own grouping gives: the tiny transformer lowered with one strategy on
three meshes (one structure, other shapes), grouped by the compilers of a TPU, a GPU and an eager
stack, each plan array-equal to the unshared one, and the grouping really taken from the first
program; a program of another strategy (another structure) is grouped on its own. The Analyzer
gives its programs one store, so a study's what-ifs and placements price the same plans.

Cost: about 10 s (four tiny transformers lowered)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.compute import fusion_plan
from partir_emu.hwmodels.compute.fusion import fuse
from partir_emu.hwmodels.compute.fusion_plan import Groupings
from partir_emu.hwmodels.compute.program import analyze
from partir_emu.hwmodels.compute.stack import load_stack
from partir_emu.hwmodels.machine.specs import load_spec

MESHES = ("batch=8,model=4", "batch=16,model=2", "batch=4,model=4")


@functools.cache
def lowered(strategy: str, mesh: str):
    from partir_emu.app.experiment import Experiment
    return Experiment("transformer", strategy, Mesh.parse(mesh), "tiny", "batch=64").lower().spmd.program


def _compilers():
    return {"tpu-v4": load_spec("tpu-v4").kernels, "h100": load_spec("h100").kernels,
            "h100 pytorch-fsdp": load_spec("h100").with_stack(load_stack("pytorch-fsdp")).kernels}


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) if isinstance(getattr(a, f), np.ndarray)
               else getattr(a, f) == getattr(b, f) for f in a.__dataclass_fields__)


@pytest.mark.parametrize("name", sorted(_compilers()))
def test_a_shared_grouping_gives_each_program_its_own_plan(name, monkeypatch):
    compiler = _compilers()[name]
    taken = []
    find = Groupings.find

    def spy(self, program, variant):
        hit = find(self, program, variant)
        taken.append(hit is not None)
        return hit

    monkeypatch.setattr(Groupings, "find", spy)
    shared = Groupings()
    programs = [lowered("bp+mp+z3", m) for m in MESHES] + [lowered("bp+z3", "batch=32")]
    for prog in programs:
        pc = analyze(prog)
        own = fuse(prog, pc.flops, pc.bytes, compiler)
        assert _same(fuse(prog, pc.flops, pc.bytes, compiler, shared), own), (name, prog)
    assert taken == [False, True, True, False]          # the other meshes take the first's; bp+z3 does not


def test_a_bias_size_that_differs_is_grouped_on_its_own(monkeypatch):
    """The GPU epilogue takes a consumer of a dot that reads nothing full-size besides: with the bias-size
    answers of the first program faked different, the kept grouping must not serve the next."""
    compiler = _compilers()["h100"]
    shared = Groupings()
    first, second = (lowered("bp+mp+z3", m) for m in MESHES[:2])
    pc = analyze(first)
    fuse(first, pc.flops, pc.bytes, compiler, shared)
    (key, kept), = shared._by.items()
    assert kept[1].shaped, "the GPU grouping asked no bias-size question: nothing to check"
    i, answers = next(iter(kept[1].shaped.items()))
    kept[1].shaped[i] = tuple(not a for a in answers)
    assert shared.find(second, compiler.variant) is None
    monkeypatch.setattr(fusion_plan, "_MAX_ENTRIES", 0)          # a full store starts afresh
    shared.keep(second, compiler.variant, [], [], [], [], set())
    assert len(shared._by) == 1


def test_the_analyzer_shares_its_groupings():
    an = Analyzer()
    spec = load_spec("h100")
    plans = [an.entry(lowered("bp+mp+z3", m)).costs.fusion.plan(spec.kernels) for m in MESHES[:2]]
    assert len(an.groupings._by) == 1
    pc = analyze(lowered("bp+mp+z3", MESHES[1]))
    assert _same(plans[1], fuse(lowered("bp+mp+z3", MESHES[1]), pc.flops, pc.bytes, spec.kernels))
    an.clear()
    assert not an.groupings._by
