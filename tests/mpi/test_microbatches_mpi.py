"""Gradient accumulation over real MPI: the microbatched transformer step (a loop whose body holds
the micro-batch's all-gathers, reduce-scatters and Megatron all-reduces) under bp+mp+z3 on 8
emulated devices (and under bp+mp, whose gradient all-reduces move out of the loop), as 8 ranks
of 1 device and 2 ranks of 4, is bit-identical to the in-process LocalMesh, has its peak bytes,
and verifies against the unpartitioned ``jax.jit``. Two launches per strategy, each with a hard
timeout."""
from __future__ import annotations

import pytest

from partir_emu.mpi.jobs import save_inputs
from partir_emu.mpi.launch import MpiRun
from partir_emu.runtime.local_mesh import LocalMesh
from tests.mpi.conftest import bit_equal, lowered

MESH = "batch=4,model=2"
OVERRIDES = "batch=8,layers=1,microbatches=2"      # micro-batches of 4 rows: one per data-parallel device


@pytest.mark.parametrize("strategy", ["bp+mp+z3", "bp+mp"])
def test_microbatched_step_over_mpi_equals_local_mesh_and_jax(tmp_path, strategy):
    """bp+mp also carries its gradients as pending sums and all-reduces them once after the loop
    (``compiler/lowering/sink.py``: ``to_partial`` before the loop, one all-reduce each after)."""
    exp, spmd = lowered("transformer", strategy, MESH, OVERRIDES)
    assert any(e.prim == "loop" for e in spmd.program.eqns)
    inputs = exp.inputs(spmd.input_names)
    prog, inp = tmp_path / "step.json", tmp_path / "step.in.npz"
    spmd.save(prog)
    save_inputs(inp, spmd.input_names, inputs)
    want = LocalMesh(exp.mesh, "ring").run(spmd, inputs)
    refs = exp.references(inputs)
    for ranks, k in ((8, 1), (2, 4)):
        job = {"program": str(prog), "inputs": str(inp), "algorithm": "ring", "devices_per_rank": k}
        (res,) = MpiRun([job], ranks, timeout_s=120, workdir=tmp_path).start().wait()
        for name, got, w in zip(spmd.output_names, res["outputs"], want.outputs):
            assert bit_equal(got, w), f"{name}: MPI ({ranks} ranks x {k}) and LocalMesh differ"
        assert res["stats"]["peak_bytes_per_device"] == want.peak_bytes_per_device
        ver = exp.check(res["outputs"], inputs, spmd.output_names, refs)
        assert ver.verified, ver.to_json()["worst"]
