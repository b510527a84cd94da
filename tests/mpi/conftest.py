"""Shared helpers of the MPI tier: each test launches ``mpiexec`` subprocesses (2–16 ranks)
with a hard timeout. Lowered programs and jax.jit references are computed once per session."""
from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import lowered, wall  # noqa: F401  (lowered: re-exported, the MPI tests' name for it)

MPIEXEC = Path(sys.executable).parent / "mpiexec"

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:      # the ``mpi`` marker: tests/conftest.py, by folder
            if not MPIEXEC.exists():
                item.add_marker(pytest.mark.skip(reason=f"no mpiexec at {MPIEXEC}; pip install mpich mpi4py"))


def _hwloc_now() -> set[str]:
    return {str(p) for p in Path("/tmp").glob("hydra_hwloc_xmlfile_*")}


def _held() -> set[str]:
    from partir_emu.mpi.procs.supervise import hwloc_files
    return hwloc_files(int(d) for d in os.listdir("/proc") if d.isdigit())


@pytest.fixture(autouse=True)
def no_hwloc_file_left():
    """Every MPI test: no /tmp/hydra_hwloc_xmlfile_* left that no process holds (hydra's proxy
    writes one per job and removes it only when it ends normally; one killed after a rank failure
    or a stop left it for good). Another worker's job may hold or remove its own meanwhile: only
    new files that nobody holds and that are still there a moment later count."""
    before = _hwloc_now()
    yield
    new = _hwloc_now() - before
    # A proxy closes its file before it unlinks it, and another worker's job may be ending (or being
    # cleaned up by its own launcher) just now: on a loaded machine that takes seconds (a CI run saw
    # a file there 0.5 s later that was gone after). Only a file unheld all along the wait counts.
    end = time.monotonic() + wall(5)
    left = set(new)
    while left and time.monotonic() < end:
        time.sleep(0.25)
        left = {f for f in left if os.path.exists(f)} - _held()
    assert not left, f"hydra hwloc files left in /tmp (by this test or one beside it): {sorted(left)}"


@functools.cache
def reference(scenario: str, overrides: str | None = None) -> tuple[np.ndarray, ...]:
    """jax.jit of the scenario's step on its seed-0 inputs (independent of mesh and strategy)."""
    from partir_emu.app.experiment import Experiment
    from partir_emu.core.mesh import Mesh
    return tuple(Experiment(scenario, "bp", Mesh(batch=1), None, overrides).reference())


@functools.cache
def verdict_references(scenario: str, overrides: str | None = None) -> tuple:
    """The seed-0 inputs of a scenario and the verdict's references for them (jax.jit, float64, other
    summation orders): what ``partir-emu run`` judges by, on any BLAS kernel (issue 20)."""
    from partir_emu.app.experiment import Experiment
    from partir_emu.core.mesh import Mesh
    exp = Experiment(scenario, "bp", Mesh(batch=1), None, overrides)
    inputs = exp.inputs()
    return inputs, exp.references(inputs)


def run_worker(worker: Path, ranks: int, k: int, placement: str, timeout_s: int, *extra: str) -> dict:
    """``mpiexec -n ranks python worker --k k --placement placement`` with MPICH's own timeout below
    ours; the JSON line rank 0 printed last (a failed launch fails the test with its output)."""
    import json
    import subprocess
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(timeout_s))
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, str(worker), "--k", str(k), "--placement", placement,
           *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s + 30)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm")}


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
