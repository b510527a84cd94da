"""``partir-emu check CLAIMS.toml`` as a CI job runs it: the shipped example file (every claim kind,
the model, its baseline and an in-process run verified against ``jax.jit``) holds and writes JUnit
XML; a deliberately broken change (every collective priced twice as slow) fails the baseline claim
with the figure named and exit 1; a configuration that cannot lower is an error (exit 2) of its
claims only; an output that would replace the claims file is refused before anything runs."""
from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from partir_emu.app.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def example(tmp_path):
    shutil.copytree(ROOT / "examples" / "claims", tmp_path / "claims")
    return tmp_path / "claims" / "claims.toml"


def _suite(xml: Path):
    (suite,) = ET.parse(xml).getroot().findall("testsuite")
    return suite, {c.get("name"): c for c in suite.findall("testcase")}


def test_the_example_claims_hold_and_junit_is_written(example, tmp_path, capsys):
    junit, report = tmp_path / "claims.xml", tmp_path / "claims.json"
    assert main(["check", str(example), "--quiet", "--junit", str(junit), "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "6 of 6 claims hold" in out and f"wrote {junit}" in out
    suite, cases = _suite(junit)
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("6", "0", "0")
    kinds = {c["kind"] for c in json.loads(report.read_text())["claims"]}
    assert kinds == {"faster", "fits", "within", "collectives", "baseline", "verified"}


def test_a_broken_change_fails_the_baseline_claim_with_the_figure(example, tmp_path, capsys, monkeypatch):
    import partir_emu.hwmodels.network.contention as contention
    from partir_emu.app.claims import model

    price = contention.Fabric.price

    def slow(self, *args, **kwargs):                    # the broken change: collectives twice as slow
        t, messages, hops = price(self, *args, **kwargs)
        return 2 * t, messages, hops

    monkeypatch.setattr(contention.Fabric, "price", slow)
    model._analyzer.cache_clear()          # the process's prices were cached by the unbroken code
    try:
        _broken(example, tmp_path, capsys)
    finally:
        model._analyzer.cache_clear()


def _broken(example, tmp_path, capsys):
    junit = tmp_path / "claims.xml"
    assert main(["check", str(example), "--quiet", "--junit", str(junit)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  tiny bp+mp does not move" in out and "step_s: " in out
    assert "(if the change is intended: partir-emu check --update-baselines, then review the diff)" in out
    suite, cases = _suite(junit)
    assert int(suite.get("failures")) >= 1 and suite.get("errors") == "0"
    assert "step_s" in cases["tiny bp+mp does not move"].find("failure").text
    assert cases["tiny bp+mp verifies against jax.jit"].find("failure") is None     # a price, not the program


def test_a_configuration_that_cannot_lower_is_an_error_of_its_claim(tmp_path, capsys):
    claims = tmp_path / "claims.toml"
    claims.write_text('[config.bad]\nscenario = "transformer"\nstrategy = "bp+mp"\nmesh = "batch=1,model=8"\n'
                      'size = "tiny"\n[config.good]\nscenario = "mlp"\nstrategy = "bp"\nmesh = "batch=2"\n'
                      'size = "tiny"\n[[claim]]\nfits = "bad"\n[[claim]]\nfits = "good"\n')
    junit = tmp_path / "claims.xml"
    assert main(["check", str(claims), "--quiet", "--junit", str(junit)]) == 2
    out = capsys.readouterr().out
    assert "ERROR fits bad" in out and "'model' axis" in out and "PASS  fits good" in out
    suite, cases = _suite(junit)
    assert (suite.get("failures"), suite.get("errors")) == ("0", "1")


def test_an_output_over_the_claims_file_is_refused(example, capsys):
    before = example.read_text()
    assert main(["check", str(example), "--junit", str(example)]) == 2
    err = capsys.readouterr().err
    assert "that this command reads; writing --junit would replace it" in err and example.read_text() == before
