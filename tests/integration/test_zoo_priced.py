"""Every strategy of the model zoo is priced by both hardware models: ``simulate`` (analytical) and
``simulate-des`` (the simpy DES), on a TPU v4 torus and an H100 cluster, from the scenario registry.

The cases are those of the MPI tier (``tests/mpi/test_zoo_mpi.py``: every strategy of ``unet``, ``gns``
and ``inference`` in both phases, the transformer's ``emb`` and ``auto`` strategies) on the same 4-device
meshes. Each must price to a positive step with every collective of the program accounted for, fit the
chip; the DES must run the same collectives, and the DES (which runs every group's messages over the links, concurrently) must agree with the
analytical model within the validation limit on these uncontended 4-chip placements.
"""
from __future__ import annotations

import functools

import pytest

from partir_emu.hwmodels import simulate
from partir_emu.hwmodels.des import simulate_des
from partir_emu.hwmodels.validation.des import MAX_MAX
from tests.mpi.conftest import lowered
from tests.mpi.test_zoo_mpi import CASES, _id

pytestmark = pytest.mark.xdist_group("zoo_priced")    # its cached programs and references: made once, on one worker


@functools.cache
def _spmd(scenario: str, overrides: str | None, strategy: str, mesh: str):
    return lowered(scenario, strategy, mesh, overrides)[1]


@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["tpu-v4", "h100"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_zoo_strategy_is_priced_by_both_models(case, hardware):
    scenario, overrides, strategy, mesh = case
    spmd = _spmd(scenario, overrides, strategy, mesh)
    ana = simulate(spmd, hardware, overlap=True)
    des = simulate_des(spmd, hardware, overlap=True)
    assert ana.step_s > 0 and ana.fits, (case, ana.step_s, ana.peak_bytes_per_device)
    # every communicating collective is priced (a loop body's once per iteration), and the DES runs each
    assert bool(ana.collectives) == bool(spmd.collectives()), case
    assert des.step_s > 0 and len(des.collectives) == len(ana.collectives), case
    err = abs(ana.step_s - des.step_s) / des.step_s
    assert err <= MAX_MAX, f"{case} on {hardware}: analytical {ana.step_s:.6g} s vs DES {des.step_s:.6g} s ({err:.2%})"
