"""The numerics every run shares (partir_emu.runtime.kernels): one BLAS thread, and the matmul kernel."""
from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ArgumentError
from partir_emu.primitives import dot
from partir_emu.primitives.dot import KERNEL
from partir_emu.runtime.interpreter import eval_program
from partir_emu.runtime.local_mesh import LocalMesh


def _blas_threads() -> list[int]:
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


@pytest.fixture
def seen(monkeypatch):
    """What each dot_general of a run computed under: (BLAS threads, matmul kernel)."""
    got: list[tuple[list[int], str]] = []
    real = dot.matmul

    def spy(a, b):
        got.append((_blas_threads(), KERNEL.get()))
        return real(a, b)
    monkeypatch.setattr(dot, "matmul", spy)
    return got


@pytest.mark.parametrize("kernels", ["blas", "exact"])
def test_local_mesh_and_interpreter_compute_on_one_blas_thread(seen, kernels):
    """The MPI ranks run with one thread (the launcher sets OPENBLAS_NUM_THREADS=1); the in-process
    mesh and the interpreter pin the same, whatever the environment, so that OpenBLAS splits no
    product differently between them."""
    exp = Experiment("mlp", "bp", Mesh(batch=2))
    low = exp.lower()
    inputs = exp.inputs()
    LocalMesh(exp.mesh, kernels=kernels).run(low.spmd, inputs)
    eval_program(exp.program, inputs, kernels=kernels)
    assert seen and all(threads == [1] * len(threads) and kind == kernels for threads, kind in seen)
    assert KERNEL.get() == "blas"                      # restored after the run


def test_the_two_kernels_agree_to_rounding():
    exp = Experiment("mlp", "bp", Mesh(batch=2))
    inputs = exp.inputs()
    blas = eval_program(exp.program, inputs)
    exact = eval_program(exp.program, inputs, kernels="exact")
    # (whether they differ at all depends on the CPU: OpenBLAS's Prescott kernel sums in the exact
    # kernel's order, the AVX2/AVX-512 ones do not; either way they agree to rounding)
    for a, b in zip(blas, exact):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_unknown_kernels_are_a_clear_error():
    with pytest.raises(ArgumentError, match="'fast'.*'blas', 'exact'"):
        LocalMesh(Mesh(batch=2), kernels="fast")
