"""The claims of ``partir_emu.testing`` on hand-made predictions (no model run): each assertion
holds when the figures say so, and otherwise fails naming the configurations, the figure and the
margin; baselines compare figure by figure with tolerances relative to the step, exact counts, and
never take a missing snapshot silently. (The plugin, the example suite and a broken change caught
end to end: ``tests/integration/test_claims_plugin.py``.)"""
from __future__ import annotations

import json

import pytest

from partir_emu.app.claims.assertions import parse_bytes
from partir_emu.app.claims.baselines import baseline_name, diff_figures
from partir_emu.errors import PartirError
from partir_emu.testing import (
    Baselines,
    ClaimFailed,
    Prediction,
    assert_collectives,
    assert_faster,
    assert_fits,
    assert_verified,
    assert_within,
)

GIB = 2 ** 30


def _pred(label="a", step=1.0, peak=GIB, needed=None, hbm=16 * GIB, collectives=None, **kw) -> Prediction:
    needed = 1.05 * peak if needed is None else needed
    base = dict(compute_s=0.8 * step, exposed_comm_s=0.2 * step, flops_per_device=1e12)
    base.update(kw)
    return Prediction(label, {"scenario": "x"}, step, base["compute_s"], base["exposed_comm_s"], peak, needed, hbm,
                      needed <= hbm, base["flops_per_device"], dict(collectives or {"all_reduce@batch": 4}), None)


def test_assert_faster_holds_and_fails_with_the_margin():
    assert_faster(_pred("mp", 0.80), _pred("z3", 1.0), by=0.10)
    with pytest.raises(ClaimFailed, match=r"mp is not 10 % faster than z3: step 950 ms vs 1 s \(5\.0 % faster\)"):
        assert_faster(_pred("mp", 0.95), _pred("z3", 1.0), by=0.10)
    with pytest.raises(ClaimFailed, match=r"\(20\.0 % slower\)"):
        assert_faster(_pred("mp", 1.2), _pred("z3", 1.0))
    with pytest.raises(PartirError, match="by=10"):
        assert_faster(_pred(), _pred(), by=10)


def test_assert_fits_counts_the_allocator_and_reads_units():
    r = _pred("big", peak=15 * GIB, needed=16.5 * GIB)
    assert_fits(r, hbm="17GiB")
    assert_fits(r, hbm=18e9)
    with pytest.raises(ClaimFailed, match=r"big does not fit: needs 16\.500 GiB per device \(peak 15\.000 GiB\) "
                                          r"of 16\.000 GiB"):
        assert_fits(r)                                    # the chip's own 16 GiB
    with pytest.raises(ClaimFailed, match="of 14.901 GiB"):
        assert_fits(r, hbm="16GB")                        # 16e9 bytes, not 16 GiB
    assert parse_bytes("512MiB") == 512 * 2 ** 20 and parse_bytes("1.5e9") == 1.5e9
    with pytest.raises(PartirError, match="16 gigs"):
        parse_bytes("16 gigs")


def test_assert_within_a_measured_step():
    assert_within(_pred(step=1.05), measured_s=1.0, rel=0.08)
    with pytest.raises(ClaimFailed, match=r"predicted step 1\.1 s is \+10\.0 % from the measured 1 s \(allowed 8 %\)"):
        assert_within(_pred(step=1.1), measured_s=1.0, rel=0.08)


def test_assert_collectives_by_key_kind_and_only():
    r = _pred(collectives={"all_reduce@batch": 4, "all_gather@batch": 2, "all_gather@model": 1})
    assert_collectives(r, {"all_reduce@batch": 4, "all_gather": 3})
    assert_collectives(r, {"all_reduce": 4, "all_gather": 3}, only=True)
    with pytest.raises(ClaimFailed, match=r"all_reduce@batch: expected 3, got 4"):
        assert_collectives(r, {"all_reduce@batch": 3})
    with pytest.raises(ClaimFailed, match=r"all_gather@model: not expected, got 1"):
        assert_collectives(r, {"all_reduce@batch": 4, "all_gather@batch": 2}, only=True)


def test_assert_verified_takes_a_verdict_or_a_report():
    class Verdict:
        def __init__(self, ok):
            self.verified = ok

        def summary(self):
            return "verified: " + ("yes" if self.verified else "NO, worst w1 0.3")

    assert_verified(Verdict(True))
    assert_verified({"verified": True})
    with pytest.raises(ClaimFailed, match="did not verify against jax.jit: verified: NO, worst w1 0.3"):
        assert_verified(Verdict(False))
    with pytest.raises(PartirError, match="no 'verified' key"):
        assert_verified({"step_s": 1.0})


def test_diff_names_each_figure_beyond_its_tolerance():
    old = _pred(step=1.0).figures()
    tol = {"step_s": 0.02, "compute_s": 0.02, "exposed_comm_s": 0.02, "peak_bytes": 0.01, "flops_per_device": 0.001}
    assert diff_figures(old, _pred(step=1.01).figures(), tol) == []                  # 1 %: within
    new = _pred(step=1.1, collectives={"all_reduce@batch": 5, "all_gather@batch": 1}).figures()
    lines = diff_figures(old, new, tol)
    assert "step_s: 1 s -> 1.1 s (+10.0 % of the step; tolerance 2 %)" in lines
    assert "collectives all_reduce@batch: 4 -> 5" in lines and "collectives all_gather@batch: 0 -> 1" in lines
    # a near-zero exposed communication is judged against the step, not against itself
    near = dict(old, exposed_comm_s=1e-6)
    assert diff_figures(near, dict(near, exposed_comm_s=2e-6), tol) == []
    assert diff_figures(old, dict(old, fits=False), tol) == ["fits: True -> False"]


def test_baselines_write_check_and_refuse_a_missing_snapshot(tmp_path):
    b = Baselines(tmp_path, "test_x[bp-v4]")
    with pytest.raises(ClaimFailed, match=r"no baseline .*test_x_bp-v4.json for a: run pytest --partir-update-baselines"):
        b.check(_pred())
    Baselines(tmp_path, "test_x[bp-v4]", update=True).check(_pred())
    saved = json.loads((tmp_path / "test_x_bp-v4.json").read_text())
    assert saved["figures"]["collectives"] == {"all_reduce@batch": 4} and saved["label"] == "a"
    b.check(_pred(step=1.005))
    with pytest.raises(ClaimFailed, match=r"step_s: 1 s -> 1\.5 s \(\+50\.0 % of the step; tolerance 2 %\)"):
        b.check(_pred(step=1.5))
    b.check(_pred(step=1.5), tolerances={"step_s": 0.6, "compute_s": 0.6, "exposed_comm_s": 0.6})
    with pytest.raises(PartirError, match="unknown figure"):
        b.check(_pred(), tolerances={"collectives": 1})
    assert baseline_name("test_y", "v5e") == "test_y-v5e.json"
