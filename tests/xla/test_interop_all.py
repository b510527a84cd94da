"""Every scenario × every strategy: the ``to_jax()`` shardings, compiled and run by XLA, give our numbers.

The cases are enumerated from the scenario registry, never listed by hand:

- every strategy of every scenario once, on ``batch=2,model=2`` where each part of a strategy
  has an axis to act on (data parallelism and ZeRO on ``batch``; Megatron, embedding and
  multi-query sharding and auto on ``model``), or for those that tile image rows (the U-Net's
  ``spatial``) ``spatial=4``, or ``batch=2,spatial=2`` with data parallelism (see ``MESHES``);
- each scenario's most complete strategy that mixes a data part with a model part again on
  ``pod=2,batch=2,model=2``: two data axes, so a batch dim (and a ZeRO dim) is tiled by
  ``("pod", "batch")``, major→minor;
- transformer options (``--set``) that change the program: bfloat16 compute, multi-query
  attention (``kv_heads=1``: keys and values replicated on ``model``), the flash-attention core,
  PaLM's parallel block and the layers as one loop (``layers_as=loop``: a ``scan``), each with
  one of the transformer's mixing strategies, most complete first, on the 3-axis mesh.

Each case is lowered here and in the child (:mod:`partir_emu.app.xla.child`), which compiles
``jax.jit(step, in_shardings, out_shardings)`` with XLA on 8 fake CPU devices (a 4-device mesh
takes the first 4) and runs it and our LocalMesh on the same inputs. The numbers must agree
elementwise (rtol 1e-5, atol 1e-6), or where rounding is amplified (Adam's update of a
near-zero gradient, bfloat16 compute) within the verdict's normwise bound, with both runs
verified against float64; and the compiled executable and the arrays it returns must carry
exactly the exported shardings. Each chunk of up to ``CHUNK`` cases of one scenario has its own
child process, in its own xdist group, with its own timeout.
"""
from __future__ import annotations

import functools
import json
import re

import numpy as np
import pytest

import partir_emu as pe
from partir_emu.api import lower_program
from partir_emu.app.cli import main as cli
from partir_emu.app.experiment import ATOL, RTOL, Experiment
from partir_emu.app.xla.child import compare_outputs
from partir_emu.app.xla.compare import FAST_COMPILE, run_child
from partir_emu.core.mesh import Mesh
from partir_emu.interop import partition_specs
from partir_emu.runtime.verdict import References
from scenarios import get_scenario, list_scenarios
from scenarios.common import STATE_OUTPUTS
from tests.extended import extended

# the meshes of the every-strategy run, in order of preference: a strategy runs on the first that has
# every axis it needs. The U-Net's ``spatial`` alone gets ``spatial=4``: on ``batch=2,spatial=2`` (batch
# idle) XLA itself is wrong: jax 0.10.2's CPU SPMD partitioner returns every 3x3 conv kernel gradient
# multiplied by the idle axis's size (2x; 4x on batch=4,spatial=2), while our run matches jax.jit
# unpartitioned; jax.jit(grad(conv loss), in_shardings=(P(), P(None, "spatial"))) on a
# (batch=2, spatial=2) mesh reproduces it in 8 lines.
MESHES = ("batch=2,model=2", "spatial=4", "batch=2,spatial=2")
MESH3 = "pod=2,batch=2,model=2"
DEVICES = 8
pytestmark = pytest.mark.xla
CHUNK = 6               # cases per XLA child (see _chunks)
CHILD_TIMEOUT_S = 900   # one child on a loaded 2-core machine (a quiet one takes 20-60 s)
VARIANTS = ("precision=bf16", "kv_heads=1", "attention=flash", "block=parallel", "layers_as=loop")
DATA_PARTS = {"bp", "z2", "z3", "edge", "node"}   # gns shards edges/nodes on the data axes; other parts act on model


def _parts(strategy: str) -> set[str]:
    return set(strategy.split("+"))


def _mixes_data_and_model(strategy: str) -> bool:
    return bool(_parts(strategy) & DATA_PARTS) and bool(_parts(strategy) - DATA_PARTS)


def _fits(scenario: str, strategy: str, mesh: str) -> bool:
    """Whether ``strategy`` builds on ``mesh`` (at the default size): every axis it needs is there."""
    return get_scenario(scenario).carries(strategy, Mesh.parse(mesh))


def _most_complete_first(strategies: list[str]) -> list[str]:
    """The strategies that mix parts, most parts first (ZeRO-3 before ZeRO-2), auto (a search: the
    slowest to lower) last."""
    mixed = sorted((st for st in strategies if _mixes_data_and_model(st)), reverse=True)
    return sorted(mixed, key=lambda st: (-len(_parts(st)), "auto" in _parts(st)))


