"""``partir-emu check``'s claims file without the model: the whole file is checked before anything is
priced (each mistake a PartirError naming the file, the claim and the key), each configuration is
priced once however many claims name it, a claim that does not hold is a failure and one that
cannot be evaluated an error, and the JUnit XML is what CI parsers read (ElementTree, the
``testsuites > testsuite > testcase`` shape pytest's ``--junitxml`` writes)."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from partir_emu.app.claims.claims_file import evaluate, load_claims
from partir_emu.app.claims.junit import junit_xml
from partir_emu.errors import PartirError, UsageError
from partir_emu.testing import Prediction

HEAD = '''
[config.fast]
scenario = "transformer"
strategy = "bp+mp"
mesh = "batch=4,model=2"

[config.slow]
scenario = "transformer"
strategy = "bp"
mesh = { batch = 8 }
'''
GIB = 2 ** 30


def _file(tmp_path, text: str):
    p = tmp_path / "claims.toml"
    p.write_text(HEAD + text)
    return p


def _fake(steps: dict[str, float], calls: list[str]):
    def predict(scenario, strategy, mesh, hardware, *, label, **kw):
        calls.append(label)
        if label not in steps:
            raise UsageError(f"{label}: heads=4 is not divisible by the 'model' axis (size 8)")
        return Prediction(label, {}, steps[label], steps[label], 0.0, GIB, 1.1 * GIB, 16 * GIB, True, 1e12,
                          {"all_reduce@batch": 3}, None)
    return predict


@pytest.mark.parametrize("claim, match", [
    ('[[claim]]\nfits = "nope"\n', r"claims.toml: claim 1: fits names 'nope', not a configuration of the file "
                                   r"\(fast, slow\)"),
    ('[[claim]]\nfits = "fast"\nwithin = "slow"\n', r"claim 1: names fits and within; a claim is exactly one of"),
    ('[[claim]]\nname = "x"\n', r"claim 1: has no kind"),
    ('[[claim]]\nfaster = "fast"\n', r"faster = 'fast': name two configurations"),
    ('[[claim]]\nwithin = "fast"\n', r"a within claim needs measured_s"),
    ('[[claim]]\nfits = "fast"\nby = 0.1\n', r"'by' is not a key of a fits claim"),
    ('[[claim]]\nwithin = "fast"\nmeasured_s = "1s"\n', r"measured_s = '1s' has the wrong type"),
    ('[[claim]]\nfits = "fast"\n[[claim]]\nfits = "fast"\n', r"claims 1 and 2 are both named 'fits fast'"),
    ('[config.bad]\nscenario = "mlp"\nstrategy = "bp"\nmesh = "batch=2"\nchips = 4\n[[claim]]\nfits = "bad"\n',
     r"\[config.bad\]: unknown key 'chips'"),
    ('[config.bad]\nscenario = "mlp"\nmesh = "batch=2"\n[[claim]]\nfits = "bad"\n', r"\[config.bad\]: no strategy"),
    ('', r"no \[\[claim\]\] entries"),
    ('[claims]\nx = 1\n', r"unknown table\(s\) \['claims'\]"),
])
def test_every_mistake_in_the_file_is_named_before_anything_is_priced(tmp_path, claim, match):
    with pytest.raises(PartirError, match=match):
        load_claims(_file(tmp_path, claim))


def test_a_baseline_cannot_be_the_claims_file_or_not_json(tmp_path):
    with pytest.raises(PartirError, match=r"file = 'claims.toml' is the claims file itself"):
        load_claims(_file(tmp_path, '[[claim]]\nbaseline = "fast"\nfile = "claims.toml"\n'))
    with pytest.raises(PartirError, match=r"file = 'snap.txt': a baseline is a JSON file"):
        load_claims(_file(tmp_path, '[[claim]]\nbaseline = "fast"\nfile = "snap.txt"\n'))
    assert (tmp_path / "claims.toml").read_text().startswith(HEAD)             # untouched


def test_outcomes_priced_once_per_configuration(tmp_path):
    cf = load_claims(_file(tmp_path, '''
[[claim]]
name = "fast beats slow"
faster = ["fast", "slow"]
by = 0.2
[[claim]]
faster = ["slow", "fast"]
[[claim]]
fits = "fast"
hbm = "1GiB"
[[claim]]
collectives = "slow"
expect = { "all_reduce@batch" = 3 }
only = true
[[claim]]
within = "slow"
measured_s = 2.0
rel = 0.01
'''))
    calls: list[str] = []
    outcomes, written = evaluate(cf, predict=_fake({"fast": 1.0, "slow": 2.0}, calls))
    assert [o.status for o in outcomes] == ["pass", "fail", "fail", "pass", "pass"]
    assert sorted(calls) == ["fast", "slow"] and written == []
    assert "slow is not 0 % faster than fast" in outcomes[1].message
    assert "fast does not fit: needs 1.100 GiB" in outcomes[2].message


def test_a_configuration_that_does_not_lower_is_an_error_of_its_claims_only(tmp_path):
    cf = load_claims(_file(tmp_path, '[[claim]]\nfits = "slow"\n[[claim]]\nfits = "fast"\n'))
    outcomes, _ = evaluate(cf, predict=_fake({"fast": 1.0}, []))
    assert [o.status for o in outcomes] == ["error", "pass"]
    assert "heads=4 is not divisible" in outcomes[0].message


def test_baselines_are_written_then_checked_beside_the_claims_file(tmp_path):
    cf = load_claims(_file(tmp_path, '[[claim]]\nname = "fast stays"\nbaseline = "fast"\n'))
    outcomes, _ = evaluate(cf, predict=_fake({"fast": 1.0}, []))
    assert outcomes[0].status == "fail" and "run partir-emu check --update-baselines" in outcomes[0].message
    outcomes, written = evaluate(cf, update_baselines=True, predict=_fake({"fast": 1.0}, []))
    assert outcomes[0].status == "pass" and written == [tmp_path / "baselines" / "fast_stays.json"]
    assert evaluate(cf, predict=_fake({"fast": 1.01}, []))[0][0].status == "pass"        # within 2 %
    outcomes, _ = evaluate(cf, predict=_fake({"fast": 1.05}, []))
    assert outcomes[0].status == "fail" and "step_s: 1 s -> 1.05 s (+5.0 % of the step; tolerance 2 %)" \
        in outcomes[0].message


def test_junit_xml_has_a_testcase_per_claim_with_failures_and_errors(tmp_path):
    cf = load_claims(_file(tmp_path, '[[claim]]\nfits = "fast"\nhbm = "1GiB"\n[[claim]]\nfits = "slow"\n'
                                     '[[claim]]\nfaster = ["fast", "fast"]\n'))
    outcomes, _ = evaluate(cf, predict=_fake({"fast": 1.0}, []))
    root = ET.fromstring(junit_xml(outcomes, "claims.toml", 1.5))
    (suite,) = root.findall("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "1")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["fits fast", "fits slow", "faster fast vs fast"]
    assert cases[0].find("failure").get("message").startswith("fast does not fit")
    assert "heads=4" in cases[1].find("error").text and not list(cases[2])
