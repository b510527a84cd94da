"""FP8 over real MPI: the transformer with ``precision=fp8`` under bp+mp+sp on 4 devices (all_gathers
of E4M3 weights and of E5M2 gradients, bfloat16 and float32 amax max-reductions, float32 sums) as 4
ranks of 1 device and 1 rank of 4 equals LocalMesh bit for bit (ring schedules; the same program on
LocalMesh verifies against jax.jit in tests/integration/test_fp8.py). Two mpiexec launches, each
with a hard timeout. (MPI's native reductions sum float32 over 4 members in their own order, so
they are not bit-identical to LocalMesh; bfloat16's are, tests/mpi/test_bf16_mpi.py.)"""
from __future__ import annotations

from partir_emu.mpi.jobs import save_inputs
from partir_emu.mpi.launch import MpiRun
from partir_emu.runtime.local_mesh import LocalMesh
from tests.mpi.conftest import bit_equal, lowered

FP8 = "precision=fp8"


def test_fp8_step_over_mpi_equals_local_mesh(tmp_path):
    exp, spmd = lowered("transformer", "bp+mp+sp", "batch=2,model=2", FP8)
    gathered = {e.inputs[0].dtype for e in spmd.program.eqns if e.prim == "all_gather"}
    assert {"float8_e4m3fn", "float8_e5m2"} <= gathered, gathered
    inputs = exp.inputs(spmd.input_names)
    prog, inp = tmp_path / "step.json", tmp_path / "step.in.npz"
    spmd.save(prog)
    save_inputs(inp, spmd.input_names, inputs)
    want = LocalMesh(exp.mesh, "ring").run(spmd, inputs)
    for ranks, k in ((4, 1), (1, 4)):
        job = {"program": str(prog), "inputs": str(inp), "algorithm": "ring", "devices_per_rank": k}
        (res,) = MpiRun([job], ranks, timeout_s=120, workdir=tmp_path).start().wait()
        for name, got, w in zip(spmd.output_names, res["outputs"], want.outputs):
            assert bit_equal(got, w), f"{name}: MPI ({ranks} ranks x {k}) and LocalMesh differ"
        assert any(o.dtype.name == "float32" for o in res["outputs"])
        assert not any(res["stats"]["jax_imported"]), "an MPI rank imported jax"
