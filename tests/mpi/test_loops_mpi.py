"""SpmdPrograms with loops whose bodies hold collectives, over real MPI (the ranks' worker, as the
CLI launches it): bit-identical to the in-process LocalMesh with 1 and 2 devices per rank, the
same peak bytes, a message trace that numbers each iteration's collective and replays on the DES,
and a failure inside a body named by its loop, iteration and op.

Three launches (``mpiexec -n 4`` and ``-n 2``), each with a hard timeout; the programs are the
hand-built ones of ``tests/loop_programs.py``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from partir_emu.core.msgtrace import read_message_trace
from partir_emu.errors import EmulationError
from partir_emu.hwmodels.validation.replay import replay
from partir_emu.mpi.jobs import save_inputs
from partir_emu.mpi.launch import MpiRun
from partir_emu.runtime.local_mesh import LocalMesh
from tests.loop_programs import SPMD_PROGRAMS, global_inputs
from tests.mpi.conftest import MPIEXEC, bit_equal


def _jobs(tmp_path: Path, names: list[str], k: int, tag: str) -> tuple[list[dict], dict]:
    jobs, expect = [], {}
    for name in names:
        spmd = SPMD_PROGRAMS[name]()
        ins = global_inputs(spmd.global_in_shapes, seed=11)
        prog, inp = tmp_path / f"{name}.json", tmp_path / f"{name}.in.npz"
        spmd.save(prog)
        save_inputs(inp, spmd.input_names, ins)
        jobs.append({"program": str(prog), "inputs": str(inp), "algorithm": "ring", "devices_per_rank": k,
                     "trace": str(tmp_path / f"{name}.{tag}.trace.jsonl")})
        expect[name] = LocalMesh(spmd.mesh, "ring").run(spmd, ins)
    return jobs, expect


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
def test_loops_over_mpi_equal_local_mesh(tmp_path):
    for ranks, k, names in ((4, 1, ["layers_reverse", "nested"]), (2, 2, ["nested", "layers", "zero_length"])):
        work = tmp_path / f"r{ranks}k{k}"
        work.mkdir()
        jobs, expect = _jobs(work, names, k, f"r{ranks}")
        results = MpiRun(jobs, ranks, timeout_s=90, workdir=work).start().wait()
        for job, name, res in zip(jobs, names, results):
            want = expect[name]
            assert len(res["outputs"]) == len(want.outputs)
            for g, w in zip(res["outputs"], want.outputs):
                assert bit_equal(g, w), (ranks, k, name)
            assert res["stats"]["peak_bytes_per_device"] == want.peak_bytes_per_device, (ranks, k, name)
            head, rows = read_message_trace(job["trace"])
            spmd = SPMD_PROGRAMS[name]()
            assert len(head["collectives"]) == len(spmd.collectives())      # one per iteration
            if not len(rows):
                assert name == "zero_length"
                continue
            rep = replay(head, rows, "tpu-v4")
            assert rep.check.ok and rep.check.transfers[0] == len(rows), rep.check.to_json()


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
def test_failure_inside_a_loop_body_names_the_iteration(tmp_path):
    jobs, _ = _jobs(tmp_path, ["nested"], 1, "fault")
    run = MpiRun(jobs, 4, timeout_s=60, workdir=tmp_path, fault="rank:1:op:0:raise")
    with pytest.raises(EmulationError) as info:
        run.start().wait()
    msg = str(info.value)
    # the first collective: all_gather (op 1) of the layer body, inside the stage body's loop (op 0)
    assert ("partir-emu rank 1 device 1 op 1 of the loop body at op 0, iteration 0, of the loop body at op 0, "
            "iteration 0 (all_gather at loop_programs.py:1)") in msg, msg
