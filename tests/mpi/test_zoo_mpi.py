"""Every strategy of the model zoo over real MPI: ``unet``, ``gns``, ``inference`` (prefill and decode)
and the transformer's vocab-parallel and automatic strategies, on 4 devices with one device per rank
(``mpiexec -n 4``) and four (``-n 1``).

The cases come from the scenario registry, never listed by hand: every registered strategy of each
zoo scenario (``bp+auto`` included: the search runs here, in the driver, and its program goes to the
ranks like any other). Each runs on the first of ``MESHES`` that carries every axis it needs, the same
rule as the XLA interop test. One launch per (scenario, layout), all its strategies as jobs, each with
a hard timeout; the ranks build the scenario's inputs themselves and never import jax.

Each result is verified against jax.jit of the unpartitioned step (the verdict: within float32
rounding, normwise where Adam amplifies it) and equals the in-process LocalMesh bit for bit (both
run the ring schedules).
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import pytest

from scenarios import get_scenario
from tests.mpi.conftest import bit_equal, lowered, verdict_references

LAUNCH_TIMEOUT = 300
CONFIGS = {"4dev-1perrank": (4, 1), "4dev-4perrank": (1, 4)}
MESHES = ("batch=2,model=2", "spatial=4", "batch=2,spatial=2")
# (scenario, overrides, which strategies): the zoo scenarios whole; the transformer's strategies that the
# zoo issue added (the others run in test_mpi_mesh.py)
SCENARIOS = (("unet", None, None), ("gns", None, None), ("inference", "phase=prefill", None),
             ("inference", "phase=decode", None), ("transformer", None, ("bp+emb", "bp+mp+emb", "bp+mp+emb+z3",
                                                                         "bp+auto")))


def _cases() -> list[tuple[str, str | None, str, str]]:
    out = []
    for scenario, overrides, only in SCENARIOS:
        for st in only or sorted(get_scenario(scenario).strategies):
            out.append((scenario, overrides, st, get_scenario(scenario).first_mesh(st, MESHES)))
    return out


CASES = _cases()


def _id(case: tuple) -> str:
    sc, ov, st, mesh = case
    return f"{sc}{'-' + ov.split('=')[1] if ov else ''}-{st}-{mesh.replace('=2', '').replace(',', '.')}"


@functools.cache
def _launch(scenario: str, overrides: str | None, config: str) -> dict:
    from partir_emu.app.cli.mpi_run import launch
    ranks, k = CONFIGS[config]
    tmp = tempfile.mkdtemp(prefix=f"partir-emu-zoo-{scenario}-{config}-")
    atexit.register(shutil.rmtree, tmp, True)
    mine = [c for c in CASES if c[:2] == (scenario, overrides)]
    jobs = []
    for n, (_, _, st, mesh) in enumerate(mine):
        _, spmd = lowered(scenario, st, mesh, overrides)
        prog = os.path.join(tmp, f"program-{n}.json")
        spmd.save(prog)
        jobs.append({"program": prog, "scenario": scenario, "preset": None, "overrides": overrides, "seed": 0,
                     "algorithm": "ring", "devices_per_rank": k, "out": os.path.join(tmp, f"out-{n}")})
    return dict(zip(mine, launch(jobs, ranks, timeout_s=LAUNCH_TIMEOUT, workdir=tmp)))


def _references(scenario: str, overrides: str | None) -> tuple:
    return verdict_references(scenario, overrides)


@functools.cache
def _local(case: tuple) -> list:
    """The in-process LocalMesh's outputs (ring schedules), once per case for both layouts."""
    from partir_emu.runtime.local_mesh import LocalMesh
    scenario, overrides, strategy, mesh = case
    exp, spmd = lowered(scenario, strategy, mesh, overrides)
    return LocalMesh(exp.mesh, "ring").run(spmd, _references(scenario, overrides)[0]).outputs


def test_every_zoo_strategy_is_covered():
    """The registry decides: a strategy added to a zoo scenario runs here without editing this file."""
    for scenario, overrides, only in SCENARIOS:
        got = sorted(st for sc, ov, st, _ in CASES if (sc, ov) == (scenario, overrides))
        assert got == sorted(only or get_scenario(scenario).strategies)
    assert sum(st == "bp+auto" for _, _, st, _ in CASES) == len(SCENARIOS)


# one xdist group per scenario and size: one worker launches both layouts and shares their LocalMesh runs
@pytest.mark.parametrize("config,case", [pytest.param(cfg, c, id=f"{_id(c)}-{cfg}",
                                                      marks=pytest.mark.xdist_group(f"zoo-{c[0]}-{c[1]}"))
                                         for c in CASES for cfg in CONFIGS])
def test_zoo_strategy_over_mpi_equals_jax_and_local_mesh(config, case):
    scenario, overrides, strategy, mesh = case
    res = _launch(scenario, overrides, config)[case]
    exp, spmd = lowered(scenario, strategy, mesh, overrides)
    inputs, refs = _references(scenario, overrides)
    ver = exp.check(res["outputs"], inputs, spmd.output_names, refs)
    assert ver.verified, (config, case, ver.to_json()["worst"])
    for name, a, b in zip(spmd.output_names, res["outputs"], _local(case)):
        assert bit_equal(a, b), f"{name}: MPI ({config}) and LocalMesh differ ({case})"
    assert not any(res["stats"]["jax_imported"]), "an MPI rank imported jax"


def test_exact_kernels_over_mpi_equal_the_local_mesh():
    """A job's ``kernels: exact`` reaches the ranks: the U-Net with its image rows tiled runs the
    fixed-order matmul there as here, bit for bit (and says so in its stats)."""
    from partir_emu.app.cli.mpi_run import launch
    from partir_emu.runtime.local_mesh import LocalMesh
    exp, spmd = lowered("unet", "spatial", "spatial=4")
    tmp = tempfile.mkdtemp(prefix="partir-emu-zoo-exact-")
    atexit.register(shutil.rmtree, tmp, True)
    prog = os.path.join(tmp, "program.json")
    spmd.save(prog)
    job = {"program": prog, "scenario": "unet", "preset": None, "overrides": None, "seed": 0, "algorithm": "ring",
           "devices_per_rank": 2, "kernels": "exact", "out": os.path.join(tmp, "out")}
    (res,) = launch([job], 2, timeout_s=LAUNCH_TIMEOUT, workdir=tmp)
    assert res["stats"]["kernels"] == "exact"
    loc = LocalMesh(exp.mesh, "ring", kernels="exact").run(spmd, exp.inputs())
    for name, a, b in zip(spmd.output_names, res["outputs"], loc.outputs):
        assert bit_equal(a, b), f"{name}: MPI and LocalMesh differ with the exact kernel"
