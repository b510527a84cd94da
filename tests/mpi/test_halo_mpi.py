"""A conv net train step with its spatial dims tiled (halo exchanges, ``compiler/lowering/halo.py``; H, and H×W
on a 2-D mesh) and a 'SAME' max pooling (whose outer halo rows are -inf) over real MPI: bit-identical to the in-process LocalMesh and within float32 rounding of jax.jit, with 1 and 4
devices per rank; the traced messages replay on the DES at the analytical price.

One test, two launches (``mpiexec -n 4`` with one device per rank, ``-n 1`` with four), each with a
hard timeout. The programs are lowered here and run by ``_permute_worker.py`` (it runs any saved
``case*.json`` SpmdProgram and never imports jax).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import partir_emu
from partir_emu import ManualPartition, Mesh
from partir_emu.core.msgtrace import read_message_trace
from partir_emu.hwmodels.validation.replay import replay
from partir_emu.runtime.local_mesh import LocalMesh
from tests.integration.test_halo import _ARGS, _step
from tests.mpi.conftest import MPIEXEC
from tests.mpi.test_collective_permute_mpi import _launch


def _max_pool(x):
    """'SAME' 3×3 max pooling, stride 1: a halo each way whose outer rows must be -inf (axis_index)."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")


_NEG = (-np.abs(np.random.default_rng(3).standard_normal((2, 16, 4, 3))) - 1).astype(np.float32)
CASES = [   # (step, args, mesh, schedule, collective_permutes)
    (_step, _ARGS, Mesh(spatial=4), [ManualPartition({"x": 1}, axis="spatial")], 10),
    (_step, _ARGS, Mesh(h=2, w=2), [ManualPartition({"x": 1}, axis="h"), ManualPartition({"x": 2}, axis="w")], 20),
    (_max_pool, (_NEG,), Mesh(spatial=4), [ManualPartition({"x": 1}, axis="spatial")], 2),
]


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
def test_spatially_tiled_conv_net_over_mpi(tmp_path):
    expect, refs = {}, {}
    for i, (fn, args, mesh, schedule, permutes) in enumerate(CASES):
        leaves = [np.asarray(a) for a in jax.tree_util.tree_leaves(args)]
        outputs = {"1": "params"} if fn is _step else None
        spmd = partir_emu.jit(fn, mesh=mesh, schedule=schedule, state_outputs=outputs).lower(*args).spmd
        assert sum(e.prim == "collective_permute" for e in spmd.collectives()) == permutes
        assert [tuple(v.shape) for v in leaves] == [tuple(s) for s in spmd.global_in_shapes]
        spmd.save(tmp_path / f"case{i}.json")
        np.savez(tmp_path / f"case{i}.in.npz", **dict(zip(spmd.input_names, leaves)))
        expect[i] = LocalMesh(mesh).run(spmd, leaves).outputs
        refs[i] = [np.asarray(r) for r in jax.tree_util.tree_leaves(jax.jit(fn)(*args))]
    for ranks, k in ((4, 1), (1, 4)):
        _launch(tmp_path, ranks, k, "ring")
        for i, want in expect.items():
            with np.load(tmp_path / f"case{i}.out.ring.k{k}.npz") as f:
                got = [f[f"arr_{j}"] for j in range(len(want))]
            for g, w, r in zip(got, want, refs[i]):
                assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), (ranks, k, i)
                np.testing.assert_allclose(g, r, rtol=1e-5, atol=2e-6 * (float(np.abs(r).max()) + 1))
            head, rows = read_message_trace(tmp_path / f"case{i}.trace.ring.k{k}.jsonl")
            rep = replay(head, rows, "tpu-v4")
            assert rep.check.ok and rep.check.transfers[0] == len(rows) > 0, rep.check.to_json()
            assert rep.comm_s == pytest.approx(rep.analytical_comm_s, rel=1e-6)
