"""Hardware spec files: the packaged ones, user files, and errors that name the file and field."""
from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from partir_emu.errors import SpecError
from partir_emu.hwmodels import list_specs, load_spec
from partir_emu.hwmodels.machine.specs import DATA_DIR, GpuClusterSpec, TorusSpec

PACKAGED = ["a100", "a100-40gb", "h100", "h200", "tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p"]

# (bf16 FLOP/s, HBM bytes, HBM B/s, link or NVLink B/s) from REFERENCE.md
REFERENCE = {
    "tpu-v3": (123e12, 32 * 2**30, 900e9, 1e11),
    "tpu-v4": (275e12, 32 * 2**30, 1200e9, 4.5e10),
    "tpu-v5e": (197e12, 16e9, 819e9, 4.5e10),
    "tpu-v5p": (459e12, 95e9, 2765e9, 9e10),
    "a100": (312e12, 80e9, 2.0e12, 300e9),
    "a100-40gb": (312e12, 40e9, 1.555e12, 300e9),      # NVIDIA A100 datasheet, the 40 GB SXM part
    "h100": (989e12, 80e9, 3.35e12, 450e9),
    "h200": (989e12, 141e9, 4.8e12, 450e9),
}


def test_packaged_specs_are_listed_and_load():
    assert set(PACKAGED) <= set(list_specs())
    for name in PACKAGED:
        s = load_spec(name)
        assert s.name == name
        flops, hbm, hbm_bw, link = REFERENCE[name]
        assert (s.flops_bf16_per_s, s.hbm_bytes, s.hbm_bw_bytes_per_s) == (flops, hbm, hbm_bw)
        net = s.network
        if s.kind == "tpu":
            assert isinstance(net, TorusSpec) and net.link_bw_bytes_per_s == link
        else:
            assert isinstance(net, GpuClusterSpec) and net.nvlink_bw_bytes_per_s == link
            assert net.gpus_per_node == 8


def test_topologies_of_packaged_specs():
    v3, v4, v5e, v5p = (load_spec(n).network for n in ("tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p"))
    assert (v3.pod_dims, v3.wraparound, v3.links_per_chip) == ((32, 32), "full", 4)
    assert (v4.pod_dims, v4.cube, v4.wraparound, v4.links_per_chip) == ((16, 16, 16), (4, 4, 4), "cube_multiple", 6)
    assert (v5e.pod_dims, v5e.wraparound) == ((16, 16), "full")
    assert v5p.max_chips == v5p.pod_chips == 8960 and len(v5p.pod_dims) == 3 and v5p.dcn.max_slices == 256
    assert load_spec("h100").network.fabric == "fat_tree"
    assert load_spec("h100", {"topology.fabric": "rail_optimized"}).network.fabric == "rail_optimized"


@pytest.mark.parametrize("name", PACKAGED)
def test_every_number_has_a_source(name):
    with open(DATA_DIR / f"{name}.toml", "rb") as f:
        data = tomllib.load(f)
    for table, fields in data.items():
        if not isinstance(fields, dict):
            continue
        for key, value in fields.items():
            if isinstance(value, (int, float, list)) and not isinstance(value, bool):
                assert isinstance(fields.get(f"{key}_source"), str), f"{name}: [{table}].{key} has no source"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(text)
    return p


def _user_spec(name: str = "my-tpu", **replace: str) -> str:
    src = (DATA_DIR / "tpu-v5e.toml").read_text().replace('name = "tpu-v5e"', f'name = "{name}"')
    for old, new in replace.items():
        src = src.replace(old, new)
    return src


def test_user_spec_by_path_and_by_search_path(tmp_path, monkeypatch):
    p = _write(tmp_path, "my-tpu", _user_spec())
    assert load_spec(p).name == "my-tpu"
    assert load_spec(str(p)).path == str(p)
    monkeypatch.setenv("PARTIR_EMU_HW_PATH", str(tmp_path))
    assert "my-tpu" in list_specs()
    assert load_spec("my-tpu").name == "my-tpu"


def test_unknown_spec_name_lists_known_ones():
    with pytest.raises(SpecError, match=r"no hardware spec named 'tpu-v9'.*tpu-v4.*PARTIR_EMU_HW_PATH"):
        load_spec("tpu-v9")
    with pytest.raises(SpecError, match="does not exist"):
        load_spec("/nonexistent/dir/x.toml")


