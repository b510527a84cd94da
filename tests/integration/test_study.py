"""``partir-emu study`` end to end on a small grid: every figure it reports, and so the best
configuration it prints, equals pricing each configuration one by one with
:func:`partir_emu.testing.predict` (a what-if checked against a spec file written with the edited
number, not against the edit code); the worker pool gives the same rows as one process; the
CSV, JSON and Pareto PNG are written; configurations that do not lower or do not fit are rows
with their reason, never dropped; the sensitivity of a row is the step of the spec with that field
doubled, priced on its own."""
from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from partir_emu.app.cli.main import main
from partir_emu.hwmodels.machine.specs import find_spec
from partir_emu.testing import predict

GRID = ["study", "transformer", "--size", "tiny", "--set", "batch=16", "--hardware", "tpu-v4,h100",
        "--chips", "8", "--strategy", "bp,bp+mp,bp+z3", "--what-if", "ici_bw*2", "--quiet"]


def _study(tmp_path: Path, name: str, *extra: str) -> dict:
    report = tmp_path / f"{name}.json"
    assert main([*GRID, "--report", str(report), *extra]) == 0
    return json.loads(report.read_text())


LINK_FIELD = {"tpu-v4": "link_bw_bytes_per_s", "h100": "nvlink_bw_bytes_per_s"}   # what "ici_bw" edits


def _edited_spec(tmp_path: Path, hardware: str, factor: float = 2.0) -> str:
    """``hardware``'s TOML with its chip-to-chip link bandwidth times ``factor`` by hand, marked a what-if."""
    text = Path(find_spec(hardware)).read_text()
    m = re.search(rf"^{LINK_FIELD[hardware]} = ([0-9.e]+)$", text, re.M)
    assert m, f"{hardware}.toml has {LINK_FIELD[hardware]} on one line"
    text = text.replace(m.group(0), f"{LINK_FIELD[hardware]} = {factor * float(m.group(1))!r}")
    path = tmp_path / f"{hardware}-link{factor:g}.toml"
    path.write_text("what_if = true\n" + text)
    return str(path)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("study")
    csv_path, png = tmp / "s.csv", tmp / "s.png"
    rep = _study(tmp, "one", "--jobs", "1", "--csv", str(csv_path), "--plot", str(png), "--sensitivity-top", "1")
    return rep, tmp


def test_every_figure_and_the_best_equal_pricing_one_by_one(one_process):
    rep, tmp = one_process
    rows = [r for r in rep["rows"] if r["status"] in ("ok", "does not fit")]
    # bp (batch=8), bp+z3 (batch=8), bp+mp (2 meshes) x 2 specs x 2 (as is, ici_bw*2)
    assert len(rep["rows"]) == 4 * 2 * 2 and len(rows) == len(rep["rows"])
    edited = {hw: _edited_spec(tmp, hw) for hw in LINK_FIELD}
    one_by_one = {}
    for r in rows:
        hw = r["hardware"] if r["what_if"] == "as is" else edited[r["hardware"]]
        p = predict("transformer", r["strategy"], r["mesh"], hw, size="tiny", set="batch=16")
        assert math.isclose(p.step_s, r["step_s"], rel_tol=1e-12), (r, p.step_s)
        assert math.isclose(p.peak_bytes / 2 ** 30, r["peak_gib"], rel_tol=1e-12)
        one_by_one[(r["hardware"], r["what_if"], r["strategy"], r["mesh"])] = p.step_s
    assert len(one_by_one) == 16
    best = min(one_by_one, key=one_by_one.get)
    priced = [r for r in rep["rows"] if (r["hardware"], r["what_if"], r["strategy"], r["mesh"]) in one_by_one]
    assert (priced[0]["hardware"], priced[0]["what_if"], priced[0]["strategy"], priced[0]["mesh"]) == best
    steps = [r["step_s"] for r in rep["rows"] if r["status"] == "ok"]
    assert steps == sorted(steps)                         # best first


