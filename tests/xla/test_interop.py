"""JAX interop: ``to_jax`` shardings compiled by XLA, ``from_partition_specs``, ``compare-xla``.

XLA needs as many devices as the mesh, and jax fixes its CPU device count when its backend
starts, so every XLA compile runs in a child process (:mod:`partir_emu.app.xla.child`): one
child for every scenario × strategy, one for the CLI. This process keeps its single device.
"""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import partir_emu as pe
from partir_emu.api import lower_program
from partir_emu.app.cli import main as cli
from partir_emu.app.xla.compare import FAST_COMPILE, normalise, run_child, table
from partir_emu.app.xla.hlo import collectives
from partir_emu.core.sharding import Sharding
from partir_emu.errors import ArgumentError, MeshError, ShardingError
from partir_emu.interop import jax_mesh, partition_spec, partition_specs
from scenarios import get_scenario
from scenarios.common import STATE_OUTPUTS

MESH = "batch=2,model=2"
pytestmark = pytest.mark.xla


@functools.cache
def _traced(scenario: str):
    """(scenario, tiny config, traced step) without running anything (no reference needed here)."""
    s = get_scenario(scenario)
    cfg = s.config("tiny")
    return s, cfg, pe.trace(s.make_step(cfg), *s.abstract_inputs(cfg))


def _specs(scenario: str, strategy: str, mesh: pe.Mesh):
    s, cfg, prog = _traced(scenario)
    return partition_specs(lower_program(prog, mesh, s.strategy(strategy, mesh, cfg), STATE_OUTPUTS))


NORMALISED = [("mlp", "bp"), ("mlp", "bp+mp"), ("mlp", "bp+mp+z2"), ("transformer", "bp"), ("transformer", "bp+auto")]


@pytest.fixture(scope="module")
def xla_answers() -> dict:
    """The cases below compiled by XLA on 4 fake CPU devices, in one child process (their numbers and
    shardings, for every scenario x strategy, are tests/xla/test_interop_all.py's)."""
    cases = [{"scenario": sc, "strategy": st, "mesh": MESH, "size": "tiny", "run": False} for sc, st in NORMALISED]
    return dict(zip(NORMALISED, run_child(cases, 4, timeout=300, xla_flags=FAST_COMPILE)))


@pytest.mark.parametrize("scenario,strategy", [pytest.param(*c, marks=pytest.mark.xdist_group("xla-normalised"))
                                               for c in NORMALISED])
def test_reductions_agree_after_normalising(xla_answers, scenario, strategy):
    """Data parallelism (and Megatron on the MLP): both programs reduce the same tensors over the
    same axes. XLA's CPU backend writes them as a few combined tuple all-reduces, so the raw
    instruction counts differ; per tensor they agree in count and bytes. The exported specs are
    the ones this process computes for the same lowering."""
    ans = xla_answers[(scenario, strategy)]
    assert "error" not in ans, ans.get("error")
    ours, xla = normalise(ans["ours"]), normalise(ans["xla"])
    assert ours["reduction"] == xla["reduction"]
    assert len(ans["xla"]) < len(ans["ours"])          # XLA did combine: the normalisation was needed
    assert all(r["same"] for r in table(ours, xla))
    ins, outs = _specs(scenario, strategy, pe.Mesh.parse(MESH))
    assert ans["in_specs"] == {n: str(v) for n, v in ins.items()}
    assert ans["out_specs"] == {n: str(v) for n, v in outs.items()}


