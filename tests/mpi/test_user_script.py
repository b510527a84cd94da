"""A user-written step on MPI (``pe.jit(..., backend="mpi")`` under ``mpiexec -n R python script.py``):
the README's example runs and verifies, only rank 0 imports jax, every rank gets the outputs
(or only rank 0, by option), and a mesh that does not fit the ranks is a clear error, not a hang."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.mpi.conftest import MPIEXEC

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_mpi.py"


def _mpiexec(n: int, script: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(int(timeout) - 10), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([str(MPIEXEC), "-n", str(n), sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_readme_example_verifies_and_every_rank_gets_the_outputs():
    out = _mpiexec(4, EXAMPLE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("verified: YES") == 3 and "verified: NO" not in out.stdout
    found = re.findall(r"rank (\d): 3 outputs, digest ([\d.]+), jax imported: (True|False)", out.stdout)
    ranks = {r: (d, j) for r, d, j in found}
    assert sorted(ranks) == ["0", "1", "2", "3"], out.stdout
    assert len({d for d, _ in ranks.values()}) == 1                      # the same outputs everywhere
    assert {r: j for r, (_, j) in ranks.items()} == {"0": "True", "1": "False", "2": "False", "3": "False"}


def test_outputs_to_rank_0_only(tmp_path):
    script = tmp_path / "root_only.py"
    script.write_text(
        "import numpy as np\nimport partir_emu.mpi as pmpi\n"
        "if pmpi.is_root():\n"
        "    import jax.numpy as jnp\n    import partir_emu as pe\n"
        "    f = pe.jit(lambda x: jnp.sum(x * x), mesh=pe.Mesh(batch=2), outputs='root',\n"
        "               schedule=[pe.ManualPartition({'x': 0}, axis='batch')], backend='mpi')\n"
        "    x = np.arange(8, dtype=np.float32)\n"
        "    print('rank 0 got', float(f(x)), float(f(x + 1)))\n"
        "else:\n"
        "    print('rank 1 got', pmpi.serve())\n")
    out = _mpiexec(2, script)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 got 140.0 204.0" in out.stdout and "rank 1 got [None, None]" in out.stdout


def test_a_mesh_that_does_not_fit_the_ranks_is_a_clear_error():
    out = _mpiexec(3, EXAMPLE, timeout=90)
    assert out.returncode != 0
    assert "has 8 devices but mpiexec started 3 ranks" in out.stderr and "use mpiexec -n 4" in out.stderr
