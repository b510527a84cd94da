"""The validation harness: the default suite (analytical vs DES) per mechanism, its report, plot and CLI."""
from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest

from partir_emu.app.cli.main import main
from partir_emu.app.validation.cases import MAX_MAX, MEDIAN_MAX, SUITES, Case, ValidationError, parse_cases, run_suite
from partir_emu.hwmodels.validation.des import MECHANISMS, CaseResult, analytical_inputs, explain
from partir_emu.hwmodels.validation.report import ValidationReport


@pytest.mark.slow
def test_default_validation_suite(tmp_path):
    """>= 40 cases, at least half beyond the alpha-beta closed form (every mechanism present), MLP and
    transformer, TPU v4, v5e (two and four slices joined by DCN) and H100, 8 to 2048 chips: median |analytical - DES| / DES <= 2 %, max <= 10 %,
    identical strategy rankings; the report gives the error per mechanism."""
    cases = SUITES["default"]
    assert len(cases) >= 40 and MEDIAN_MAX == 0.02 and MAX_MAX == 0.10
    beyond = [c for c in cases if c.mechanism != "closed-form"]
    assert 2 * len(beyond) >= len(cases)
    assert {c.mechanism for c in cases} == set(MECHANISMS)
    assert {c.scenario for c in cases} == {"mlp", "transformer"}
    assert {c.hardware for c in cases} == {"tpu-v4", "tpu-v5e", "h100"}           # v5e: slices over DCN
    assert min(c.devices for c in cases) == 8 and max(c.devices for c in cases) == 2048
    rep = run_suite("default")
    by = rep.by_mechanism()
    assert list(by) == list(MECHANISMS) and sum(m["n"] for m in by.values()) == len(cases)
    png = tmp_path / "v.png"
    rep.plot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rep.rankings_agree and len(rep.rankings()) >= 6, rep.failures()
    assert rep.passed(), rep.mechanism_table() + "\n" + "; ".join(rep.failures())


def test_case_mechanism_label_and_inputs():
    c = Case("mlp", "bp", "tpu-v4", "batch=8", "full", "layers=2", stragglers=((3, 1.5),))
    assert c.mechanism == "straggler" and c.label == "bp@batch=8 slow 3x1.5"
    assert c.inputs() == {"comm_streams": 1, "stragglers": {3: 1.5}, "degraded_links": {}, "failed_links": ()}
    assert Case("mlp", "bp", "h100", "batch=64", failed_links=("0-leaf0",), mechanism="nic-sharing").mechanism \
        == "nic-sharing"
    assert Case("mlp", "bp", "tpu-v4", "batch=8", degraded_links=(("0->1", 0.25),)).mechanism == "degraded-link"
    assert Case("mlp", "bp", "tpu-v4", "batch=8", failed_links=("0-1",)).mechanism == "failed-link"
    assert Case("mlp", "bp+mp", "tpu-v4", "batch=2,model=4", overlap=True, comm_streams=2).mechanism == "streams"
    assert Case("mlp", "bp", "tpu-v4", "batch=8").mechanism == "closed-form"
    rail = Case("mlp", "bp", "h100", "batch=16", hw_overrides="topology.fabric=rail_optimized,topology.nodes_per_su=4")
    assert rail.spec_overrides() == {"topology.fabric": "rail_optimized", "topology.nodes_per_su": 4}
    # conditions separate the rankings: a straggler case is not ranked against the healthy one
    assert c.ranking_key != Case("mlp", "bp", "tpu-v4", "batch=8", "full", "layers=2").ranking_key


def test_both_models_get_the_conditions():
    """A straggler at 2x and a ring link at 1/4 bandwidth move both models (the analytical model takes
    every input; a missing one would be reported as ignored)."""
    base, slow, degraded = run_suite([
        Case("mlp", "bp", "tpu-v4", "batch=8", "full", "layers=2"),
        Case("mlp", "bp", "tpu-v4", "batch=8", "full", "layers=2", stragglers=((3, 2.0),)),
        Case("mlp", "bp", "tpu-v4", "batch=8", "full", "layers=2", degraded_links=(("0->1", 0.25),)),
    ]).results
    for r in (slow, degraded):
        assert r.des_s > 1.05 * base.des_s and r.analytical_s > 1.05 * base.analytical_s
        assert "analytical_ignores" not in r.details and "does not take" not in r.why
    assert slow.to_json()["stragglers"] == [[3, 2.0]] and slow.to_json()["mechanism"] == "straggler"


def test_inputs_the_analytical_model_does_not_take_are_reported():
    class Old:
        def simulate(self, spmd, spec, placement=None, overlap=False, *, algorithms=None):
            raise AssertionError("not called")
    inputs = Case("mlp", "bp", "tpu-v4", "batch=8", stragglers=((1, 2.0),), comm_streams=2).inputs()
    takes, ignored = analytical_inputs(Old(), inputs)
    assert takes == {} and ignored == ["comm_streams", "stragglers"]
    assert set(inspect.signature(run_suite).parameters) >= {"programs", "cache_dir"}


def _row(**kw):
    base = dict(at=(), index=0, prim="all_reduce", axes=("batch",), time_s=1.0, duration_s=1.0, contention="",
                worst_link="ici y+", max_link_flows=2, group_link_flows=1, own_link_flows=2)
    return SimpleNamespace(**{**base, **kw})