def _cases() -> list[tuple[str, str, str, str | None]]:
    """``(scenario, strategy, mesh, overrides)`` for every case (see the module docstring)."""
    cases = []
    for name in list_scenarios():
        strategies = list(get_scenario(name).strategies)
        # a strategy no candidate mesh carries goes to the first: the child's error names the axis it lacks
        cases += [(name, st, next((m for m in MESHES if _fits(name, st, m)), MESHES[0]), None) for st in strategies]
        three = [st for st in _most_complete_first(strategies) if _fits(name, st, MESH3)]
        if name != "transformer" and three:      # the transformer's go to the 3-axis mesh with its options
            cases.append((name, three[0], MESH3, None))
    mixed = _most_complete_first(list(get_scenario("transformer").strategies))
    cases += [("transformer", mixed[k % len(mixed)], MESH3, ov) for k, ov in enumerate(VARIANTS)]
    return cases


CASES = _cases()


def _id(case: tuple) -> str:
    sc, st, mesh, ov = case
    return f"{sc}-{st}-{mesh.replace('=2', '').replace(',', '.')}" + (f"-{ov}" if ov else "")


def _chunks(cases: list[tuple]) -> dict[tuple, str]:
    """Each case's chunk: the cases of one scenario, at most ``CHUNK`` to a chunk. One child process
    answers a chunk (it traces each configuration once), so a child that is slow or dies fails its
    own chunk's cases, not the module's."""
    by_scenario: dict[tuple[str, bool], list[tuple]] = {}
    for c in cases:   # the cases make test-all adds (tests/extended.py) in chunks of their own: the gate's
        big = extended(f"tests/xla/test_interop_all.py::test_xla_runs_the_exported_shardings_to_our_numbers[{_id(c)}]")
        by_scenario.setdefault((c[0], big), []).append(c)   # children never answer a case the gate skips
    out = {}
    for (name, big), group in by_scenario.items():
        for k in range(0, len(group), CHUNK):
            out.update(dict.fromkeys(group[k:k + CHUNK], f"xla-{name}{'-extended' if big else ''}-{k // CHUNK}"))
    return out


CHUNK_OF = _chunks(CASES)


@functools.cache
def _chunk_answers(chunk: str) -> dict | Exception:
    """The child's answer per case of ``chunk`` (or the error that stopped the child, kept so that the
    chunk's other cases report it without running the child again)."""
    mine = [c for c in CASES if CHUNK_OF[c] == chunk]
    reqs = [{"scenario": sc, "strategy": st, "mesh": mesh, "overrides": ov, "seed": 0, "run": True}
            for sc, st, mesh, ov in mine]
    try:
        return dict(zip(mine, run_child(reqs, DEVICES, timeout=CHILD_TIMEOUT_S, xla_flags=FAST_COMPILE)))
    except Exception as exc:          # noqa: BLE001  (reported by each case of the chunk)
        return exc


def _answer(case: tuple) -> dict:
    got = _chunk_answers(CHUNK_OF[case])
    if isinstance(got, Exception):
        raise got
    return got[case]


def _grouped(cases: list[tuple]) -> list:
    """The cases as parameters, each in its chunk's xdist group (one worker runs a chunk's child)."""
    return [pytest.param(c, id=_id(c), marks=pytest.mark.xdist_group(CHUNK_OF[c])) for c in cases]


def test_every_strategy_of_every_scenario_is_covered():
    """The registry decides the cases: each scenario's every strategy runs once on a 2-axis mesh that
    carries it, each scenario that mixes parts also on the 3-axis mesh, each transformer option once."""
    for name in list_scenarios():
        strategies = get_scenario(name).strategies
        assert sorted(st for sc, st, m, ov in CASES if sc == name and m != MESH3 and ov is None) == sorted(strategies)
        if any(_mixes_data_and_model(st) and _fits(name, st, MESH3) for st in strategies):
            assert any(sc == name and m == MESH3 for sc, _, m, _ in CASES)
    assert sorted(ov for *_, ov in CASES if ov) == sorted(VARIANTS)


@pytest.mark.parametrize("case", _grouped(CASES))
def test_xla_runs_the_exported_shardings_to_our_numbers(case):
    ans = _answer(case)
    assert "error" not in ans, ans.get("error")
    failing = {k: v for k, v in ans["diffs"].items() if v["worst_ratio"] > 1}
    assert ans["verified"], (ans["criterion"], ans.get("normwise"), ans.get("xla_verdict"), failing)
    if ans["criterion"] == "normwise":       # rounding was amplified: both runs must also verify vs float64
        assert ans["xla_verified"] and ans["ours_verified"], (ans["xla_verdict"], ans["ours_verdict"])
    assert ans["layout_ok"], ans["layout_mismatches"]
    # the strategy was exported as a strategy: its axes show up in the specs it tiles
    parts, specs = _parts(case[1]), " ".join(ans["in_specs"].values())
    if parts & DATA_PARTS:
        assert "'batch'" in specs
    if parts - DATA_PARTS - {"auto"}:       # auto may find that the model axis does not pay
        assert set(re.findall(r"'(\w+)'", specs)) - {"batch", "pod"}      # model, spatial, ...
    if case[2] == MESH3 and parts & DATA_PARTS:
        assert "('pod', 'batch'" in specs          # pod major, batch minor (then maybe model)


