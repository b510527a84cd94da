"""The validation harness: the default suite (analytical vs DES), its report, plot and CLI."""
from __future__ import annotations

import json

import pytest

from partir_emu.app.cli import main
from partir_emu.app.validate_cases import MAX_MAX, MEDIAN_MAX, SUITES, Case, run_suite


@pytest.mark.slow
def test_default_validation_suite(tmp_path):
    """>= 20 cases, MLP and transformer, TPU v4 and H100, 8 to 2048 chips: median |analytical - DES| / DES
    <= 5 %, max <= 15 %, identical strategy rankings; the report says why wherever DES is slower."""
    cases = SUITES["default"]
    assert len(cases) >= 20
    assert {c.scenario for c in cases} == {"mlp", "transformer"} and {c.hardware for c in cases} == {"tpu-v4", "h100"}
    assert min(c.devices for c in cases) == 8 and max(c.devices for c in cases) == 2048
    rep = run_suite("default")
    assert rep.median_rel_err <= MEDIAN_MAX
    assert rep.max_rel_err <= MAX_MAX
    assert rep.rankings_agree and len(rep.rankings()) >= 6
    assert rep.passed(), rep.failures()
    for r in rep.results:
        if r.des_s > r.analytical_s * 1.005:
            assert "contention on link" in r.why or "run ahead" in r.why, r.why
    d = rep.to_json()
    for c in d["cases"]:
        assert {"scenario", "strategy", "hardware", "devices", "analytical_s", "des_s", "rel_err"} <= set(c)
    assert {"median_rel_err", "max_rel_err", "rankings_agree", "cases"} <= set(d)
    png = tmp_path / "v.png"
    rep.plot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rep.wall_s < 600


def test_contended_case_is_explained():
    rep = run_suite([Case("mlp", "bp+mp", "tpu-v4", "batch=8,model=8", "full", "layers=2"),
                     Case("mlp", "bp+mp", "tpu-v4", "batch=16,model=4", "full", "layers=2")])
    contended, clean = rep.results
    assert contended.signed_err < -0.01 and "contention on link ici y+" in contended.why
    assert "concurrent groups" in contended.why
    assert clean.rel_err < 1e-9 and clean.why == ""
    assert rep.rankings()[0]["agree"]
    assert "where the analytical model is optimistic" in rep.table()


def test_validate_cli_quick_suite(tmp_path, capsys):
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    rc = main(["validate", "--suite", "quick", "--report", str(report), "--plot", str(plot),
               "--cache", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out and "strategy rankings" in out
    d = json.loads(report.read_text())
    assert d["rankings_agree"] and len(d["cases"]) == len(SUITES["quick"])
    assert plot.stat().st_size > 1000
    assert list((tmp_path / "cache").glob("*.json"))        # lowered programs kept for the next run
    rc = main(["validate", "--suite", "quick", "--cache", str(tmp_path / "cache")])
    assert rc == 0 and "lowering 0.0 s" in capsys.readouterr().out


def test_validate_cli_errors(tmp_path, capsys):
    assert main(["validate", "--suite", "nope"]) == 2
    assert "unknown validation suite 'nope'" in capsys.readouterr().err
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"scenario": "mlp"}\n')
    assert main(["validate", "--cases", str(bad)]) == 2
    assert "case line 1" in capsys.readouterr().err
