"""GPU GEMM efficiency against measured GEMMs: the H100 curve is fitted to XLA:GPU's measured sm_90
table (tools/fit_gemm_sweep.py) and checked on measurements it was not fitted to (the ml-engineering
MAMF table); the A100 curve takes its peak fraction from one MAMF measurement and is checked on
another. The spec values must be what the fit tool gives."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from partir_emu.hwmodels import load_spec
from partir_emu.hwmodels.compute.efficiency import matmul_efficiency

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import fit_gemm_sweep  # noqa: E402

SWEEP = ROOT / "partir_emu" / "hwmodels" / "data" / "gemm" / "h100-sm90-bf16.csv"


def tflops(chip: str, b: int, m: int, n: int, k: int) -> float:
    spec = load_spec(chip)
    e = matmul_efficiency(spec.efficiency, np.array([b]), np.array([m]), np.array([n]), np.array([k]))
    return float(e[0]) * spec.flops_bf16_per_s / 1e12


def test_the_h100_spec_is_the_fit_of_the_sweep():
    spec = load_spec("h100")
    rows = fit_gemm_sweep.read_sweep(SWEEP)
    assert len(rows) == 72
    f = fit_gemm_sweep.fit(rows, spec.efficiency, spec.flops_bf16_per_s, (128, 128, 64), "stream_k")
    assert f.peak_fraction == pytest.approx(spec.efficiency.matmul_peak_fraction, abs=1e-9)
    assert f.fill_elems == spec.efficiency.matmul_fill_elems
    assert spec.efficiency.matmul_schedule == "stream_k" and spec.efficiency.matmul_tile == (128, 128, 64)
    assert f.median_abs < 0.06
    # one output tile per SM fits worse on the same tile: the schedule is chosen by the data
    dp = fit_gemm_sweep.fit(rows, spec.efficiency, spec.flops_bf16_per_s, (128, 128, 64), "data_parallel")
    assert dp.rms_log > 1.5 * f.rms_log


def test_the_h100_curve_on_every_sweep_gemm():
    """The step model's curve plus the benchmark's per-call floor t0 (the fit's nuisance parameter:
    launch and timing of one call) against each of the 72 measurements."""
    rows = fit_gemm_sweep.read_sweep(SWEEP)
    spec = load_spec("h100")
    t0 = fit_gemm_sweep.fit(rows, spec.efficiency, spec.flops_bf16_per_s, (128, 128, 64), "stream_k").t0_s
    assert 1e-6 <= t0 <= 1e-5
    flops = 2 * rows[:, 0] * rows[:, 1] * rows[:, 2] * rows[:, 3]
    curve = np.array([tflops("h100", *map(int, r[:4])) for r in rows]) * 1e12
    pred = flops / (t0 + flops / curve)
    err = np.abs(pred / rows[:, 4] - 1)
    assert np.median(err) < 0.06 and np.mean(err < 0.15) > 0.8


@pytest.mark.parametrize("chip, shape, measured, tol", [
    # stas00/ml-engineering compute/accelerator/README.md, MAMF table (DayuanJiang fork @ 0fc0bdd)
    ("h100", (2048, 2048, 13312), 794.5, 0.03),      # torch 2.7 cu126: not in the fitted sweep
    ("h100", (6144, 17920, 2816), 792.1, 0.03),      # an older row (CUDA 12.1): not in the fitted sweep
    ("a100", (1024, 10240, 5120), 271.2, 0.005),     # the point the A100 peak fraction is taken from
    ("a100", (6912, 16384, 2048), 267.9, 0.03),      # an older row (CUDA 12.1): not used for the fraction
])
def test_maximum_achievable_matmul_flops(chip, shape, measured, tol):
    m, n, k = shape
    assert tflops(chip, 1, m, n, k) == pytest.approx(measured, rel=tol)


def test_the_sweep_file_is_what_the_fit_reads(tmp_path):
    bad = tmp_path / "sweep.csv"
    bad.write_text("m,n,k,tflops\n1,2,3,4\n")
    with pytest.raises(SystemExit, match="b,m,n,k,tflops"):
        fit_gemm_sweep.read_sweep(bad)
    good = dataclasses.replace(load_spec("h100").efficiency)
    assert good.matmul_wave_units == 132
