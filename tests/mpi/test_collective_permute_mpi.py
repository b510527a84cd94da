"""collective_permute over real MPI: bit-identical to LocalMesh, with 1 and 2 devices per rank;
the traced messages are the schedule's and replay on the DES at the analytical price.

One test, few launches (each ``mpiexec -n R`` with R <= 4 and a hard timeout): hand-built
programs (shifts with and without wraparound, arbitrary pairs, 1-D and 2-D meshes, one and two
axes) are saved to files, run by ``_permute_worker.py`` and compared with the in-process mesh.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.core.msgtrace import read_message_trace
from partir_emu.hwmodels.validation.replay import replay
from partir_emu.runtime.local_mesh import LocalMesh
from tests.unit.test_collective_permute import permute_program

WORKER = Path(__file__).with_name("_permute_worker.py")
MPIEXEC = Path(sys.executable).parent / "mpiexec"

CASES = [
    (Mesh(x=4), ("x",), {"shift": 1, "wrap": False}),
    (Mesh(x=4), ("x",), {"shift": -1, "wrap": True}),
    (Mesh(x=4), ("x",), {"pairs": ((0, 2), (2, 1), (3, 3))}),
    (Mesh(x=2, y=2), ("y",), {"shift": 1, "wrap": True}),
    (Mesh(x=2, y=2), ("x",), {"shift": -1, "wrap": False}),
    (Mesh(x=2, y=2), ("y", "x"), {"pairs": ((0, 3), (3, 0), (1, 2))}),
]


def _launch(work: Path, ranks: int, k: int, algorithm: str) -> None:
    env = dict(os.environ, MPIEXEC_TIMEOUT="60")
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, str(WORKER), str(work), str(k), algorithm]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
def test_permute_over_mpi_equals_local_mesh(tmp_path):
    rng = np.random.default_rng(0)
    expect = {}
    for i, (mesh, axes, params) in enumerate(CASES):
        spmd = permute_program(mesh, axes, n=5, m=3, **params)
        g = rng.standard_normal(spmd.global_in_shapes[0]).astype(np.float32)
        spmd.save(tmp_path / f"case{i}.json")
        np.savez(tmp_path / f"case{i}.in.npz", **{spmd.input_names[0]: g})
        expect[i] = LocalMesh(mesh).run(spmd, [g]).outputs[0]
    runs = [(4, 1, "ring"), (2, 2, "ring"), (2, 2, "native")]
    for ranks, k, algorithm in runs:
        _launch(tmp_path, ranks, k, algorithm)
        for i in expect:
            with np.load(tmp_path / f"case{i}.out.{algorithm}.k{k}.npz") as f:
                got = f["arr_0"]
            assert got.dtype == expect[i].dtype and got.shape == expect[i].shape
            assert got.tobytes() == expect[i].tobytes(), (ranks, k, algorithm, CASES[i])
            if algorithm != "native":
                head, rows = read_message_trace(tmp_path / f"case{i}.trace.{algorithm}.k{k}.jsonl")
                rep = replay(head, rows, "tpu-v4")
                assert rep.check.ok and rep.check.transfers[0] == len(rows) > 0, rep.check.to_json()
                assert rep.comm_s == pytest.approx(rep.analytical_comm_s, rel=1e-9)
