"""An output never destroys an input (issue 22, item 1): ``--report`` (or any other output) that is
the command's own input, a device, a FIFO or another output is refused before any work, with exit
2 and one line; a report through a symlink writes the link's target and keeps the link.

Each case checks the file it must not touch byte for byte (or its file type) afterwards.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from partir_emu.app.atomic import write_text_atomic
from partir_emu.app.cli.main import main
from partir_emu.errors import UsageError

pytestmark = pytest.mark.xdist_group("outputs")

ROOT = Path(__file__).resolve().parents[2]
SIM = ["simulate", "mlp", "--size", "tiny", "--strategy", "bp", "--mesh", "batch=2", "--quiet"]


def _refused(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def test_report_over_the_hardware_spec_it_reads_is_refused(tmp_path, capsys):
    spec = tmp_path / "my.toml"
    shutil.copy(ROOT / "partir_emu" / "hwmodels" / "data" / "tpu-v4.toml", spec)
    before = spec.read_bytes()
    _refused(capsys, [*SIM, "--hardware", str(spec), "--report", str(spec)], "--report", "--hardware", "replace it")
    assert spec.read_bytes() == before


def test_report_over_the_cases_file_is_refused(tmp_path, capsys):
    cases = tmp_path / "c.jsonl"
    cases.write_text('{"scenario": "mlp", "strategy": "bp", "hardware": "tpu-v4", "mesh": "batch=2", "preset": "tiny"}\n')
    before = cases.read_bytes()
    _refused(capsys, ["validate", "--cases", str(cases), "--report", str(cases)], "--cases")
    assert cases.read_bytes() == before


def test_report_over_the_inputs_file_is_refused(tmp_path, capsys):
    inputs = tmp_path / "x.npz"
    np.savez(inputs, a=np.zeros(3))
    before = inputs.read_bytes()
    _refused(capsys, ["run", "mlp", "--strategy", "bp", "--mesh", "batch=2", "--inputs", str(inputs),
                      "--report", str(inputs)], "--inputs")
    assert inputs.read_bytes() == before


def test_an_input_reached_through_a_symlink_is_still_the_input(tmp_path, capsys):
    spec = tmp_path / "my.toml"
    shutil.copy(ROOT / "partir_emu" / "hwmodels" / "data" / "tpu-v4.toml", spec)
    link = tmp_path / "report.json"
    link.symlink_to(spec)
    before = spec.read_bytes()
    _refused(capsys, [*SIM, "--hardware", str(spec), "--report", str(link)], "--hardware")
    assert spec.read_bytes() == before and link.is_symlink()


@pytest.mark.parametrize("device", ["/dev/null", "/dev/full"])
def test_a_device_is_refused_and_left_a_device(device, capsys):
    if not os.path.exists(device):
        pytest.skip(f"{device} does not exist here")
    _refused(capsys, [*SIM, "--report", device], "is a device")
    assert stat.S_ISCHR(os.stat(device).st_mode)


def test_a_fifo_is_refused(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _refused(capsys, [*SIM, "--report", str(fifo)], "FIFO")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_two_outputs_on_one_file_are_refused(tmp_path, capsys):
    out = tmp_path / "o.json"
    _refused(capsys, ["validate", "--suite", "quick", "--report", str(out), "--plot", str(out)], "same file")
    assert not out.exists()


def test_a_report_through_a_symlink_writes_the_target_and_keeps_the_link(tmp_path, capsys):
    target = tmp_path / "real.json"
    target.write_text("{}\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert main([*SIM, "--report", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["scenario"] == "mlp"


def test_the_atomic_writer_itself_refuses_a_device():
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    with pytest.raises(UsageError, match="is a device"):
        write_text_atomic("/dev/null", "x")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