def test_outputs_are_written(one_process):
    rep, tmp = one_process
    with open(tmp / "s.csv") as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rep["rows"]) and {"step_s", "hardware", "what_if", "mesh", "status"} <= set(got[0])
    assert (tmp / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sens = rep["rows"][0]["sensitivity"]
    assert set(sens) >= {"flops", "hbm_bw"} and all(isinstance(v, float) for v in sens.values())


def test_sensitivity_is_the_step_with_that_field_doubled(one_process):
    rep, tmp = one_process
    top = rep["rows"][0]
    factor = {"as is": 2.0, "ici_bw*2": 4.0}[top["what_if"]]          # a what-if row's edit composes
    spec = _edited_spec(tmp, top["hardware"], factor)
    p = predict("transformer", top["strategy"], top["mesh"], spec, size="tiny", set="batch=16")
    assert math.isclose(top["sensitivity"]["ici_bw"], p.step_s / top["step_s"] - 1, rel_tol=1e-9, abs_tol=1e-12)


def test_two_workers_give_the_same_rows(one_process, tmp_path):
    rep, _ = one_process
    pooled = _study(tmp_path, "two", "--jobs", "2", "--sensitivity-top", "1")
    strip = ("sensitivity",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in pooled["rows"]] == \
        [{k: v for k, v in r.items() if k not in strip} for r in rep["rows"]]
    assert pooled["rows"][0]["sensitivity"] == rep["rows"][0]["sensitivity"]


def test_infeasible_configurations_are_rows_with_their_reason(tmp_path, capsys):
    report = tmp_path / "s.json"
    assert main(["study", "transformer", "--size", "tiny", "--set", "batch=16", "--hardware", "tpu-v4",
                 "--chips", "8", "--strategy", "bp+mp", "--what-if", "hbm_gb=1e-6", "--jobs", "1", "--quiet",
                 "--sensitivity-top", "0", "--report", str(report)]) == 0
    rows = json.loads(report.read_text())["rows"]
    by = {(r["what_if"], r["mesh"]): r for r in rows}
    assert len(rows) == 4                                # model=2 and model=4, as is and with 1 kB of HBM
    small = [r for r in rows if r["what_if"] == "hbm_gb=1e-06"]
    assert all(r["status"] == "does not fit" and "GiB per device" in r["reason"] for r in small)
    assert by[("as is", "batch=4,model=2")]["status"] == "ok"
    out = capsys.readouterr().out
    assert "does not fit (needs" in out
    # the capacity alone changes what fits, not a time (the study reuses the as-is search and report):
    # each row equals the spec file with that capacity priced on its own
    text = Path(find_spec("tpu-v4")).read_text()
    small_spec = tmp_path / "tpu-v4-1kb.toml"
    small_spec.write_text("what_if = true\n" + re.sub(r"^hbm_bytes = \d+$", "hbm_bytes = 1000", text, flags=re.M))
    for r in small:
        p = predict("transformer", "bp+mp", r["mesh"], str(small_spec), size="tiny", set="batch=16")
        assert not p.fits and math.isclose(p.step_s, r["step_s"], rel_tol=1e-12), (r, p.step_s)
        assert r["step_s"] == by[("as is", r["mesh"])]["step_s"]


def test_a_mesh_that_does_not_lower_is_reported(tmp_path, capsys):
    # tiny has 4 heads: model=8 cannot shard whole heads
    assert main(["study", "transformer", "--size", "tiny", "--set", "batch=16", "--hardware", "tpu-v4",
                 "--mesh", "batch=2,model=4;batch=1,model=8", "--strategy", "bp+mp", "--jobs", "1", "--quiet",
                 "--sensitivity-top", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"batch=1,model=8 batch=16: does not lower: .*heads", out), out


def test_a_capacity_what_if_reuses_the_as_is_search_and_report():
    """``hbm_gb=...`` alone changes what fits, not a time: its configurations take the report of the
    same program on the spec as it is (``timing_twin``), with ``fits`` and the capacity its own;
    ``ici_bw*2`` is priced anew."""
    from partir_emu.app.study.evaluate import Study
    from partir_emu.app.study.space import grid
    from partir_emu.app.study.whatif import WhatIf

    configs = grid("transformer", "tiny", "batch=16", "bp", "batch=8", None, ["tpu-v4"],
                   [WhatIf.parse("hbm_gb=1e-6"), WhatIf.parse("ici_bw*2")])    # after the spec as it is
    study = Study()
    rows = study.run(configs)
    assert [r.config.what_if.label for r in rows] == ["as is", "hbm_gb=1e-06", "ici_bw*2"]
    assert len(study._twins) == 2                         # as is (reused by hbm_gb) and ici_bw*2
    as_is, small, fast = rows
    assert small.sim.step_s == as_is.sim.step_s and small.placement is as_is.placement
    assert as_is.sim.fits and not small.sim.fits and small.sim.hbm_bytes == 1000 and small.sim.spec.endswith("]")
    assert small.sim.placement == as_is.sim.placement.replace(" on tpu-v4 ", f" on {small.sim.spec} ")
    assert small.sim.topology.startswith(f"{small.sim.spec} ") and small.figures["placement"] == small.sim.placement
    assert fast.sim.step_s < as_is.sim.step_s
    # each configuration is priced with the cyclic collector paused: it runs again afterwards, and one
    # the caller paused stays paused (the same rows either way)
    import gc

    assert gc.isenabled()
    gc.disable()
    try:
        again = Study().run(configs[:1])
        assert not gc.isenabled() and again[0].to_json() == as_is.to_json()
    finally:
        gc.enable()
