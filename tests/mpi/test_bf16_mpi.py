"""bfloat16 over real MPI: the mixed-precision MLP step of tests/integration/test_bf16_runtime.py and the
transformer with ``precision=bf16`` (bf16 all_reduce, all_gather and reduce_scatter) on 4 devices
with 1 and 4 devices per rank, ring and native, equal LocalMesh bit for bit (ring: LocalMesh
'ring'; native: bfloat16 has no MPI datatype, so its reductions are gathered and summed in group
order, which is LocalMesh 'direct'). Two mpiexec launches (4 ranks, 1 rank).
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import pytest

from tests.integration.test_bf16_runtime import CASES, lowered_mlp
from tests.mpi.conftest import bit_equal, lowered

LAUNCH_TIMEOUT = 150
CONFIGS = {"4dev-1perrank": (4, 1), "4dev-4perrank": (1, 4)}
MPI_CASES = [(st, m) for st, m in CASES if m in ("batch=4", "model=4", "batch=2,model=2")]
ALGORITHMS = ("ring", "native")
TRANSFORMER = ("mp", "bp+mp+z3")     # on batch=2,model=2, precision=bf16
BF16 = "precision=bf16"


@functools.cache
def _launch(config: str) -> dict:
    from partir_emu.app.cli.mpi_run import launch
    from partir_emu.mpi.jobs import save_inputs
    ranks, k = CONFIGS[config]
    tmp = tempfile.mkdtemp(prefix=f"partir-emu-bf16-{config}-")
    atexit.register(shutil.rmtree, tmp, True)
    jobs, keys = [], []
    for n, ((st, mesh), alg) in enumerate((c, a) for c in MPI_CASES for a in ALGORITHMS):
        spmd, flat, _, _, _ = lowered_mlp(st, mesh)
        prog, inp = os.path.join(tmp, f"program-{n}.json"), os.path.join(tmp, f"mlp-inputs-{n}.npz")
        spmd.save(prog)
        save_inputs(inp, spmd.input_names, flat)
        jobs.append({"program": prog, "inputs": inp, "algorithm": alg, "devices_per_rank": k,
                     "out": os.path.join(tmp, f"out-{n}")})
        keys.append((st, mesh, alg))
    for n, (st, alg) in enumerate((st, a) for st in TRANSFORMER for a in ALGORITHMS):
        _, spmd = lowered("transformer", st, "batch=2,model=2", BF16)
        prog = os.path.join(tmp, f"transformer-{n}.json")
        spmd.save(prog)
        jobs.append({"program": prog, "scenario": "transformer", "preset": None, "overrides": BF16, "seed": 0,
                     "algorithm": alg, "devices_per_rank": k, "out": os.path.join(tmp, f"out-transformer-{n}")})
        keys.append(("transformer", st, alg))
    return dict(zip(keys, launch(jobs, ranks, timeout_s=LAUNCH_TIMEOUT, workdir=tmp)))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("strategy,mesh", MPI_CASES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_bf16_mpi_equals_local_mesh(config, strategy, mesh, algorithm):
    from partir_emu.runtime.local_mesh import LocalMesh
    res = _launch(config)[(strategy, mesh, algorithm)]
    spmd, flat, _, _, _ = lowered_mlp(strategy, mesh)
    local_alg = "direct" if algorithm == "native" else algorithm
    loc = LocalMesh(spmd.mesh, local_alg).run(spmd, flat)
    assert any(o.dtype.name == "bfloat16" for o in res["outputs"]), "no bf16 output came back from the ranks"
    for name, a, b in zip(spmd.output_names, res["outputs"], loc.outputs):
        assert bit_equal(a, b), f"{name}: MPI ({algorithm}, {config}) and LocalMesh ({local_alg}) differ"
    assert not any(res["stats"]["jax_imported"]), "an MPI rank imported jax"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("strategy", TRANSFORMER)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_bf16_transformer_mpi_equals_local_mesh(config, strategy, algorithm):
    from partir_emu.runtime.local_mesh import LocalMesh
    res = _launch(config)[("transformer", strategy, algorithm)]
    exp, spmd = lowered("transformer", strategy, "batch=2,model=2", BF16)
    kinds = {(e.prim, e.inputs[0].dtype) for e in spmd.program.eqns if e.prim in ("all_reduce", "all_gather",
                                                                                   "reduce_scatter")}
    assert ("all_reduce", "bfloat16") in kinds, kinds
    local_alg = "direct" if algorithm == "native" else algorithm
    loc = LocalMesh(exp.mesh, local_alg).run(spmd, exp.inputs())
    for name, a, b in zip(spmd.output_names, res["outputs"], loc.outputs):
        assert bit_equal(a, b), f"{name}: MPI ({algorithm}, {config}) and LocalMesh ({local_alg}) differ"
    assert not any(res["stats"]["jax_imported"]), "an MPI rank imported jax"
