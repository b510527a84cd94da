"""The ``partir-emu`` command line: list, run, show, simulate, hardware, and its errors (exit status 2).

In-process through ``partir_emu.app.cli.main.main`` (fast), once through the installed console script.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from partir_emu.app.cli.main import main

TINY = ["--size", "tiny", "--mesh", "batch=2,model=2"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- list, run, show -------------------------------------------------------------------------------
def test_list(capsys):
    rc, out, _ = run_cli(capsys, "list")
    assert rc == 0
    assert "mlp:" in out and "transformer:" in out
    for s in ("bp", "mp", "z2", "z3", "bp+mp", "bp+mp+z3"):
        assert s in out
    assert "t48 (simulation only)" in out and "t32 (simulation only)" in out


@pytest.mark.slow
def test_run_local_writes_the_report(capsys, tmp_path):
    path = tmp_path / "run.json"
    rc, out, _ = run_cli(capsys, "run", "mlp", "--strategy", "bp+mp", *TINY, "--report", str(path))
    assert rc == 0
    assert "verified: YES" in out
    rep = json.loads(path.read_text())
    for key in ("scenario", "strategy", "mesh", "devices", "backend", "verified", "max_abs_err", "collectives",
                "comm_bytes_per_device", "peak_bytes_per_device", "wall_s"):
        assert key in rep, key
    assert (rep["scenario"], rep["strategy"], rep["backend"], rep["devices"]) == ("mlp", "bp+mp", "local", 4)
    assert rep["mesh"] == {"batch": 2, "model": 2}
    assert rep["verified"] is True and rep["max_abs_err"] < 1e-5
    assert rep["collectives"]["all_reduce"] > 0 and rep["comm_bytes_per_device"] > 0
    assert rep["peak_bytes_per_device"] > 0 and rep["wall_s"] > 0


def test_show_prints_collectives_and_saves_a_program_that_runs(capsys, tmp_path):
    from partir_emu.app.experiment import Experiment
    from partir_emu.core.mesh import Mesh
    from partir_emu.core.spmd import SpmdProgram
    from partir_emu.runtime.local_mesh import LocalMesh

    path = tmp_path / "prog.json"
    rc, out, _ = run_cli(capsys, "show", "mlp", "--strategy", "mp", *TINY, "--output", str(path))
    assert rc == 0
    assert "all_reduce" in out and "collective" in out and f"wrote {path}" in out
    loaded = SpmdProgram.load(path)
    exp = Experiment("mlp", "mp", Mesh.parse("batch=2,model=2"), "tiny")
    fresh = exp.lower().spmd
    assert loaded.input_names == fresh.input_names and len(loaded.program.eqns) == len(fresh.program.eqns)
    inputs = exp.inputs()
    a = LocalMesh(loaded.mesh).run(loaded, inputs).outputs
    b = LocalMesh(fresh.mesh).run(fresh, inputs).outputs
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_show_after_tactic(capsys):
    rc, out, _ = run_cli(capsys, "show", "mlp", "--strategy", "bp+mp", *TINY, "--after-tactic", "1")
    assert rc == 0
    assert "sharding state after 1 tactic(s): bp:batch" in out
    assert "batch/x" in out and "(batch,)" in out
    rc, _, err = run_cli(capsys, "show", "mlp", "--strategy", "bp+mp", *TINY, "--after-tactic", "9")
    assert rc == 2 and "--after-tactic 9" in err


# -- simulate, hardware ----------------------------------------------------------------------------
SIM_KEYS = ("step_s", "compute_s", "comm_s", "peak_bytes_per_device", "hbm_bytes", "fits", "collectives",
            "scenario", "strategy", "mesh", "hardware", "devices", "by_collective", "memory")


def test_simulate_table_and_report(capsys, tmp_path):
    path = tmp_path / "sim.json"
    rc, out, _ = run_cli(capsys, "simulate", "transformer", "--strategy", "bp+mp+z3", *TINY,
                         "--hardware", "tpu-v4", "--no-overlap", "--report", str(path))
    assert rc == 0
    for text in ("transformer / bp+mp+z3 on 4 devices", "step", "compute", "comm", "peak memory", "GiB", "fits",
                 "slowest collectives", "all_gather", "reduce_scatter"):
        assert text in out, text
    rep = json.loads(path.read_text())
    for key in SIM_KEYS:
        assert key in rep, key
    assert rep["hardware"] == "tpu-v4" and rep["devices"] == 4 and rep["mesh"] == {"batch": 2, "model": 2}
    assert rep["fits"] is True and 0 < rep["peak_bytes_per_device"] < rep["hbm_bytes"] == 32 * 2**30
    assert rep["step_s"] == pytest.approx(rep["compute_s"] + rep["comm_s"], rel=1e-12)
    rows = rep["collectives"]
    assert rows and {"prim", "axes", "nbytes", "group_size", "algorithm", "time_s"} <= set(rows[0])
    assert sum(r["time_s"] for r in rows) == pytest.approx(rep["comm_s"], rel=1e-9)
    assert {r["prim"] for r in rows} == {"all_gather", "reduce_scatter", "all_reduce"}


def test_simulate_options(capsys, tmp_path):
    path = tmp_path / "sim.json"
    rc, out, _ = run_cli(capsys, "simulate", "transformer", "--strategy", "bp+mp", "--size", "tiny",
                         "--mesh", "batch=4,model=2", "--hardware", "tpu-v5e", "--placement", "model=x,batch=y",
                         "--overlap", "--algorithm", "all_reduce=ring", "--report", str(path))
    assert rc == 0 and "overlap on" in out
    rep = json.loads(path.read_text())
    assert rep["overlap"] is True and rep["algorithm"] == {"all_reduce": "ring"}
    assert rep["placement"].startswith("batch=y, model=x")
    assert {r["algorithm"] for r in rep["collectives"]} == {"ring"}
    assert rep["step_s"] <= rep["compute_s"] + rep["comm_s"] + 1e-15


@pytest.mark.slow
def test_simulate_full_width_without_arrays(capsys, tmp_path):
    # t32's full width (d_model 2560, seq 2048, vocab 50304) on 512 chips, cut to 2 layers to stay fast
    path = tmp_path / "sim.json"
    rc, out, _ = run_cli(capsys, "simulate", "transformer", "--strategy", "bp+mp+z3", "--size", "t32",
                         "--set", "layers=2", "--mesh", "batch=64,model=8", "--hardware", "tpu-v4",
                         "--report", str(path))
    assert rc == 0 and "512 chips" in out
    rep = json.loads(path.read_text())
    assert rep["devices"] == 512 and rep["size"]["d_model"] == 2560 and rep["size"]["layers"] == 2
    assert 0 < rep["step_s"] < float("inf") and rep["comm_s"] > 0


def test_hardware_lists_every_spec(capsys):
    rc, out, _ = run_cli(capsys, "hardware")
    assert rc == 0
    for name in ("tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p", "a100", "a100-40gb", "h100", "h200"):
        assert name in out
    assert "4096" in out and "275" in out and "3D torus 16x16x16" in out      # tpu-v4 chips, TFLOP/s, topology
    rc, out, _ = run_cli(capsys, "hardware", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["h100"]["flops_bf16_per_s"] == 989e12 and rows["h100"]["max_chips"] % 8 == 0
    assert rows["tpu-v4"]["link_bw_bytes_per_s"] == 4.5e10


def test_hardware_shows_one_spec_with_sources(capsys):
    rc, out, _ = run_cli(capsys, "hardware", "tpu-v4")
    assert rc == 0
    assert "link_bw_bytes_per_s" in out and "scaling-book" in out and "tpu-v4.toml" in out


def test_hardware_reports_a_bad_user_spec_and_lists_the_rest(capsys, tmp_path, monkeypatch):
    (tmp_path / "my-chip.toml").write_text('name = "my-chip"\nkind = "tpu"\n[chip]\nflops_bf16_per_s = 1e14\n')
    monkeypatch.setenv("PARTIR_EMU_HW_PATH", str(tmp_path))
    rc, out, err = run_cli(capsys, "hardware")
    assert rc == 2
    assert "tpu-v4" in out
    assert "my-chip.toml" in err and "chip.flops_f32_per_s" in err


# -- errors: the message, exit status 2 --------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["run", "nope", *TINY], "unknown scenario 'nope'"),
    (["simulate", "nope", *TINY], "unknown scenario 'nope'"),
    (["run", "mlp", "--strategy", "dp", *TINY], "has no strategy 'dp'"),
    (["simulate", "mlp", "--strategy", "mp", "--size", "tiny", "--mesh", "batch=4"], "needs mesh axis 'model'"),
    (["show", "mlp", "--size", "tiny", "--mesh", "batch"], "not AXIS=SIZE"),
    (["run", "mlp", *TINY, "--set", "widht=4"], "has no size 'widht'"),
    (["simulate", "mlp", *TINY, "--hardware", "tpu-v9"], "no hardware spec named 'tpu-v9'"),
    (["simulate", "mlp", *TINY, "--placement", "model=q"], "'q' is not a physical dim"),
    (["simulate", "mlp", *TINY, "--algorithm", "carrier-pigeon"], "unknown collective algorithm 'carrier-pigeon'"),
    (["simulate", "mlp", *TINY, "--algorithm", "all_sum=ring"], "unknown collective kind 'all_sum'"),
    (["simulate", "mlp", *TINY, "--slice", "2xq"], "--slice '2xq'"),
    (["hardware", "tpu-v9"], "no hardware spec named 'tpu-v9'"),
])
def test_bad_input_exits_2_with_the_message(capsys, argv, needle):
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2
    assert f"partir-emu {argv[0]}: error:" in err and needle in err, err
    assert "Traceback" not in err


def test_hardware_module_does_not_import_jax():
    code = ("import sys, partir_emu.app.cli.simulate, partir_emu.app.cli.main; "
            "partir_emu.app.cli.main.build_parser(); print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# -- the console script ----------------------------------------------------------------------------
@pytest.mark.slow
def test_console_script(tmp_path):
    exe = Path(sys.executable).parent / "partir-emu"
    assert exe.exists(), exe
    path = tmp_path / "sim.json"
    p = subprocess.run([str(exe), "simulate", "mlp", "--strategy", "bp+mp", *TINY, "--hardware", "h100",
                        "--report", str(path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "h100" in p.stdout and "step" in p.stdout
    assert json.loads(path.read_text())["hardware"] == "h100"
    p = subprocess.run([str(exe), "simulate", "mlp", *TINY, "--hardware", "tpu-v9"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "no hardware spec named 'tpu-v9'" in p.stderr and "Traceback" not in p.stderr
