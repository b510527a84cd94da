"""Every scenario × strategy × mesh: the in-process mesh equals the unpartitioned jax.jit."""
import numpy as np
import pytest

from partir_emu import Mesh
from partir_emu.api import lower_program
from partir_emu.app.experiment import verify
from partir_emu.runtime.local_mesh import LocalMesh
from scenarios.common import STATE_OUTPUTS

MESHES = ["batch=2,model=2", "batch=4,model=2", "pod=2,batch=2,model=2"]
STRATEGIES = ["bp", "mp", "z2", "z3", "bp+mp", "bp+mp+z3"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", ["mlp", "transformer"])
def test_matches_jax(case, scenario, strategy, mesh):
    s, cfg, prog, inputs, ref = case(scenario)
    m = Mesh.parse(mesh)
    low = lower_program(prog, m, s.strategy(strategy, m, cfg), STATE_OUTPUTS)
    res = LocalMesh(m, algorithm="ring").run(low.spmd, inputs)
    ver = verify(res.outputs, ref, low.spmd.output_names, rtol=1e-5, atol=1e-6)
    assert ver.verified, ver
    # the new state comes back laid out like the state it replaces
    ins = dict(zip(low.spmd.input_names, low.spmd.in_shardings))
    for name, sh in zip(low.spmd.output_names, low.spmd.out_shardings):
        head, _, rest = name.partition("/")
        if head in STATE_OUTPUTS:
            assert sh == ins[f"{STATE_OUTPUTS[head]}/{rest}"], name
    assert all(np.isfinite(o).all() for o in res.outputs)