def test_explain_names_the_cause():
    ana = SimpleNamespace(step_s=10.0, collectives=[_row(index=1), _row(index=2, prim="all_gather")])
    des = SimpleNamespace(step_s=12.0, collectives=[
        _row(index=1, duration_s=2.5, contention="groups"),
        _row(index=2, prim="all_gather", duration_s=1.5, contention="other", max_link_flows=3)])
    why, details = explain(ana, des)
    assert why.startswith("DES 2000.000 ms slower (16.7%)")
    assert "1 all_reduce over (batch) +1500.000 ms: contention on link ici y+: 2 flows of the collective's " \
           "concurrent groups" in why
    assert "3 flows, 1 of them from other collectives in flight" in why
    assert [c["cause"] for c in details["causes"]] == ["groups", "other"]
    assert explain(SimpleNamespace(step_s=12.0, collectives=[]), des) == ("", {})


def test_report_per_mechanism_and_thresholds():
    def res(case, ana, des):
        return CaseResult(case, ana, des, 0.0, 0.0, 0.0, 0)
    a = Case("mlp", "bp", "tpu-v4", "batch=8")
    b = Case("mlp", "z3", "tpu-v4", "batch=8")
    s = Case("mlp", "bp", "tpu-v4", "batch=8", stragglers=((3, 1.5),))
    rep = ValidationReport("t", (res(a, 1.0, 1.0), res(b, 2.0, 2.0), res(s, 1.0, 1.25)), 0.0, 0.0)
    by = rep.by_mechanism()
    assert list(by) == ["closed-form", "straggler"]
    assert by["straggler"] == {"n": 1, "median": 0.2, "mean": 0.2, "max": 0.2, "worst_signed": -0.2,
                               "worst": "tpu-v4 mlp/default bp@batch=8 slow 3x1.5"}
    assert by["closed-form"]["max"] == 0.0
    assert not rep.passed() and "max |analytical - DES| / DES = 20.00% > 10%" in rep.failures()[0]
    assert "straggler" in rep.mechanism_table() and json.loads(rep.dumps())["by_mechanism"]["straggler"]["n"] == 1
    # 9 % on one case of eleven: under the max, and the median stays 0
    ok = ValidationReport("t", (res(s, 1.0, 1.1),) + tuple(res(a, 1.0, 1.0) for _ in range(10)), 0.0, 0.0)
    assert ok.passed()
    # a ranking that flips fails even when the errors are small
    flip = ValidationReport("t", (res(a, 1.0, 1.01), res(b, 1.005, 1.0)), 0.0, 0.0)
    assert not flip.passed() and "rankings differ" in flip.failures()[-1]


def test_cases_file_with_conditions():
    lines = ['{"scenario": "mlp", "strategy": "bp", "hardware": "h100", "mesh": "batch=64", "preset": "full", '
             '"stragglers": {"5": 2.0}, "degraded_links": {"0->leaf0": 0.5}, "failed_links": ["1-leaf0"], '
             '"hw_overrides": "topology.fabric=fat_tree", "mechanism": "nic-sharing"}',
             '{"scenario": "mlp", "strategy": "bp+mp", "hardware": "tpu-v4", "mesh": "batch=16,model=4", "preset": "full", '
             '"overlap": true, "comm_streams": 2, "slice_dims": "4x4x4"}']
    a, b = parse_cases(lines)
    assert a.stragglers == ((5, 2.0),) and a.degraded_links == (("0->leaf0", 0.5),) and a.failed_links == ("1-leaf0",)
    assert a.mechanism == "nic-sharing" and b.mechanism == "streams" and b.slice_tuple() == (4, 4, 4)
    for bad, match in (('"stragglers": {"x": 2.0}', "not a device number"),
                       ('"stragglers": {"99": 2.0}', "straggler device 99"),
                       ('"degraded_links": {"0->9": 0.5}', "no link 0->9"),
                       ('"degraded_links": {"0->1": -1}', "field 'degraded_links'"),
                       ('"comm_streams": 0', "field 'comm_streams'"),
                       ('"failed_links": "0-1"', "field 'failed_links'")):
        with pytest.raises(ValidationError, match=match):
            parse_cases(['{"scenario": "mlp", "strategy": "bp", "hardware": "tpu-v4", "mesh": "batch=8", '
                         + bad + '}'])


@pytest.mark.slow
def test_validate_cli_quick_suite(tmp_path, capsys):
    """The CLI runs a suite, prints the table and the error per mechanism, writes the report and plot,
    keeps the lowered programs, and exits 0 exactly when the suite passes."""
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    rc = main(["validate", "--suite", "quick", "--report", str(report), "--plot", str(plot),
               "--cache", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    d = json.loads(report.read_text())
    assert (rc == 0) == d["passed"] == ("\nPASS" in out)
    assert "strategy rankings" in out and "error per mechanism" in out
    assert len(d["cases"]) == len(SUITES["quick"]) and set(d["by_mechanism"]) >= {"closed-form", "straggler"}
    assert plot.stat().st_size > 1000
    assert list((tmp_path / "cache").glob("*.json"))        # lowered programs kept for the next run
    rc2 = main(["validate", "--suite", "quick", "--cache", str(tmp_path / "cache"), "--no-check"])
    assert rc2 == 0 and "lowering 0.0 s" in capsys.readouterr().out


def test_validate_cli_errors(tmp_path, capsys):
    assert main(["validate", "--suite", "nope"]) == 2
    assert "unknown validation suite 'nope'" in capsys.readouterr().err
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"scenario": "mlp"}\n')
    assert main(["validate", "--cases", str(bad)]) == 2
    assert "case line 1" in capsys.readouterr().err
