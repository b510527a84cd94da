"""``partir-emu study``'s grid and what-if edits (no lowering): the ``--set`` grid, the mesh
factorisations per chip count, the configurations' JSON round trip (what crosses to a worker),
what-if edits checked against the spec file's own numbers, every mistake a UsageError naming the
edit, and the ranking, Pareto front and CSV of priced rows."""
from __future__ import annotations

import csv
import io
import math

import pytest

from partir_emu.app.study.evaluate import Row
from partir_emu.app.study.output import pareto, to_csv
from partir_emu.app.study.pool import groups
from partir_emu.app.study.space import Config, grid, meshes, parse_chips, parse_set_grid, sample, strategies
from partir_emu.app.study.whatif import WhatIf, apply
from partir_emu.core.mesh import Mesh
from partir_emu.errors import UsageError
from partir_emu.hwmodels.machine.specs import find_spec, load_spec
from partir_emu.limits import load_toml


def test_set_grid_is_the_product_of_each_keys_values():
    assert parse_set_grid(None) == [None]
    assert parse_set_grid("microbatches=1,4,seq=2048") == ["microbatches=1,seq=2048", "microbatches=4,seq=2048"]
    assert parse_set_grid("a=1,2,b=x,y") == ["a=1,b=x", "a=1,b=y", "a=2,b=x", "a=2,b=y"]
    for bad in ("4,a=1", "a=", "=3"):
        with pytest.raises(UsageError, match="--set"):
            parse_set_grid(bad)


