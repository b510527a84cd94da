"""Warnings for tactics whose own decisions conflict (issue 11): BP and ZeRO-3 written as one
``ManualPartition`` let propagation order tile activations' d_model by the batch axis; written as
two tactics (the ZeRO idiom) the conflicts are intended and nothing is said."""
from __future__ import annotations

import re

import pytest

from partir_emu.app.cli.main import main
from partir_emu.app.experiment import Experiment
from partir_emu.compiler import api as compiler_api
from partir_emu.compiler.api import partition_and_lower
from partir_emu.compiler.tactics import ManualPartition
from partir_emu.core.mesh import Mesh
from scenarios.common import STATE_OUTPUTS


@pytest.fixture(scope="module")
def z3():
    return Experiment("transformer", "z3", Mesh(batch=2), "tiny")


def test_bp_and_z3_as_two_tactics_give_no_warning(z3):
    low = z3.lower()
    assert [t.name for t in z3.schedule] == ["bp:batch", "z3:batch"]
    assert low.final_state.conflicts            # the intended ZeRO conflicts are still recorded ...
    assert not any(c.within_tactic for c in low.final_state.conflicts)
    assert low.warnings == []                    # ... but they are not warned about


def test_bp_and_z3_as_one_tactic_warn_with_counts(z3):
    merged: dict = {}
    for t in z3.schedule:
        merged.update(t.inputs)
    low = partition_and_lower(z3.program, z3.mesh, [ManualPartition(merged, axis="batch", name="bp+z3")], STATE_OUTPUTS)
    within = [c for c in low.final_state.conflicts if c.within_tactic]
    assert within
    kinds = {c.kind for c in within}
    assert len(low.warnings) == len(kinds)        # one line per kind of conflict
    counts = {}
    for line in low.warnings:
        assert "\n" not in line and line.startswith("tactic 'bp+z3' on axis 'batch': ")
        m = re.search(r": (\d+) conflict\(s\) between its own decisions \[([a-z-]+)\]", line)
        assert m, line
        counts[m.group(2)] = int(m.group(1))
        assert " e.g. " in line and " at [" in line     # an example: value, dim, where
    assert counts == {k: sum(c.kind == k for c in within) for k in kinds}
    # what the warning is about: activations got d_model tiled by the batch axis
    st = low.final_state
    acts = [o for e in st.program.eqns for o in e.outputs if o.ndim == 3 and o.shape[-1] == z3.cfg["d_model"]]
    assert any("batch" in st.value_dims[v][2] for v in acts)


@pytest.mark.slow
def test_the_cli_prints_warnings_to_stderr(capsys, monkeypatch):
    monkeypatch.setattr(compiler_api.Partitioned, "warnings", property(lambda self: ["tactic 'x': 3 conflict(s)"]))
    args = ["mlp", "--strategy", "z3", "--size", "tiny", "--mesh", "batch=2"]
    for cmd in (["show"], ["simulate", "--hardware", "tpu-v4"], ["run"]):
        main([*cmd, *args])
        out, err = capsys.readouterr()
        assert "warning: tactic 'x': 3 conflict(s)\n" in err, cmd
        assert "warning:" not in out


def _user_step():
    import jax
    import jax.numpy as jnp
    import numpy as np

    def step(params, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]))(params)
        return loss, {k: params[k] - 0.1 * g[k] for k in params}

    params = {"w1": np.ones((8, 8), np.float32), "w2": np.ones((8, 4), np.float32)}
    return step, (params, np.ones((8, 8), np.float32))


def test_pe_jit_warns_with_each_line_when_it_lowers():
    """In the Python API the lines are Python warnings (the CLI prints them): once per lowering."""
    import warnings

    import partir_emu as pe
    step, args = _user_step()
    one = pe.jit(step, mesh=pe.Mesh(batch=2), schedule=[
        pe.ManualPartition({"x": 0, "params/w1": 0, "params/w2": 0}, axis="batch", name="bp+z3")])
    with pytest.warns(pe.PartitionWarning, match=r"^tactic 'bp\+z3' on axis 'batch': \d+ conflict") as got:
        one(*args)
    assert [str(w.message) for w in got if w.category is pe.PartitionWarning] == one.lower(*args).warnings
    two = pe.jit(step, mesh=pe.Mesh(batch=2), schedule=[
        pe.ManualPartition({"x": 0}, axis="batch"), pe.ManualPartition({"params/*": 0}, axis="batch")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", pe.PartitionWarning)
        one(*args)          # lowered already: not warned again
        two(*args)          # the ZeRO idiom: intended conflicts, nothing to warn about
