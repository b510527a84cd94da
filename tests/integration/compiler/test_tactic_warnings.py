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


def _attention_step(fused: bool):
    """GPT-2's attention (HF Conv1D layout, q|k|v fused in one [d, 3d] weight) or the same with
    separate q, k, v weights; Megatron tiles the projections' output dim and c_proj's input dim."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    h, d = 4, 16

    def heads(t):
        return t.reshape(t.shape[0], t.shape[1], h, d // h).transpose(0, 2, 1, 3)

    def loss(p, x):
        if fused:
            q, k, v = map(heads, jnp.split(x @ p["c_attn"]["w"] + p["c_attn"]["b"], 3, axis=-1))
        else:
            q, k, v = (heads(x @ p[n]) for n in ("q", "k", "v"))
        s = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2), axis=-1)
        return ((s @ v).transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], d) @ p["c_proj"]).sum()

    w = np.random.default_rng(0).standard_normal
    p = ({"c_attn": {"w": w((d, 3 * d)).astype(np.float32), "b": np.zeros(3 * d, np.float32)}} if fused else
         {n: w((d, d)).astype(np.float32) for n in "qkv"})
    p["c_proj"] = w((d, d)).astype(np.float32)
    mp = {"p/c_attn/w": 1, "p/c_attn/b": 0} if fused else {"p/q": 1, "p/k": 1, "p/v": 1}
    return (lambda p, x: jax.value_and_grad(loss)(p, x)), (p, np.ones((2, 8, d), np.float32)), mp


def test_a_fused_qkv_projection_is_named_as_the_cause_not_the_tactic():
    """The fused projection's tiling cannot carry over to q, k, v: the warning says so (and that
    splitting the tactic would not help: split, it warns the same and gathers the same), and the
    separate-weights form it recommends lowers with neither warning nor gather."""
    import partir_emu as pe
    step, args, mp = _attention_step(fused=True)
    gathers = []
    for schedule in ([pe.ManualPartition({**mp, "p/c_proj": 0}, axis="model")],
                     [pe.ManualPartition(mp, axis="model"), pe.ManualPartition({"p/c_proj": 0}, axis="model")]):
        with pytest.warns(pe.PartitionWarning, match=r"fused q\|k\|v projection .* splitting the tactic would not"):
            low = pe.jit(step, mesh=pe.Mesh(model=2), schedule=schedule).lower(*args)
        assert " concatenate " in low.warnings[0] and "split the tactic, one per intent" not in low.warnings[0]
        gathers.append(sum(e.prim == "all_gather" for e in low.spmd.collectives()))
    assert gathers[0] == gathers[1] > 0
    step, args, mp = _attention_step(fused=False)
    low = pe.jit(step, mesh=pe.Mesh(model=2), schedule=[pe.ManualPartition({**mp, "p/c_proj": 0}, axis="model")]
                 ).lower(*args)
    assert low.warnings == []
    assert not any(e.prim == "all_gather" for e in low.spmd.collectives())