def test_meshes_are_every_factorisation_over_the_strategys_axes():
    mixed = meshes("bp+mp+z3", 24)
    assert [dict(m.axes) for m in mixed] == [{"batch": 24 // k, "model": k} for k in (2, 3, 4, 6, 8, 12)]
    assert all(m.size == 24 for m in mixed)
    assert [dict(m.axes) for m in meshes("bp+z3", 16)] == [{"batch": 16}]
    assert [dict(m.axes) for m in meshes("mp", 8)] == [{"model": 8}]
    assert meshes("bp+mp", 7) == []               # a prime has no two-axis factorisation: no such config


def test_grid_counts_and_strategy_all_leaves_the_searches_out():
    names = strategies("transformer", "all")
    assert "bp" in names and "bp+mp+z3" in names and not any("auto" in s for s in names)
    wi = [WhatIf.parse("ici_bw*2")]
    cfgs = grid("transformer", "tiny", "microbatches=1,2", "bp,bp+mp", "auto", [8], ["tpu-v4", "h100"], wi)
    # 2 set values x (bp: 1 mesh + bp+mp: 2 meshes (model 2, 4)) x 2 specs x 2 (as is, what-if)
    assert len(cfgs) == 2 * 3 * 2 * 2
    assert len(groups(cfgs)) == 2 * 3                 # each program lowered once, priced 4 times
    assert all(len(g) == 4 for g in groups(cfgs))
    with pytest.raises(UsageError, match="--chips"):
        grid("transformer", "tiny", None, "bp", "auto", None, ["tpu-v4"], [])
    with pytest.raises(UsageError, match="not among --chips"):
        grid("transformer", "tiny", None, "bp", "batch=8", [16], ["tpu-v4"], [])
    assert parse_chips("256,512") == [256, 512]
    with pytest.raises(UsageError, match="--chips '0'"):
        parse_chips("8,0")


def test_config_json_round_trips():
    cfgs = grid("transformer", "tiny", "batch=8", "bp+mp", "auto", [8], ["tpu-v4"],
                [WhatIf.parse("ici_bw*2,hbm_gb=64"), WhatIf.parse("flops*1.2345678")])
    for c in cfgs:
        assert Config.from_json(c.to_json()) == c


def test_sample_is_seeded_and_in_grid_order():
    cfgs = grid("transformer", "tiny", "batch=8,16,32", "bp,bp+mp", "auto", [8, 16], ["tpu-v4"], [])
    a, b = sample(cfgs, 5, seed=3), sample(cfgs, 5, seed=3)
    assert a == b and len(a) == 5 and a == sorted(a, key=cfgs.index)
    assert sample(cfgs, 5, seed=4) != a
    assert sample(cfgs, 10_000) == cfgs


def test_what_if_edits_match_the_spec_files_numbers():
    raw = load_toml(find_spec("tpu-v4"), Exception, "spec")
    base = load_spec("tpu-v4")
    s = apply("tpu-v4", WhatIf.parse("ici_bw*2,hbm_gb=64"))
    assert s.name == "tpu-v4[ici_bw*2,hbm_gb=64]"
    assert s.network.link_bw_bytes_per_s == 2 * raw["ici"]["link_bw_bytes_per_s"]
    assert s.hbm_bytes == 64 * 10 ** 9
    assert s.flops_bf16_per_s == base.flops_bf16_per_s        # untouched fields stay
    # edits compose (a sensitivity of a row that already doubled the field doubles it again)
    assert apply("tpu-v4", WhatIf.parse("flops*2,flops*2")).flops_bf16_per_s == 4 * base.flops_bf16_per_s
    # setting the bf16 rate keeps the f32 rate's ratio to it
    f = apply("h100", WhatIf.parse("flops=1e15"))
    h = load_spec("h100")
    assert f.flops_bf16_per_s == 1e15
    assert math.isclose(f.flops_f32_per_s, h.flops_f32_per_s * 1e15 / h.flops_bf16_per_s)
    # a GPU's "ici_bw" is its NVLink; a table.field is the file's own name
    assert apply("h100", WhatIf.parse("ici_bw*2")).network.nvlink_bw_bytes_per_s == 2 * h.network.nvlink_bw_bytes_per_s
    assert apply("tpu-v4", WhatIf.parse("ici.link_latency_s=1e-6")).network.link_latency_s == 1e-6


@pytest.mark.parametrize("text, hardware, match", [
    ("ici_bw", "tpu-v4", "FIELD\\*FACTOR"),
    ("ici_bw*0", "tpu-v4", "> 0"),
    ("ici_bw*-2", "tpu-v4", "> 0"),
    ("warp_speed*2", "tpu-v4", "no field of tpu-v4"),
    ("ib_latency*2", "tpu-v4", "a tpu spec .tpu-v4. has no such field"),
    ("chip.nonexistent*2", "tpu-v4", "no number at chip.nonexistent"),
])
def test_what_if_mistakes_name_the_edit(text, hardware, match):
    with pytest.raises(UsageError, match=match) as e:
        apply(hardware, WhatIf.parse(text))
    assert "--what-if" in str(e.value)


def _row(step: float, peak: float, status: str = "ok", chips: int = 8) -> Row:
    cfg = Config("transformer", "tiny", None, "bp", Mesh(batch=chips), "tpu-v4", WhatIf())
    figs = {"step_s": step, "peak_gib": peak, "chip_s": chips * step, "mfu": 0.5, "fits": status == "ok"}
    return Row(cfg, status, "", figs)


def test_pareto_front_keeps_only_the_rows_nothing_beats_on_both():
    rows = [_row(3.0, 1.0), _row(2.0, 2.0), _row(2.5, 3.0), _row(1.0, 4.0), _row(0.5, 9.0, "does not fit")]
    front = pareto(rows)
    assert [(r.figures["peak_gib"], r.figures["step_s"]) for r in front] == [(1.0, 3.0), (2.0, 2.0), (4.0, 1.0)]


def test_csv_has_a_row_per_configuration_with_its_inputs():
    rows = [_row(1.0, 2.0), Row(_row(0, 0).config, "does not lower", "heads=8 is not divisible")]
    got = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert len(got) == 2
    assert got[0]["strategy"] == "bp" and got[0]["mesh"] == "batch=8" and float(got[0]["step_s"]) == 1.0
    assert got[1]["status"] == "does not lower" and got[1]["step_s"] == "" and "heads" in got[1]["reason"]
