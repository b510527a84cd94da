"""The inference scenario over real MPI: prefill and decode with ``mp`` and ``bp+mq`` on 4
devices, with 1 and 4 devices per rank (two mpiexec launches), verified against jax.jit and equal
to LocalMesh bit for bit (ring algorithm on both)."""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import pytest

from tests.mpi.conftest import bit_equal, lowered

LAUNCH_TIMEOUT = 150
CONFIGS = {"4dev-1perrank": (4, 1), "4dev-4perrank": (1, 4)}
CASES = [("mp", "model=4", "phase=decode"), ("bp+mq", "batch=2,model=2", "phase=decode"),
         ("bp+mq", "batch=2,model=2", "phase=prefill")]


@functools.cache
def _launch(config: str) -> dict:
    from partir_emu.app.mpi_run import launch
    ranks, k = CONFIGS[config]
    tmp = tempfile.mkdtemp(prefix=f"partir-emu-inference-{config}-")
    atexit.register(shutil.rmtree, tmp, True)
    jobs = []
    for n, (st, mesh, over) in enumerate(CASES):
        _, spmd = lowered("inference", st, mesh, over)
        prog = os.path.join(tmp, f"inference-{n}.json")
        spmd.save(prog)
        jobs.append({"program": prog, "scenario": "inference", "preset": None, "overrides": over, "seed": 0,
                     "algorithm": "ring", "devices_per_rank": k, "out": os.path.join(tmp, f"out-{n}")})
    return dict(zip(CASES, launch(jobs, ranks, timeout_s=LAUNCH_TIMEOUT, workdir=tmp)))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_inference_mpi_verifies(config, case):
    from partir_emu.runtime.local_mesh import LocalMesh
    res = _launch(config)[case]
    exp, spmd = lowered("inference", *case)
    inputs = exp.inputs(spmd.input_names)
    ver = exp.check(res["outputs"], inputs, spmd.output_names)
    assert ver.verified, ver.to_json()
    loc = LocalMesh(exp.mesh, "ring").run(spmd, inputs)
    for name, a, b in zip(spmd.output_names, res["outputs"], loc.outputs):
        assert bit_equal(a, b), f"{name}: MPI ({config}) and LocalMesh (ring) differ"
    assert not any(res["stats"]["jax_imported"]), "an MPI rank imported jax"
