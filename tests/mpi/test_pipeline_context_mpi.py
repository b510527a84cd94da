"""Pipeline and context parallelism over real MPI (issue 24 items 2 and 3): the pipelined transformer
step and the ring-attention step, their ``collective_permute``s now messages between ranks, are
bit-identical to the in-process LocalMesh and verify against ``jax.jit``: the circular schedule on 4
stages as 4 ranks of one device, GPipe under bp+mp+pp on 8 devices as 2 ranks of 4, 1F1B both ways and interleaved on 2 ranks of one, and ring
attention under cp on 4 devices as 2 ranks of 2; and the mechanism alone, a roll by part of a block.
Each launch has a hard timeout."""
from __future__ import annotations

import pytest

from partir_emu.mpi.jobs import save_inputs
from partir_emu.mpi.launch import MpiRun
from partir_emu.runtime.local_mesh import LocalMesh
from tests.mpi.conftest import bit_equal, lowered


@pytest.mark.parametrize("strategy, mesh, overrides, ranks", [
    ("pp", "stage=4", "batch=8,layers=8,pipeline=4,microbatches=4,virtual_stages=2", 4),
    ("bp+mp+pp", "batch=2,model=2,stage=2", "batch=8,layers=4,pipeline=2,microbatches=4", 2),
    ("cp", "context=4", "batch=4,layers=2,attention=ring,ring_blocks=4", 2),
    ("pp", "stage=4", "batch=8,layers=4,remat=1,pipeline=4,microbatches=4,schedule=1f1b", 4),
    ("bp+mp+pp", "batch=2,model=2,stage=2", "batch=8,layers=4,remat=1,pipeline=2,microbatches=2,schedule=1f1b", 2),
    ("pp", "stage=2", "batch=8,layers=8,remat=1,pipeline=2,microbatches=2,schedule=1f1b,virtual_stages=2", 2),
], ids=["circular-4x1", "bp+mp+pp-2x4", "ring-cp-2x2", "1f1b-4x1", "1f1b-bp+mp+pp-2x4", "1f1b-interleaved-2x1"])
def test_over_mpi_equals_local_mesh_and_jax(tmp_path, strategy, mesh, overrides, ranks):
    exp, spmd = lowered("transformer", strategy, mesh, overrides)
    assert sum(e.prim == "collective_permute" for e in spmd.collectives()) > 0
    inputs = exp.inputs(spmd.input_names)
    prog, inp = tmp_path / "step.json", tmp_path / "step.in.npz"
    spmd.save(prog)
    save_inputs(inp, spmd.input_names, inputs)
    want = LocalMesh(exp.mesh, "ring").run(spmd, inputs)
    job = {"program": str(prog), "inputs": str(inp), "algorithm": "ring", "devices_per_rank": exp.mesh.size // ranks}
    (res,) = MpiRun([job], ranks, timeout_s=180, workdir=tmp_path).start().wait()
    for name, got, w in zip(spmd.output_names, res["outputs"], want.outputs):
        assert bit_equal(got, w), f"{name}: MPI and LocalMesh differ"
    ver = exp.check(res["outputs"], inputs, spmd.output_names, exp.references(inputs))
    assert ver.verified, ver.to_json()["worst"]


def test_a_rotation_by_part_of_a_block_over_mpi(tmp_path):
    """The mechanism alone: ``jnp.roll`` by 3 rows of a dim tiled in blocks of 2 over 4 devices (two
    permutes of part-blocks each way), with its gradient, as 2 ranks of 2: bit-identical to
    LocalMesh and equal to jax.jit."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import partir_emu
    from partir_emu import ManualPartition, Mesh

    def fn(x, w):
        return jax.value_and_grad(lambda x: jnp.sum(jnp.sin(jnp.roll(x * w, 3, axis=0)) * w))(x)

    rng = np.random.default_rng(7)
    x, w = (rng.standard_normal((8, 5)).astype(np.float32) for _ in range(2))
    pjit = partir_emu.jit(fn, mesh=Mesh(s=4), schedule=[ManualPartition({"x": 0, "w": 0}, axis="s")])
    spmd = pjit.lower(x, w).spmd
    assert sum(e.prim == "collective_permute" for e in spmd.program.eqns) == 4       # 2 forward, 2 back
    prog, inp = tmp_path / "roll.json", tmp_path / "roll.in.npz"
    spmd.save(prog)
    save_inputs(inp, spmd.input_names, [x, w])
    want = LocalMesh(spmd.mesh, "ring").run(spmd, [x, w]).outputs
    job = {"program": str(prog), "inputs": str(inp), "algorithm": "ring", "devices_per_rank": 2}
    (res,) = MpiRun([job], 2, timeout_s=120, workdir=tmp_path).start().wait()
    for got, w_, ref in zip(res["outputs"], want, jax.tree.leaves(jax.jit(fn)(x, w))):
        assert bit_equal(got, w_)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
