"""``partir-emu simulate-des``: the table, the JSON report, the trace, options and errors."""
from __future__ import annotations

import json

import pytest

from partir_emu.app.cli.main import main
from tests.integration.test_des_model import _check_chrome_trace


@pytest.mark.slow
def test_simulate_des_report_and_trace(tmp_path, capsys):
    rep, tr = tmp_path / "r.json", tmp_path / "t.json"
    rc = main(["simulate-des", "transformer", "--strategy", "bp+mp", "--mesh", "batch=2,model=4", "--size", "tiny",
               "--hardware", "tpu-v4", "--trace", str(tr), "--report", str(rep), "--straggler", "3:1.25",
               "--degrade-link", "0-1:0.5", "--overlap", "--progress"])
    cap = capsys.readouterr()
    assert rc == 0
    assert "DES (flow network, overlap)" in cap.out and "busiest links" in cap.out and "analytical:" in cap.out
    assert "DES [" in cap.err                                  # --progress forces the bar
    d = json.loads(rep.read_text())
    assert {"analytical_s", "des_s", "rel_err", "step_s", "collectives", "link_utilization"} <= set(d)
    assert d["rel_err"] < 0.05                  # both models see the straggler and the slow link (fault_options)
    assert len(d["faults"]) == 2 and d["options"]["stragglers"] == {"3": 1.25}
    _check_chrome_trace(json.loads(tr.read_text()), d["des_s"], [0, 3])


def test_simulate_des_chunk_network_and_algorithm(capsys):
    rc = main(["simulate-des", "mlp", "--strategy", "bp", "--mesh", "batch=8", "--size", "tiny", "--hardware", "h100",
               "--network", "chunk", "--chunk-bytes", "4096", "--algorithm", "ring", "--no-symmetry"])
    assert rc == 0 and "DES (chunk network" in capsys.readouterr().out


def test_simulate_des_bad_arguments(capsys):
    base = ["simulate-des", "mlp", "--strategy", "bp", "--mesh", "batch=4", "--size", "tiny"]
    assert main(base + ["--straggler", "x"]) == 2
    assert "DEVICE:FACTOR" in capsys.readouterr().err
    assert main(base + ["--fail-link", "0->9"]) == 2
    assert "no link 0->9" in capsys.readouterr().err
    assert main(base + ["--straggler", "7:2"]) == 2
    assert "straggler device 7" in capsys.readouterr().err
    assert main(base + ["--comm-streams", "0"]) == 2
