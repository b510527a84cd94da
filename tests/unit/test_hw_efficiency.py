"""Efficiency curves (matmul by size and shape, HBM by transfer size) and validation of the spec
tables that hold them ([efficiency], [compiler])."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import tomllib

from partir_emu.errors import SpecError
from partir_emu.hwmodels import load_spec
from partir_emu.hwmodels.compute.efficiency import EfficiencySpec, hbm_fraction, matmul_efficiency, parse_efficiency
from partir_emu.hwmodels.machine.specs import DATA_DIR, spec_from_dict

PACKAGED = ["a100", "a100-40gb", "h100", "h200", "tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p"]


def eff(spec: str, b, m, n, k) -> float:
    return float(matmul_efficiency(load_spec(spec).efficiency, np.array([b]), np.array([m]), np.array([n]),
                                   np.array([k]))[0])


@pytest.mark.parametrize("spec", PACKAGED)
def test_matmul_efficiency_grows_with_size_towards_the_large_gemm_fraction(spec):
    e = load_spec(spec).efficiency
    sizes = [128 * 2**i for i in range(8)]            # tile multiples: only fill and waves change
    curve = [eff(spec, 1, s, s, s) for s in sizes]
    assert all(a <= b + 1e-12 for a, b in zip(curve, curve[1:]))
    assert 0 < curve[0] < curve[-1] <= e.matmul_peak_fraction
    assert curve[-1] > 0.97 * e.matmul_peak_fraction


@pytest.mark.parametrize("spec", PACKAGED)
def test_tile_padding_costs_the_padded_work(spec):
    tm, tn, tk = load_spec(spec).efficiency.matmul_tile
    e = dataclasses.replace(load_spec(spec).efficiency, matmul_wave_units=0)    # padding alone (waves apart)
    full, more = matmul_efficiency(e, np.ones(2), np.full(2, 4096), np.array([4096, 4097]), np.full(2, 4096))
    assert more < full * 4097 / (4096 + tn) * (1 + 1e-12)           # one column more: a whole tile of N more
    assert eff(spec, 1, 4096, tn + 1, 4096) == pytest.approx(
        eff(spec, 1, 4096, 2 * tn, 4096) * (tn + 1) / (2 * tn), rel=1e-12)


def _eff_of(e, b, m, n, k) -> float:
    return float(matmul_efficiency(e, np.array([b]), np.array([m]), np.array([n]), np.array([k]))[0])


def test_wave_quantisation_on_gpu_and_none_on_tpu():
    a100 = load_spec("a100").efficiency
    assert a100.matmul_wave_units == 108
    # one output tile per SM (data_parallel): 108 tiles fill one wave; 109 need a second, almost empty one
    dp = dataclasses.replace(a100, matmul_schedule="data_parallel")
    full = _eff_of(dp, 108, 128, 128, 4096)
    assert _eff_of(dp, 109, 128, 128, 4096) == pytest.approx(full * 109 / 216, rel=1e-12)
    assert eff("tpu-v4", 109, 128, 128, 4096) == pytest.approx(eff("tpu-v4", 108, 128, 128, 4096), rel=1e-12)


def test_stream_k_spreads_a_long_k_over_every_unit():
    """stream-K quantises the tiles·⌈K/tk⌉ main-loop iterations over the SMs, and each SM pays the
    pipeline fill once on its share of K (closed form on the A100's 128×128×32 tile)."""
    a100 = load_spec("a100").efficiency
    assert a100.matmul_schedule == "stream_k" and a100.matmul_tile == (128, 128, 32)
    f, fill = a100.matmul_peak_fraction, a100.matmul_fill_elems
    # 109 tiles × 128 K-iterations = 13,952 over 108 SMs: 130 rounds, the last nearly full
    iters = 109 * 128
    wave = iters / (math.ceil(iters / 108) * 108)
    assert eff("a100", 109, 128, 128, 4096) == pytest.approx(f * wave * 4096 / (4096 + fill), rel=1e-12)
    # 8 tiles and K = 4096: each SM runs 128·8/108 ≈ 9.5 iterations of K = 32, its fill on 303 elements
    share = 8 * 128 / 108 * 32
    expect = f * (8 * 128) / (math.ceil(8 * 128 / 108) * 108) * share / (share + fill)
    assert eff("a100", 1, 256, 512, 4096) == pytest.approx(expect, rel=1e-12)
    # data_parallel would run those 8 tiles on 8 of the 108 SMs
    dp = dataclasses.replace(a100, matmul_schedule="data_parallel")
    assert _eff_of(dp, 1, 256, 512, 4096) < 0.1 < eff("a100", 1, 256, 512, 4096)


def test_stream_k_needs_k_fill_and_units():
    raw = {"matmul_peak_fraction": 0.9, "matmul_tile": [128, 128, 64], "matmul_fill_dim": "m", "matmul_fill_elems": 96,
           "matmul_schedule": "stream_k", "vector_fraction": 0.9, "hbm_curve_mb": [0], "hbm_curve_fraction": [1.0]}
    raw.update({f"{k}_source": "test" for k in list(raw)})
    with pytest.raises(SpecError, match="stream_k.*matmul_fill_dim = 'k' and matmul_wave_units"):
        parse_efficiency(raw, "spec.toml")


def test_small_streamed_dimension_overhead():
    # GPU: short K does not amortise the main loop's prologue; TPU: few rows per weight-tile load
    assert eff("a100", 108, 128, 128, 64) < 0.6 * eff("a100", 108, 128, 128, 8192)
    assert eff("tpu-v4", 1, 128, 4096, 4096) < 0.6 * eff("tpu-v4", 1, 8192, 4096, 4096)


def test_a_pass_streams_the_padded_dimension_once():
    """Closed form on the TPU's weight-stationary MXU: a pass over ``m`` rows (padded to the 8-row
    sublane tile ``S``) takes ``S + fill`` cycles for ``m`` useful rows, so the efficiency is
    ``peak_fraction · m / (S + fill)``; the padding is not counted twice (decode at one row per
    device costs 136 cycles a pass, not 8 · 129)."""
    e = load_spec("tpu-v4").efficiency
    tm, tn, tk = e.matmul_tile
    assert e.matmul_fill_dim == "m"
    for m in (1, 3, 8, 9, 16, 100, 4096):
        S = -(-m // tm) * tm
        assert eff("tpu-v4", 1, m, tn, tk) == pytest.approx(e.matmul_peak_fraction * m / (S + e.matmul_fill_elems),
                                                           rel=1e-12), m
    # one row costs as much time as eight (the sublane tile), not eight times as much per row
    one, eight = eff("tpu-v4", 1, 1, tn, tk), eff("tpu-v4", 1, 8, tn, tk)
    assert 1 * tn * tk / one == pytest.approx(8 * tn * tk / eight, rel=1e-12)


@pytest.mark.parametrize("spec", PACKAGED)
def test_hbm_fraction_is_monotone_with_its_limits(spec):
    e = load_spec(spec).efficiency
    sizes = np.array([0, 1e3, 1e5, 1e6, 5e6, 1e7, 1e8, 1e9, 1e12])
    f = hbm_fraction(e, sizes)
    assert (np.diff(f) >= 0).all()
    assert f[0] == e.hbm_curve_fraction[0] and f[-1] == e.hbm_curve_fraction[-1]
    assert hbm_fraction(e, np.array([1e6]))[0] == pytest.approx(e.hbm_curve_fraction[1])


def test_default_efficiency_is_the_plain_peak():
    e = EfficiencySpec()
    assert matmul_efficiency(e, np.array([1]), np.array([3]), np.array([5]), np.array([7])).tolist() == [1.0]
    assert hbm_fraction(e, np.array([0.0, 1e9])).tolist() == [1.0, 1.0]


# -- validation -----------------------------------------------------------------------------------------
def _data(name: str = "a100") -> dict:
    with open(DATA_DIR / f"{name}.toml", "rb") as f:
        return tomllib.load(f)


@pytest.mark.parametrize("table, fld", [("efficiency", "matmul_peak_fraction"), ("efficiency", "matmul_tile"),
                                        ("compiler", "matmul_epilogue"), ("compiler", "kernel_launch_s")])
def test_missing_source_names_the_field(table, fld):
    d = _data()
    del d[table][f"{fld}_source"]
    with pytest.raises(SpecError, match=rf"{table}\.{fld}_source is missing"):
        spec_from_dict(d, "x.toml")


@pytest.mark.parametrize("table, fld, value, match", [
    ("efficiency", "matmul_peak_fraction", 1.5, r"efficiency\.matmul_peak_fraction must be a fraction"),
    ("efficiency", "matmul_tile", [128, 128], r"efficiency\.matmul_tile must be a list of 3"),
    ("efficiency", "hbm_curve_fraction", [0.3, 0.6], r"same length"),
    ("efficiency", "hbm_curve_fraction", [0.9, 0.6, 0.75, 0.3], r"non-decreasing"),
    ("compiler", "matmul_epilogue", "all", r"compiler\.matmul_epilogue must be one of"),
    ("compiler", "loop_fusion", 1, r"compiler\.loop_fusion must be true or false"),
])
def test_bad_values_name_the_field(table, fld, value, match):
    d = _data()
    d[table][fld] = value
    with pytest.raises(SpecError, match=match):
        spec_from_dict(d, "x.toml")


def test_missing_required_field_and_unknown_field():
    d = _data("tpu-v4")
    del d["efficiency"]["vector_fraction"], d["efficiency"]["vector_fraction_source"]
    with pytest.raises(SpecError, match=r"efficiency\.vector_fraction is missing"):
        spec_from_dict(d, "x.toml")
    d = _data("tpu-v4")
    d["compiler"]["fuse_everything"] = True
    d["compiler"]["fuse_everything_source"] = "wishful"
    with pytest.raises(SpecError, match=r"unknown field compiler\.fuse_everything"):
        spec_from_dict(d, "x.toml")


def test_tables_are_optional():
    d = _data()
    del d["compiler"], d["efficiency"]
    s = spec_from_dict(d, "x.toml")
    assert not s.compiler.loop_fusion and s.efficiency == EfficiencySpec()