@pytest.mark.parametrize("text, field, what", [
    (_user_spec(**{"hbm_bw_bytes_per_s = 819e9\n": ""}), "chip.hbm_bw_bytes_per_s", "is missing"),
    (_user_spec(**{"hbm_bytes = 16000000000": 'hbm_bytes = "16 GB"'}), "chip.hbm_bytes", "must be a positive integer"),
    (_user_spec(**{"link_latency_s = 1e-6": "link_latency_s = -1e-6"}), "ici.link_latency_s", "positive number"),
    (_user_spec(**{"pod_dims = [16, 16]": "pod_dims = 16"}), "topology.pod_dims", "list of positive integers"),
    (_user_spec(**{'wraparound = "full"': 'wraparound = "sometimes"'}), "topology.wraparound", "one of"),
    (_user_spec(**{"links_per_chip = 4": "links_per_chip = 4\nlink_count = 4"}), "ici.link_count", "unknown field"),
    (_user_spec(**{'kind = "tpu"': 'kind = "fpga"'}), "kind", "one of"),
    (_user_spec(**{'name = "my-tpu"\n': ""}), "name", "is missing"),
    (_user_spec(**{"[ici]": "[icy]"}), "[icy]", "unknown table"),
    (_user_spec(**{"flops_bf16_per_s_source = ": "flops_bf16_per_s_source = 1 #"}), "chip.flops_bf16_per_s_source",
     "must be a string"),
])
def test_bad_spec_errors_name_file_and_field(tmp_path, text, field, what):
    p = _write(tmp_path, "bad", text)
    with pytest.raises(SpecError) as info:
        load_spec(p)
    msg = str(info.value)
    assert str(p) in msg and field in msg and what in msg, msg


def test_missing_table_and_bad_toml(tmp_path):
    text = _user_spec()
    cut = text[:text.index("[ici]")] + text[text.index("[topology]"):]
    p = _write(tmp_path, "noici", cut)
    with pytest.raises(SpecError, match=r"noici.toml: table \[ici\] is missing.*link_bw_bytes_per_s"):
        load_spec(p)
    p = _write(tmp_path, "broken", "name = ")
    with pytest.raises(SpecError, match="broken.toml: not valid TOML"):
        load_spec(p)


def test_gpu_spec_checks(tmp_path):
    src = (DATA_DIR / "h100.toml").read_text()
    p = _write(tmp_path, "g", src.replace("nics_per_node = 8", "nics_per_node = 4"))
    with pytest.raises(SpecError, match=r"g.toml: field network.nics_per_node \(4\) must equal"):
        load_spec(p)
    p = _write(tmp_path, "g2", src.replace('fabric = "fat_tree"', 'fabric = "dragonfly"'))
    with pytest.raises(SpecError, match=r"g2.toml: field topology.fabric must be one of"):
        load_spec(p)


def test_kernels_measured_as_needs_its_source(tmp_path):
    src = (DATA_DIR / "a100-40gb.toml").read_text()
    no_source = "\n".join(ln for ln in src.splitlines() if not ln.startswith("kernels_measured_as_source"))
    with pytest.raises(SpecError, match=r"a40.toml: field kernels_measured_as_source is missing"):
        load_spec(_write(tmp_path, "a40", no_source))
    assert load_spec("a100-40gb").kernel_chip == "a100" and load_spec("a100").kernel_chip == "a100"


def test_cube_rule_needs_cube(tmp_path):
    src = (DATA_DIR / "tpu-v4.toml").read_text().replace("cube = [4, 4, 4]\n", "")
    with pytest.raises(SpecError, match=r"field topology.cube is missing"):
        load_spec(_write(tmp_path, "nocube", src))


def test_override_is_validated():
    with pytest.raises(SpecError, match=r"h100.toml: field topology.fabric must be one of"):
        load_spec("h100", {"topology.fabric": "torus"})
    assert load_spec("tpu-v4", {"chip.hbm_bytes": 1024}).hbm_bytes == 1024
    assert load_spec("tpu-v4").hbm_bytes == 32 * 2**30          # the cache is not polluted by overrides
