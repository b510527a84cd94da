"""FP8 in the hardware models: each chip's FP8 matmul rate (H100/H200 from NVIDIA's datasheets; a chip
without FP8 units prices FP8 at its bf16 rate and its report says so), one byte per FP8 element in
memory and in collectives, and the same efficiency curve as bf16 (the assumption docs/hardware-models.md
states). Hand-built programs, closed forms; no jax."""
from __future__ import annotations

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.errors import SpecError
from partir_emu.hwmodels import load_spec, simulate
from partir_emu.hwmodels.compute.efficiency import hbm_fraction, matmul_efficiency
from partir_emu.hwmodels.des import simulate_des
from tests.unit.test_hw_analytical import MM, REL, Builder, unfused

E4, E5 = "float8_e4m3fn", "float8_e5m2"


def _dot(lhs: str, rhs: str, n: int = 4096, m: int = 4096, out: str = "float32"):
    b = Builder()
    x, w = b.input("x", (m, n), lhs), b.input("params/w", (n, n), rhs)
    y = b.eq("dot_general", (x, w), (m, n), out, dimension_numbers=MM, preferred_element_type=out)
    return b.build([y]), 2 * m * n * n


def test_the_fp8_rates_come_from_the_datasheets_and_chips_without_fp8_have_none():
    for name in ("h100", "h200"):
        spec = load_spec(name)
        assert spec.flops_fp8_per_s == 1979e12 and spec.flops_bf16_per_s == 989e12
        assert "3,958 TFLOPS" in spec.sources["flops_fp8_per_s"] and "sparsity" in spec.sources["flops_fp8_per_s"]
        assert spec.flops_per_s(E4) == spec.flops_per_s(E5) == spec.fp8_matmul_rate == 1979e12
    for name in ("a100", "tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p"):
        spec = load_spec(name)
        assert spec.flops_fp8_per_s is None and spec.fp8_matmul_rate == spec.flops_bf16_per_s
    assert load_spec("h100").to_json()["flops_fp8_per_s"] == 1979e12
    with pytest.raises(SpecError, match=r"chip.flops_fp8_per_s = 1e\+20 is outside"):
        load_spec("h100", {"chip.flops_fp8_per_s": 1e20})


def test_an_fp8_matmul_runs_at_the_fp8_peak_and_reads_one_byte_per_element():
    """Compute-bound 4096^3: flops / 1979 TFLOP/s on an unfused H100, half the bf16 time; its HBM
    traffic is 1 byte per operand element and 4 per float32 result element."""
    spec = unfused("h100")
    fp8, flops = _dot(E4, E4)
    r = simulate(fp8, spec)
    assert r.step_s == pytest.approx(flops / 1979e12, rel=REL)
    assert r.hbm_traffic_bytes == 2 * 4096 * 4096 * 1 + 4096 * 4096 * 4
    bf16, _ = _dot("bfloat16", "bfloat16", out="bfloat16")
    assert simulate(bf16, spec).step_s == pytest.approx(flops / 989e12, rel=REL)
    mixed, _ = _dot(E5, E4)                 # the backward's E5M2 x E4M3: an FP8 matmul too
    assert simulate(mixed, spec).step_s == pytest.approx(r.step_s, rel=REL)
    half, _ = _dot(E4, "bfloat16")          # FP8 x bf16 runs at the bf16 rate
    assert simulate(half, spec).step_s == pytest.approx(flops / 989e12, rel=1e-6)
    assert r.notes == ()


def test_a_chip_without_fp8_prices_it_at_bf16_and_says_so():
    fp8, flops = _dot(E4, E4)
    r = simulate(fp8, unfused("a100"))
    assert r.step_s == pytest.approx(flops / 312e12, rel=REL)
    assert len(r.notes) == 1 and r.notes[0].startswith("a100 has no FP8 matrix units")
    assert "note: a100 has no FP8" in r.table() and r.to_json()["notes"] == list(r.notes)
    bf16, _ = _dot("bfloat16", "bfloat16", out="bfloat16")
    assert simulate(bf16, unfused("a100")).notes == ()


def test_fp8_takes_the_bf16_efficiency_curve_of_its_shape():
    """The assumption: with h100's fitted [efficiency] the FP8 product of a shape reaches the same
    fraction of the FP8 peak as a bf16 one of that shape does of the bf16 peak (launch overhead apart)."""
    spec = load_spec("h100")
    launch = spec.compiler.kernel_launch_s
    for m, n in ((512, 1024), (8192, 4096)):
        fp8, flops = _dot(E4, E4, n=n, m=m, out="bfloat16")
        bf16, _ = _dot("bfloat16", "bfloat16", n=n, m=m, out="bfloat16")
        t8, t16 = simulate(fp8, spec).by_op_kind["matmul"]["time_s"], simulate(bf16, spec).by_op_kind["matmul"]["time_s"]
        eff = float(matmul_efficiency(spec.efficiency, 1, m, n, n))
        nbytes = m * n + n * n + 2 * m * n                     # FP8 operands, a bf16 result
        hbm = 3.35e12 * float(hbm_fraction(spec.efficiency, np.array([float(nbytes)]))[0])
        assert t8 - launch == pytest.approx(max(flops / (1979e12 * eff), nbytes / hbm), rel=1e-9)
        if m == 8192:       # compute bound: the bf16 time at the bf16 rate
            assert (t8 - launch) * 1979 == pytest.approx((t16 - launch) * 989, rel=1e-9)


def test_an_fp8_all_gather_moves_one_byte_per_element():
    """ZeRO-3 gathers FP8 weights where the program quantises before the gather (tests/integration/
    test_fp8.py): the same gather of E4M3 moves half the bytes of bf16, and takes half the time when
    bandwidth bound; the DES agrees with the analytical model."""
    times = {}
    for dtype in (E4, "bfloat16"):
        b = Builder()
        w = b.input("params/w", (1 << 22,), dtype)
        g = b.eq("all_gather", (w,), (8 << 22,), dtype, axes=("batch",), dim=0)
        spmd = b.build([g], Mesh(batch=8))
        r = simulate(spmd, "h100")
        assert r.collectives[0].nbytes == (8 << 22) * (1 if dtype == E4 else 2)
        times[dtype] = r.comm_s
        assert simulate_des(spmd, "h100").step_s == pytest.approx(r.step_s, rel=0.02)
    assert times["bfloat16"] / 2 < times[E4] < 0.6 * times["bfloat16"]      # the bytes halve, the latency stays
