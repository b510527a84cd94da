"""Expert parallelism over real MPI: the mixture-of-experts transformer step under bp+ep (GShard's
all_to_all dispatch and combine over the ``expert`` axis) on 4 emulated devices, as 4 ranks of 1 and as
1 rank of 4, is bit-identical to the in-process LocalMesh and verifies against ``jax.jit``. Each launch
has a hard timeout."""
from __future__ import annotations

import pytest

from partir_emu.mpi.jobs import save_inputs
from partir_emu.mpi.launch import MpiRun
from partir_emu.runtime.local_mesh import LocalMesh
from tests.mpi.conftest import bit_equal, lowered


@pytest.mark.parametrize("ranks, per_rank", [(4, 1), (1, 4)])
def test_over_mpi_equals_local_mesh_and_jax(tmp_path, ranks, per_rank):
    exp, spmd = lowered("transformer", "bp+ep", "batch=2,expert=2", "experts=4")
    assert sum(c.prim == "all_to_all" for c in spmd.collectives()) == 8
    inputs = exp.inputs(spmd.input_names)
    prog, inp = tmp_path / "step.json", tmp_path / "step.in.npz"
    spmd.save(prog)
    save_inputs(inp, spmd.input_names, inputs)
    want = LocalMesh(exp.mesh, "ring").run(spmd, inputs)
    job = {"program": str(prog), "inputs": str(inp), "algorithm": "ring", "devices_per_rank": per_rank}
    (res,) = MpiRun([job], ranks, timeout_s=120, workdir=tmp_path).start().wait()
    for name, got, w in zip(spmd.output_names, res["outputs"], want.outputs):
        assert bit_equal(got, w), f"{name}: MPI and LocalMesh differ"
    ver = exp.check(res["outputs"], inputs, spmd.output_names, exp.references(inputs))
    assert ver.verified, ver.to_json()["worst"]
