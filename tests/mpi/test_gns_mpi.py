"""The ``gns`` scenario over real MPI: ``edge``, ``node`` and ``bp`` on 4 devices, with one device per rank
(``mpiexec -n 4``) and four (``-n 1``): bit-identical to the in-process LocalMesh, within float32
rounding of jax.jit, and the message trace of ``edge`` replays on the DES.

One launch per layout, each with a hard timeout; the programs are lowered here (``tests/integration/test_gns.py``)
and run by the ranks' worker (which never imports jax).
"""
from __future__ import annotations

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.core.msgtrace import read_message_trace
from partir_emu.hwmodels.validation.replay import replay
from partir_emu.mpi.jobs import save_inputs
from partir_emu.mpi.launch import MpiRun
from partir_emu.runtime.local_mesh import LocalMesh
from tests.integration.test_gns import _case, _lowered
from tests.mpi.conftest import MPIEXEC, bit_equal

CASES = [("edge", "batch=4"), ("node", "batch=4"), ("bp", "batch=4")]


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
def test_gns_over_mpi_equals_local_mesh_and_jax(tmp_path):
    _, _, inputs, ref = _case()
    jobs, expect = {1: [], 4: []}, {}
    for i, (strategy, mesh) in enumerate(CASES):
        spmd = _lowered(strategy, mesh)
        prog, inp = tmp_path / f"case{i}.json", tmp_path / f"case{i}.in.npz"
        spmd.save(prog)
        save_inputs(inp, spmd.input_names, inputs)
        expect[i] = LocalMesh(Mesh.parse(mesh), "ring").run(spmd, inputs).outputs
        for k in jobs:
            jobs[k].append({"program": str(prog), "inputs": str(inp), "algorithm": "ring", "devices_per_rank": k,
                            "trace": str(tmp_path / f"case{i}.k{k}.trace.jsonl")})
    for k, ranks in ((1, 4), (4, 1)):
        work = tmp_path / f"k{k}"
        work.mkdir()
        results = MpiRun(jobs[k], ranks, timeout_s=120, workdir=work).start().wait()
        for i, res in enumerate(results):
            assert len(res["outputs"]) == len(expect[i]) == len(ref)
            for g, w, r in zip(res["outputs"], expect[i], ref):
                assert bit_equal(g, w), (k, CASES[i])
                np.testing.assert_allclose(g, r, rtol=1e-5, atol=2e-6 * (float(np.abs(r).max()) + 1))
            assert res["stats"]["jax_imported"] == [False] * ranks
        head, rows = read_message_trace(jobs[k][0]["trace"])
        rep = replay(head, rows, "tpu-v4")
        assert rep.check.ok and rep.check.transfers[0] == len(rows) > 0, rep.check.to_json()
