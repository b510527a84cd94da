"""Sequence parallelism and hybrid ZeRO over real MPI: the transformer step under bp+mp+sp+z3 (all-gathers
over the sequence before Megatron's column-parallel matmuls, reduce-scatters after its row-parallel
ones) and bp+z3@batch (gradient shards all-reduced over a second data axis) on 8 emulated devices,
as 2 ranks of 4, is bit-identical to the in-process LocalMesh and verifies against ``jax.jit``. Each
launch has a hard timeout."""
from __future__ import annotations

import pytest

from partir_emu.mpi.jobs import save_inputs
from partir_emu.mpi.launch import MpiRun
from partir_emu.runtime.local_mesh import LocalMesh
from tests.mpi.conftest import bit_equal, lowered


@pytest.mark.parametrize("strategy, mesh", [("bp+mp+sp+z3", "batch=4,model=2"), ("bp+z3@batch", "dcn=2,batch=4")])
def test_over_mpi_equals_local_mesh_and_jax(tmp_path, strategy, mesh):
    exp, spmd = lowered("transformer", strategy, mesh, "batch=8,layers=1")
    inputs = exp.inputs(spmd.input_names)
    prog, inp = tmp_path / "step.json", tmp_path / "step.in.npz"
    spmd.save(prog)
    save_inputs(inp, spmd.input_names, inputs)
    want = LocalMesh(exp.mesh, "ring").run(spmd, inputs)
    job = {"program": str(prog), "inputs": str(inp), "algorithm": "ring", "devices_per_rank": 4}
    (res,) = MpiRun([job], 2, timeout_s=120, workdir=tmp_path).start().wait()
    for name, got, w in zip(spmd.output_names, res["outputs"], want.outputs):
        assert bit_equal(got, w), f"{name}: MPI and LocalMesh differ"
    ver = exp.check(res["outputs"], inputs, spmd.output_names, exp.references(inputs))
    assert ver.verified, ver.to_json()["worst"]
