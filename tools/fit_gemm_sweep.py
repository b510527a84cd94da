"""Fit a chip's GEMM efficiency curve (``[efficiency]`` matmul fields) to a measured GEMM sweep.

    python tools/fit_gemm_sweep.py partir_emu/hwmodels/data/gemm/h100-sm90-bf16.csv --hardware h100
    python tools/fit_gemm_sweep.py SWEEP.csv --hardware a100 --tiles 128x128x32,128x256x32

The sweep is a CSV of ``b,m,n,k,tflops`` rows (``#`` lines are comments): measured throughput of a
``[b] M×K · K×N`` product. The model is the one the step is priced with
(:func:`partir_emu.hwmodels.compute.efficiency.matmul_efficiency`), plus a fixed time per call:

    t(b, m, n, k) = t0 + 2·b·m·n·k / (peak · f · pad · wave · fill(K; fill_elems))

``f`` (matmul_peak_fraction) and ``fill_elems`` (matmul_fill_elems) are what the spec takes; ``t0``
is the sweep's per-call floor (launch, synchronisation and timer overhead of the benchmark: the
smallest shapes all take about the same time) and is a nuisance parameter here: the step model
charges ``kernel_launch_s`` per kernel instead, because kernels issued back to back in one stream
hide their launch. The fit minimises the squared error of log(time) (relative errors count the same
at every size) over a grid of ``t0`` and ``fill_elems`` with ``f`` solved for each; every candidate
tile (``--tiles``) and work schedule (``--schedules``: one output tile per unit, or stream-K's
main-loop iterations spread over the units) is fitted, the best printed first. The wave quantisation uses the spec's
``matmul_wave_units``.

numpy and partir_emu only (no scipy).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partir_emu.hwmodels.compute.efficiency import EfficiencySpec, matmul_efficiency  # noqa: E402
from partir_emu.hwmodels.machine.specs import load_spec  # noqa: E402


def read_sweep(path: str | Path) -> np.ndarray:
    """Rows ``[b, m, n, k, flop_per_s]`` of a sweep CSV (header ``b,m,n,k,tflops``)."""
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if lines[0].replace(" ", "") != "b,m,n,k,tflops":
        raise SystemExit(f"{path}: the first non-comment line must be 'b,m,n,k,tflops', got {lines[0]!r}")
    rows = np.array([[float(x) for x in ln.split(",")] for ln in lines[1:]])
    rows[:, 4] *= 1e12
    return rows


@dataclasses.dataclass(frozen=True)
class GemmFit:
    tile: tuple[int, int, int]
    schedule: str
    peak_fraction: float
    fill_elems: float
    t0_s: float
    rms_log: float            # root-mean-square of log(predicted / measured time)
    median_abs: float         # median |predicted / measured - 1| of the throughput
    max_abs: float

    def line(self) -> str:
        return (f"{self.schedule}, tile {self.tile[0]}x{self.tile[1]}x{self.tile[2]}: matmul_peak_fraction {self.peak_fraction:.3f}, "
                f"matmul_fill_elems {self.fill_elems:.0f}, t0 {self.t0_s * 1e6:.2f} us; "
                f"|error| median {self.median_abs:.1%}, max {self.max_abs:.1%} (rms log {self.rms_log:.3f})")


def shape_factor(eff: EfficiencySpec, rows: np.ndarray) -> np.ndarray:
    """pad · wave · fill of each row at ``matmul_peak_fraction = 1``."""
    return matmul_efficiency(dataclasses.replace(eff, matmul_peak_fraction=1.0),
                             rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3])


FILLS = np.arange(0.0, 1025.0, 16.0)       # matmul_fill_elems grid, elements of K
T0S = np.arange(0.0, 10.01e-6, 0.2e-6)     # per-call floor grid, seconds


def fit(rows: np.ndarray, base: EfficiencySpec, peak: float, tile: tuple[int, int, int], schedule: str,
        fills: np.ndarray = FILLS, t0s: np.ndarray = T0S) -> GemmFit:
    flops = 2.0 * rows[:, 0] * rows[:, 1] * rows[:, 2] * rows[:, 3]
    t_meas = flops / rows[:, 4]
    best: tuple[float, float, float, float] | None = None
    fracs = np.linspace(0.30, 1.0, 351)
    for fill in fills:
        eff = dataclasses.replace(base, matmul_tile=tile, matmul_fill_dim="k", matmul_fill_elems=float(fill),
                                  matmul_schedule=schedule)
        ideal = flops / (peak * shape_factor(eff, rows))          # time at f = 1, t0 = 0
        # [t0, frac, row]: every t0 and f at once
        pred = t0s[:, None, None] + ideal[None, None, :] / fracs[None, :, None]
        err = np.mean(np.log(pred / t_meas) ** 2, axis=2)
        i, j = np.unravel_index(np.argmin(err), err.shape)
        if best is None or err[i, j] < best[0]:
            best = (float(err[i, j]), float(fracs[j]), float(fill), float(t0s[i]))
    assert best is not None
    mse, frac, fill, t0 = best
    eff = dataclasses.replace(base, matmul_tile=tile, matmul_fill_dim="k", matmul_fill_elems=fill,
                              matmul_schedule=schedule)
    pred_t = t0 + flops / (peak * frac * shape_factor(eff, rows))
    rel = np.abs(t_meas / pred_t - 1.0)                       # throughput error
    return GemmFit(tile, schedule, frac, fill, t0, float(np.sqrt(mse)), float(np.median(rel)), float(rel.max()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", help="CSV of b,m,n,k,tflops rows")
    ap.add_argument("--hardware", required=True, help="spec name whose peak and wave units the fit uses")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--tiles", default="128x128x64,128x256x64,256x128x64,128x128x32",
                    help="candidate CTA tiles MxNxK, comma-separated")
    ap.add_argument("--schedules", default="data_parallel,stream_k", help="candidate matmul_schedule values")
    ap.add_argument("--check", action="append", default=[], metavar="B,M,N,K,TFLOPS",
                    help="a measurement not in the sweep: print each fit's prediction of it (repeatable)")
    args = ap.parse_args(argv)
    spec = load_spec(args.hardware)
    peak = spec.flops_bf16_per_s if args.dtype == "bf16" else spec.flops_f32_per_s
    rows = read_sweep(args.sweep)
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    fits = sorted((fit(rows, spec.efficiency, peak, t, sched) for t in tiles for sched in args.schedules.split(",")),
                  key=lambda f: f.rms_log)   # type: ignore[arg-type]
    print(f"{args.sweep}: {len(rows)} GEMMs on {args.hardware} (peak {peak / 1e12:.0f} TFLOP/s {args.dtype}, "
          f"{spec.efficiency.matmul_wave_units} wave units)")
    checks = np.array([[float(x) for x in c.split(",")] for c in args.check]).reshape(-1, 5)
    for f in fits:
        print("  " + f.line())
        eff = dataclasses.replace(spec.efficiency, matmul_tile=f.tile, matmul_fill_dim="k", matmul_fill_elems=f.fill_elems,
                                  matmul_schedule=f.schedule, matmul_peak_fraction=f.peak_fraction)
        for c in checks:
            e = float(matmul_efficiency(eff, *c[:4])) * peak / 1e12
            print(f"      check {int(c[0])}x{int(c[1])}x{int(c[2])}x{int(c[3])}: measured {c[4]:.1f}, "
                  f"model {e:.1f} TFLOP/s ({e / c[4] - 1:+.1%}, without t0)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
