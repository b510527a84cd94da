"""What makes choosing a collective's algorithm cheap must not change the choice or its price:

- the floor of a candidate's lock-step pass (:meth:`~partir_emu.hwmodels.network.contention.Fabric.lockstep`)
  is never above its price, whether its members run in step or drift apart (and so is
  :meth:`CommModel.floor`, which the placement search's probes try before a price);
- a model that leaves the candidates whose floor is above the cheapest price unpriced (``SKIP_REL``)
  chooses the algorithm, schedule and price a model that prices every candidate chooses, on TPU
  and GPU placements, with a degraded link, and does leave some unpriced;
- a price that continues from a floor's lock-step pass equals a price made from scratch.

Cost: about 3 s (64 TPU v4 chips, 32 H100, collectives of 4 KiB to 64 MiB)."""
from __future__ import annotations

import math

import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels.machine.links import link_factors
from partir_emu.hwmodels.machine.placement import place
from partir_emu.hwmodels.machine.specs import load_spec
from partir_emu.hwmodels.network import comm, contention
from partir_emu.hwmodels.network.comm import CommModel

SIZES = (4096, 1 << 20, 48 << 20)
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
CASES = {   # spec, mesh, faults
    "tpu": ("tpu-v4", Mesh(batch=16, model=4), {}),
    "gpu": ("h100", Mesh(batch=4, model=8), {}),
    "gpu-across": ("h100", Mesh(model=8, batch=4), {}),          # default fill: batch inside a node
    "gpu-degraded": ("h100", Mesh(batch=4, model=8), {"0-leaf0": 0.25}),
}


def _model(case: str) -> CommModel:
    spec, mesh, slow = CASES[case]
    pl = place(mesh, load_spec(spec))
    return CommModel(pl, link_factors=link_factors(pl.topology, slow, ()))


def _collectives(model: CommModel):
    axes = [(a,) for a in model.placement.mesh.axis_names] + [tuple(model.placement.mesh.axis_names)]
    return [(k, a, n) for k in KINDS for a in axes for n in SIZES]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_floor_is_never_above_the_price(case):
    model = _model(case)
    fab = model.fabric
    uneven = 0
    for kind, axes, nbytes in _collectives(model):
        floor = _model(case).floor(kind, axes, nbytes)
        assert floor <= model.cost(kind, axes, nbytes).time_s * (1 + 1e-12)
        for choice, sched in model._candidates(kind, axes, nbytes, "float32", None) or ():
            groups = fab.groups(axes, choice.chips)
            first = fab.lockstep(sched, *groups, floor=True)
            price = fab.price(sched, *groups)
            assert first.floor <= price[0] * (1 + 1e-12), (kind, axes, nbytes, choice.algorithm)
            assert fab.settle(first, sched, *groups) == price
            uneven += first.uneven
    assert uneven, "no candidate whose members drift apart: the floors of the costly part are not tested"


@pytest.mark.parametrize("case", sorted(CASES))
def test_skipping_candidates_chooses_what_pricing_every_one_chooses(case, monkeypatch):
    calls = [0]
    walk = contention.async_critical_path

    def counted(*args, **kwargs):
        calls[0] += 1
        return walk(*args, **kwargs)

    monkeypatch.setattr(contention, "async_critical_path", counted)

    def choices(skip: float, floors: bool) -> tuple[list, int]:
        monkeypatch.setattr(comm, "SKIP_REL", skip)
        calls[0] = 0
        model = _model(case)
        out = []
        for c in _collectives(model):
            if floors:                                       # a probe's floor first, then the price
                model.floor(*c)
            built = model.schedule(*c)
            out.append((model.cost(*c), built))
        return out, calls[0]

    every, walked = choices(math.inf, False)
    assert choices(1e-9, False)[0] == every
    skipped, fewer = choices(1e-9, True)
    assert skipped == every
    if case != "tpu":                                        # GPU groups across nodes drift: some are skipped
        assert fewer < walked, (fewer, walked)