def test_compare_xla_cli_prints_both_sides(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE)
    rep_path = tmp_path / "cmp.json"
    rc = cli.main(["compare-xla", "mlp", "--strategy", "bp+mp", "--mesh", MESH, "--quiet", "--run",
                   "--report", str(rep_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "partir-emu" in out and "XLA" in out and "2 of 2 rows agree" in out
    rep = json.loads(rep_path.read_text())
    rows = {(r["family"], r["axes"]): r for r in rep["normalised"]}
    assert set(rows) == {("reduction", "batch"), ("reduction", "model")}
    assert all(r["same"] and r["ours"]["count"] > 0 for r in rows.values())
    assert rep["raw"]["xla"]["all-reduce"]["instructions"] < rep["raw"]["ours"]["all-reduce"]["instructions"]
    assert rep["outputs"]["verified"] and rep["outputs"]["layout_ok"]


def test_compare_xla_bad_strategy_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setattr("partir_emu.app.xla.compare.run_child", lambda *a, **k: pytest.fail("child started"))
    assert cli.main(["compare-xla", "mlp", "--strategy", "nope", "--mesh", MESH]) == 2
    err = capsys.readouterr().err.strip()
    assert "nope" in err and len(err.splitlines()) == 1


# -- to_jax in this process (one device: a mesh of size 1) ------------------------------------------

def test_to_jax_is_one_line_for_jax_jit():
    def step(params, x):
        h = jnp.tanh(x @ params["w1"])
        return jnp.mean((h @ params["w2"]) ** 2), {"w1": params["w1"] * 2, "w2": params["w2"]}

    mesh = pe.Mesh(batch=1, model=1)
    sched = [pe.ManualPartition({"x": 0}, axis="batch"), pe.ManualPartition({"params/w1": 1}, axis="model")]
    params = {"w1": np.ones((4, 8), np.float32), "w2": np.ones((8, 2), np.float32)}
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    sh = pe.jit(step, mesh=mesh, schedule=sched).lower(params, x).to_jax()
    assert sh.in_shardings[0]["w1"].spec == P(None, "model")
    assert sh.in_shardings[1].spec == P("batch", None)
    assert sh.out_shardings[1]["w1"].spec == P(None, "model")
    assert dict(sh.mesh.shape) == {"batch": 1, "model": 1}
    got = jax.jit(step, in_shardings=sh.in_shardings, out_shardings=sh.out_shardings)(params, x)
    want = jax.jit(step)(params, x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_multi_axis_dims_keep_their_major_to_minor_order():
    assert partition_spec(Sharding((("pod", "batch"), (), ("model",)))) == P(("pod", "batch"), None, "model")
    assert partition_spec(Sharding((("model", "batch"),))) == P(("model", "batch"))


def test_partial_values_have_no_partition_spec():
    with pytest.raises(ShardingError, match="pending sum over.*model"):
        partition_spec(Sharding(((), ()), partial=("model",)), "output 'y'")


def test_too_few_devices_is_a_mesh_error():
    with pytest.raises(MeshError, match="needs 4 jax devices.*jax_num_cpu_devices"):
        jax_mesh(pe.Mesh(batch=2, model=2), jax.devices()[:1])


# -- from_partition_specs --------------------------------------------------------------------------

@pytest.mark.parametrize("scenario,strategy,mesh", [("mlp", "bp+mp+z3", MESH), ("transformer", "bp+mp+z3", MESH),
                                                    ("transformer", "bp+mp+z3", "pod=2,batch=2,model=2"),
                                                    ("mlp", "z2", "pod=2,batch=2,model=2")])
def test_partition_specs_round_trip(scenario, strategy, mesh):
    """specs -> schedule -> lowered -> specs, in both spellings (by name, and jax.jit's per-argument
    pytree). The 3-axis meshes tile dims by ("pod", "batch")."""
    s, cfg, prog = _traced(scenario)
    m = pe.Mesh.parse(mesh)
    specs, _ = _specs(scenario, strategy, m)
    args = s.abstract_inputs(cfg)
    step = s.make_step(cfg)
    tree = jax.tree_util.tree_structure(args)
    for given in (specs, jax.tree_util.tree_unflatten(tree, list(specs.values()))):
        sched = pe.from_partition_specs(given, m, args=args, fn=step)
        assert sorted(t.axis for t in sched) == sorted(m.axis_names)     # one tactic per axis
        again, _ = partition_specs(lower_program(prog, m, sched, STATE_OUTPUTS))
        assert again == specs
    if "pod" in m.axis_names:
        assert any(v == P(("pod", "batch")) for v in specs.values())


def _toy():
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w))
    args = (jax.ShapeDtypeStruct((8, 4), np.float32), jax.ShapeDtypeStruct((6, 8), np.float32))
    return f, args


def test_from_partition_specs_orders_tactics_for_reversed_axes():
    f, args = _toy()
    mesh = pe.Mesh(batch=2, model=2)
    sched = pe.from_partition_specs({"w": P(("model", "batch")), "x": P()}, mesh)
    assert [t.axis for t in sched] == ["model", "batch"]
    low = lower_program(pe.trace(f, *args), mesh, sched)
    assert partition_specs(low)[0] == {"w": P(("model", "batch"), None), "x": P(None, None)}


def test_from_partition_specs_prefix_and_none():
    f, args = _toy()
    mesh = pe.Mesh(batch=2, model=2)
    sched = pe.from_partition_specs((None, P("batch")), mesh, args=args, fn=f)
    assert [dict(t.inputs) for t in sched] == [{"x": 0}, {"x": pe.REPLICATED}]


@pytest.mark.parametrize("specs,kw,match", [
    ({"w": P("data")}, {}, r"pattern 'w'.*axis 'data'.*not in Mesh"),
    ({"w": P("batch", "batch")}, {}, r"pattern 'w'.*axis 'batch' twice"),
    ({"x": P("batch", None, None)}, {"args": True}, r"pattern 'x'.*3 entries.*'x' has rank 2"),
    ({"x": P(None, "model"), "w": P("model")}, {"args": True}, None),
    ({"w": P(("batch", "model")), "x": P(("model", "batch"))}, {}, r"contradictory orders"),
    ({"x": P("batch", "model")}, {"args": True, "mesh": pe.Mesh(batch=4, model=2)}, r"dim 0 of input 'x' \(size 6\)"),
])
def test_from_partition_specs_bad_specs(specs, kw, match):
    f, args = _toy()
    mesh = kw.get("mesh", pe.Mesh(batch=2, model=2))
    call = lambda: pe.from_partition_specs(specs, mesh, **({"args": args, "fn": f} if kw.get("args") else {}))
    if match is None:
        assert len(call()) == 2
        return
    with pytest.raises(ShardingError, match=match):
        call()


def test_from_partition_specs_needs_names_for_a_tuple():
    with pytest.raises(ArgumentError, match="fn= .*or arg_names="):
        pe.from_partition_specs((P(), P("batch")), pe.Mesh(batch=2))


# -- HLO text --------------------------------------------------------------------------------------

HLO = """
  %ar = (f32[], f32[4,8]{1,0}) all-reduce(%a, %b), channel_id=1, replica_groups={{0,2},{1,3}}, to_apply=%add
  %ag = f32[8,16]{1,0} all-gather(%c), channel_id=2, replica_groups=[2,2]<=[4], dimensions={0}
  %rs = bf16[2,16]{1,0} reduce-scatter(%d), channel_id=3, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}
  %a2a = (f32[1,4]{1,0}, f32[1,4]{1,0}) all-to-all(%e, %f), channel_id=4, replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}
  %cp = f32[8]{0} collective-permute(%g), channel_id=5, source_target_pairs={{0,0},{1,2},{2,1},{3,3}}
  %ags = (f32[4]{0}, f32[8]{0}) all-gather-start(%h), channel_id=6, replica_groups=mesh['x'=4] {'x':(1)2}, dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
"""


def test_hlo_collectives_in_every_group_spelling():
    got = {c.name: c for c in collectives(HLO, pe.Mesh(batch=2, model=2))}
    assert set(got) == {"ar", "ag", "rs", "a2a", "cp", "ags"}
    assert (got["ar"].axes, got["ar"].tensors, got["ar"].bytes) == ("batch", 2, 4 + 128)
    assert (got["ag"].axes, got["ag"].bytes) == ("model", 512)
    assert (got["rs"].axes, got["rs"].bytes) == ("batch", 2 * 2 * 16 * 2)    # the input: 2 blocks
    assert (got["a2a"].axes, got["a2a"].tensors, got["a2a"].bytes) == ("batch", 1, 32)
    assert got["cp"].axes == "batch,model"
    # 'x':(1)2 on x=4 is the major half of x: devices {0,2}, {1,3}, which is the batch axis here
    assert (got["ags"].axes, got["ags"].bytes) == ("batch", 32)


@pytest.mark.parametrize("argv", ["--strategy bp --mesh model=2", "--mesh batch=0", "--timeout 0", "--hlo /",
                                  "--set batch=3", "--size full --run", "--mesh batch=2048"])
def test_compare_xla_refuses_bad_input_before_starting_xla(argv, capsys, monkeypatch):
    monkeypatch.setattr("partir_emu.app.xla.compare.run_child", lambda *a, **k: pytest.fail("child started"))
    assert cli.main(["compare-xla", "mlp", *argv.split()]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