@pytest.mark.parametrize("case", _grouped([c for c in CASES if c[3] == "precision=bf16"]))
def test_bf16_is_judged_normwise(case):
    """The normwise path runs end to end: bfloat16 compute rounds at 2^-8, far above the elementwise
    tolerance, so the bf16 cases reach it (and passed it, above)."""
    assert _answer(case).get("criterion") == "normwise"


@pytest.mark.parametrize("case", [c for c in CASES if c[3] == "layers_as=loop" or "emb+" in c[1] and c[2] == MESH3],
                         ids=_id)
def test_exported_specs_round_trip_through_from_partition_specs(case):
    """specs -> ``from_partition_specs`` schedule -> lowered -> the same in and out specs, on the
    3-axis mesh for what tests/xla/test_interop.py does not reach: loops and embedding sharding."""
    sc, st, mesh, ov = case
    exp = Experiment(sc, st, Mesh.parse(mesh), None, ov)
    ins, outs = partition_specs(exp.lower())
    sched = pe.from_partition_specs(ins, exp.mesh, args=exp.scenario.abstract_inputs(exp.cfg), fn=exp.make_step())
    assert partition_specs(lower_program(exp.program, exp.mesh, sched, STATE_OUTPUTS)) == (ins, outs)


@functools.cache
def _mlp_references() -> tuple[Experiment, References]:
    exp = Experiment("mlp", "bp", Mesh(batch=1))
    return exp, exp.references(exp.inputs())


@pytest.mark.parametrize("change,criterion,verified", [
    (None, "elementwise", True),
    ("the element correct runs move most, moved as one of them moves it", "normwise", True),   # a flip
    ("the largest weight element off by 1e-3 of its value", "normwise", False),
    ("loss off by 1e-3", "normwise", False),
    ("a weight halved", "normwise", False),
    ("an output missing", "shape", False),
])
def test_the_comparison_passes_rounding_and_fails_wrong_numbers(change, criterion, verified):
    """The child's criterion on real step outputs (the MLP's, from jax.jit in this process, standing
    in for ours) and changed copies standing in for XLA's."""
    exp, refs = _mlp_references()
    ours = [np.asarray(x) for x in refs.jit]
    res = [x.copy() for x in ours]
    w = max(range(len(res)), key=lambda i: res[i].size)          # the largest new weight
    j = int(np.argmax(np.abs(res[w])))
    if change and change.startswith("the element correct runs move"):
        # where rounding alone moves an element by more than the elementwise tolerance (Adam on a
        # gradient within rounding of zero), XLA may land where another correct order lands
        moved = [(float((np.abs(o[i].astype(np.float64) - refs.ref64[i]) / (ATOL + RTOL * np.abs(refs.ref64[i]))).max()),
                  i, k) for k, o in enumerate(refs.others) for i in range(len(ours)) if ours[i].dtype.kind == "f"]
        ratio, i, k = max(moved)
        assert ratio > 2, f"no element of the MLP step moves beyond the elementwise tolerance in other orders ({ratio})"
        e = int(np.argmax(np.abs(refs.others[k][i].astype(np.float64) - refs.ref64[i])))
        res[i].flat[e] = refs.others[k][i].flat[e]
    elif change == "the largest weight element off by 1e-3 of its value":
        res[w].flat[j] *= np.float32(1.001)
    elif change == "loss off by 1e-3":
        res[0] = res[0] * np.float32(1.001)
    elif change == "a weight halved":
        res[w] = res[w] * np.float32(0.5)
    elif change == "an output missing":
        res = res[:-1]
    names = [str(i) for i in range(len(ours))]
    got = compare_outputs(names, ours, res, lambda: refs, exp.program)
    assert (got["criterion"], got["verified"]) == (criterion, verified), got.get("normwise")


def test_compare_xla_all_strategies_in_one_child(tmp_path, capsys, monkeypatch):
    """``--strategy all``: one child process, one table per strategy, a strategy the mesh cannot
    carry is listed as skipped."""
    calls = []
    real = run_child

    def counting(cases, *a, **k):
        calls.append(len(cases))
        return real(cases, *a, **k)

    monkeypatch.setattr("partir_emu.app.xla.compare.run_child", counting)
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE)
    rep_path = tmp_path / "all.json"
    rc = cli.main(["compare-xla", "mlp", "--strategy", "all", "--mesh", "batch=4", "--quiet", "--run",
                   "--report", str(rep_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    strategies = get_scenario("mlp").strategies
    runnable = [st for st in strategies if _parts(st) <= DATA_PARTS]     # batch=4 has no model axis
    assert calls == [len(runnable)]
    rep = json.loads(rep_path.read_text())
    assert [r["strategy"] for r in rep["strategies"]] == runnable
    assert set(rep["skipped"]) == set(strategies) - set(runnable)
    assert all("model" in why for why in rep["skipped"].values())
    for st in runnable:
        assert f"mlp / {st} on 4 devices" in out
    assert all(r["outputs"]["verified"] and r["outputs"]["layout_ok"] for r in rep["strategies"])
    assert f"{len(runnable)} of {len(runnable)} strategies: XLA gives our numbers and keeps the exported" in out
