"""Bad input and faults: every bad command line exits 2 with one line on stderr and no traceback.

The catalogue (``CATALOGUE``) is one parametrized case per command line; each must fail with
exit status 2, exactly one line on stderr, no "Traceback", and — where the check is up-front,
i.e. before anything is lowered — within a few seconds. A hypothesis fuzz test throws random
argument lists (real subcommands and flags with junk values) at the CLI and asserts exit
0, 1 or 2 and no traceback. Then: exit status 3 for internal errors, atomic reports and
caches, the memory estimate, progress lines. All in-process (``partir_emu.app.cli.main.main``).
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partir_emu.app import checks
from partir_emu.app.atomic import write_json_atomic
from partir_emu.app.cli import main as cli
from partir_emu.app.cli.main import main
from partir_emu.app.cli.phases import Phases, announce
from partir_emu.app.common import experiment_from_args
from partir_emu.app.programs import ProgramCache
from partir_emu.app.validation.cases import Case, case_program
from partir_emu.compiler import api as compiler_api
from partir_emu.hwmodels.machine.specs import DATA_DIR

T = "--size tiny --mesh batch=2,model=2"


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    """A directory of bad (and a few good) input files."""
    d = tmp_path_factory.mktemp("bad")
    garbage = b"\xff\xfe\x00garbage\x80\x81\x00\x01"
    for name in ("garbage.toml", "garbage.jsonl", "garbage.npz", "garbage.json"):
        (d / name).write_bytes(garbage)
    (d / "adir").mkdir()
    (d / "afile").write_text("x")
    (d / "trunc.npz").write_bytes(b"PK\x03\x04trunc")
    np.savez(d / "wrongkeys.npz", a=np.zeros(3))
    np.savez(d / "obj.npz", a=np.array([{}], dtype=object))
    (d / "partial.toml").write_text('name = "x"\nkind = "tpu"\n')
    (d / "latin1.toml").write_bytes('name = "café"\nkind = "tpu"\n'.encode("latin-1"))
    (d / "notoml.toml").write_text("this is = = not toml [\n")
    (d / "list.jsonl").write_text("[1, 2]\n")
    (d / "types.jsonl").write_text('{"scenario": 5, "strategy": "bp", "hardware": "tpu-v4", "mesh": "batch=8"}\n')
    (d / "mesh.jsonl").write_text('{"scenario": "mlp", "strategy": "bp", "hardware": "tpu-v4", "mesh": 8}\n')
    (d / "empty.jsonl").write_text("\n# only a comment\n")
    (d / "badscenario.jsonl").write_text('{"scenario": "nope", "strategy": "bp", "hardware": "tpu-v4", '
                                         '"mesh": "batch=8"}\n')
    (d / "toobig.jsonl").write_text('{"scenario": "mlp", "strategy": "bp", "hardware": "tpu-v4", '
                                    '"mesh": "batch=100000", "preset": "tiny"}\n')
    (d / "unknownfield.jsonl").write_text('{"scenario": "mlp", "strategy": "bp", "hardware": "tpu-v4", '
                                          '"mesh": "batch=8", "colour": "red"}\n')
    (d / "badjson.jsonl").write_text('{"scenario": "mlp",\n')
    (d / "head.jsonl").write_text('{"format": "partir-emu-message-trace", "version": 2}\n')
    (d / "v1.jsonl").write_text('{"format": "partir-emu-message-trace", "version": 1}\n')
    (d / "notjson.jsonl").write_text("hello\n")
    (d / "empty").write_text("")
    (d / "badhw.jsonl").write_text('{"scenario": "mlp", "strategy": "bp", "hardware": "tpu-v9", "mesh": "batch=8"}\n')
    head = {"format": "partir-emu-message-trace", "version": 2, "mesh": [["batch", 2]], "devices": 2, "ranks": 2,
            "devices_per_rank": 1, "algorithm": "ring", "collectives": {}}
    row = '{"coll": 0, "step": 0, "src": 99, "dst": 1, "bytes": 4}\n'
    (d / "dpr0.jsonl").write_text(json.dumps({**head, "devices_per_rank": 0}) + "\n")
    (d / "src99.jsonl").write_text(json.dumps(head) + "\n" + row)
    # hostile files (issue 22): a nesting bomb, a 5,000-digit integer, 2**70 bytes, a 4096-device
    # all-reduce claimed with no transfer, NaN where a number belongs
    (d / "bomb.jsonl").write_text("[" * 100_000 + "\n")
    (d / "bombcase.jsonl").write_text('{"scenario": ' + "[" * 100_000 + "\n")
    (d / "digits.jsonl").write_text(json.dumps(head) + "\n" + row.replace("99", "9" * 5000))
    (d / "digitscase.jsonl").write_text('{"scenario": "mlp", "strategy": "bp", "hardware": "tpu-v4", '
                                        '"mesh": "batch=8", "comm_streams": ' + "9" * 5000 + '}\n')
    (d / "huge.jsonl").write_text(json.dumps(head) + "\n" + row.replace('"bytes": 4', f'"bytes": {2**70}'))
    (d / "nan.jsonl").write_text(json.dumps(head) + "\n" + row.replace('"bytes": 4', '"bytes": NaN'))
    claim = {**head, "mesh": [["batch", 4096]], "devices": 4096, "ranks": 4096,
             "collectives": {"0": {"prim": "all_reduce", "axes": ["batch"], "bytes": 1 << 20, "itemsize": 4}}}
    (d / "claim.jsonl").write_text(json.dumps(claim) + "\n")
    v4 = (DATA_DIR / "tpu-v4.toml").read_text()
    (d / "denormal.toml").write_text(v4.replace("link_bw_bytes_per_s = ", "link_bw_bytes_per_s = 1e-300 #", 1))
    hostile_specs = {           # issue 22: each was exit 3 (a parser's RecursionError or ValueError) or taken
        "deeparray": v4 + "\nx = " + "[" * 100_000 + "]" * 100_000 + "\n",
        "deepinline": v4 + "\nq = " + "{a=" * 50_000 + "1" + "}" * 50_000 + "\n",
        "digits": v4.replace("hbm_bytes = ", "hbm_bytes = " + "9" * 5000 + " #", 1),
        "int80": v4.replace("hbm_bytes = ", f"hbm_bytes = {2**80} #", 1),
        "poddims": re.sub(r"pod_dims = \[[^\]]*\]", "pod_dims = [4611686018427387904, 2, 2]", v4),
        "huge": v4 + "\n# " + "x" * (5 << 20) + "\n"}
    for name, text in hostile_specs.items():
        (d / f"{name}.toml").write_text(text)
    for name, n in (("hugemesh.jsonl", 10**9), ("bigmesh.jsonl", 8192)):
        (d / name).write_text(json.dumps({**head, "mesh": [["batch", n]], "devices": n}) + "\n")
    return d


# (argv with {d} for the directory above and {T} for a tiny mesh; needle in the message; up-front?)
CATALOGUE: list[tuple[str, str, bool]] = [
    # run: paths
    ("run mlp {T} --report {d}/missing/r.json", "does not exist", True),
    ("run mlp {T} --report {d}/adir", "is a directory", True),
    ("run mlp {T} --report {d}/afile/r.json", "is not a directory", True),
    ("run mlp {T} --inputs {d}/garbage.npz", "not an .npz", True),
    ("run mlp {T} --inputs {d}/trunc.npz", "not an .npz", True),
    ("run mlp {T} --inputs {d}/obj.npz", "pickles", True),
    ("run mlp {T} --inputs {d}/nope.npz", "no such file", True),
    ("run mlp {T} --inputs {d}/adir", "is a directory", True),
    ("run mlp {T} --inputs {d}/wrongkeys.npz", "neither the input names", False),
    ("run mlp {T} --trace-messages {d}/t.jsonl", "applies only with --backend mpi", True),
    ("run mlp {T} --backend mpi --trace-messages {d}/missing/t.jsonl", "does not exist", True),
    # run: numbers
    ("run mlp {T} --timeout nan", "not a finite number", True),
    ("run mlp {T} --timeout inf", "not a finite number", True),
    ("run mlp {T} --timeout -1", "more than 0", True),
    ("run mlp {T} --timeout 0", "more than 0", True),
    ("run mlp {T} --timeout abc", "not a number", True),
    ("run mlp {T} --seed -1", "between 0 and 2**63-1", True),
    ("run mlp {T} --seed x", "not an integer", True),
    ("run mlp {T} --seed 1e3", "not an integer", True),
    ("run mlp {T} --seed 99999999999999999999999", "between 0 and 2**63-1", True),
    ("run mlp {T} --devices 3", "--devices 3 but the mesh", True),
    ("run mlp {T} --devices 0", "at least 1", True),
    ("run mlp {T} --devices-per-rank 0", "at least 1", True),
    ("run mlp {T} --backend mpi --devices-per-rank 3", "does not divide", True),
    # run: names
    ("run mlp {T} --algorithm pigeon", "not a collective algorithm of the local backend", True),
    ("run mlp {T} --backend mpi --algorithm pigeon", "not a collective algorithm of the mpi backend", True),
    ("run mlp {T} --algorithm native", "not a collective algorithm of the local backend", True),
    ("run mlp {T} --backend gpu", "invalid choice", True),
    ("run nope {T}", "unknown scenario 'nope'", True),
    ("run mlp --strategy dp {T}", "has no strategy 'dp'", True),
    ("run mlp --size huge --mesh batch=2", "no size preset 'huge'", True),
    # run: sizes
    ("run mlp --size full --mesh batch=2,model=2", "simulation-only", True),
    ("run transformer --size t32 --mesh batch=2,model=2", "simulation-only", True),
    ("run transformer --size t48 --mesh batch=2,model=2", "simulation-only", True),
    ("run mlp --size tiny --mesh batch=8192", "at most 4,096", True),
    ("run mlp --size tiny --mesh batch=2 --set hidden=2000000000", "of memory", True),
    ("run mlp --size tiny --mesh batch", "not AXIS=SIZE", True),
    ("run mlp --size tiny --mesh batch=0", "size 0", True),
    ("run mlp --size tiny --mesh batch=-2", "batch", True),
    ("run mlp --size tiny --mesh batch=2,batch=2", "appears twice", True),
    ("run mlp {T} --set widht=4", "has no size 'widht'", True),
    ("run mlp {T} --set batch=0", "batch", True),
    ("run mlp {T} --set batch=x", "batch", True),
    ("simulate mlp --set batch=" + "9" * 4000, "is over 2,147,483,648", True),
    ("simulate mlp --set batch=" + str(2**70), "is over 2,147,483,648", True),
    ("run mlp {T} --set batch=4,hidden=8,batch=8", "'batch' is given twice", True),
    ("simulate transformer --set precision=bf16,precision=f32", "'precision' is given twice", True),
    ("run mlp {T} --devices-per-rank 2", "applies only with --backend mpi", True),
    # options that would do nothing here (issue 22: they were accepted and ignored)
    ("run mlp {T} --timeout 5", "--timeout 5 applies only with --backend mpi", True),
    ("simulate-des mlp {T} --chunk-bytes 4096", "applies only with --network chunk", True),
    ("simulate-des mlp {T} --trace-devices 3", "applies only with --trace", True),
    ("simulate-des mlp {T} --progress --quiet", "--progress applies only without --quiet", True),
    ("simulate mlp {T} --no-overlap --prefetch-bytes 0", "applies only with --overlap", True),
    ("simulate-des mlp {T} --no-overlap --prefetch-bytes 0", "applies only with --overlap", True),
    ("validate --suite quick --cases {d}/empty.jsonl", "--suite quick applies only without --cases", True),
    ("validate --progress --quiet", "--progress applies only without --quiet", True),
    ("validate --suite quick --plot {d}/scatter.qqq", "unknown image format .qqq", True),
    ("fidelity --plot {d}/scatter", "no suffix", True),
    ("simulate mlp --hardware {d}", "is a directory", True),
    ("simulate mlp --mesh " + ",".join(f"a{i}=1" for i in range(3000)), "at most 16 are supported", True),
    # run: argparse
    ("run", "the following arguments are required", True),
    ("run mlp --bogus-flag", "unrecognized arguments", True),
    ("run mlp {T} --report", "expected one argument", True),
    # show
    ("show mlp {T} --output {d}/missing/x.json", "does not exist", True),
    ("show mlp {T} --output {d}/adir", "is a directory", True),
    ("show mlp {T} --after-tactic -1", "0 or more", True),
    ("show mlp {T} --after-tactic x", "not an integer", True),
    ("show mlp --size tiny --mesh batch=2000000", "at most 1,048,576", True),
    ("show mlp {T} --after-tactic 9", "--after-tactic 9", False),
    # simulate
    ("simulate mlp {T} --top 0", "at least 1", True),
    ("simulate mlp {T} --top -5", "at least 1", True),
    ("simulate mlp {T} --report {d}/adir", "is a directory", True),
    ("simulate mlp {T} --report {d}/missing/r.json", "does not exist", True),
    ("simulate mlp {T} --hardware {d}/garbage.toml", "not a TOML file", True),
    ("simulate mlp {T} --hardware {d}/latin1.toml", "not a TOML file", True),
    ("simulate mlp {T} --hardware {d}/notoml.toml", "not valid TOML", True),
    ("simulate mlp {T} --hardware {d}/partial.toml", "table [chip] is missing", True),
    ("simulate mlp {T} --hardware {d}/nope.toml", "does not exist", True),
    ("simulate mlp {T} --hardware {d}/deeparray.toml", "nested too deeply", True),
    ("simulate mlp {T} --hardware {d}/deepinline.toml", "nested too deeply", True),
    ("simulate mlp {T} --hardware {d}/digits.toml", "4300 digits", True),
    ("simulate mlp {T} --hardware {d}/int80.toml", "field chip.hbm_bytes", True),
    ("simulate mlp {T} --hardware {d}/poddims.toml", "topology.pod_dims = 4611686018427387904", True),
    ("simulate mlp {T} --hardware {d}/huge.toml", "more than the 4,194,304", True),
    ("hardware {d}/deeparray.toml", "nested too deeply", True),
    ("simulate mlp {T} --hardware tpu-v9", "no hardware spec named 'tpu-v9'", True),
    ("simulate mlp --size tiny --mesh batch=1000000000", "at most 1,048,576", True),
    ("simulate mlp --size tiny --mesh batch=8192", "has at most 4,096 chips", True),
    ("simulate mlp {T} --algorithm carrier-pigeon", "unknown collective algorithm", True),
    ("simulate mlp {T} --algorithm all_sum=ring", "unknown collective kind", True),
    ("simulate mlp {T} --slice 2xq", "--slice '2xq'", True),
    ("simulate mlp {T} --slice 0x2", "--slice '0x2'", True),
    ("simulate mlp {T} --placement model=q", "not a physical dim", True),
    # simulate-des
    ("simulate-des mlp {T} --top 0", "at least 1", True),
    ("simulate-des mlp {T} --merge-window nan", "not a finite number", True),
    ("simulate-des mlp {T} --message-overhead -1", "0 or more", True),
    ("simulate-des mlp {T} --chunk-bytes 0", "at least 1", True),
    ("simulate-des mlp {T} --comm-streams 0", "at least 1", True),
    ("simulate-des mlp {T} --trace-devices 0", "at least 1", True),
    ("simulate-des mlp {T} --trace {d}/missing/t.json", "does not exist", True),
    ("simulate-des mlp {T} --report {d}/adir", "is a directory", True),
    ("simulate-des mlp {T} --degrade-link 0->1:nan", "LINK:FACTOR", True),
    ("simulate-des mlp {T} --straggler 0:-1", "slow-down factor > 0", False),
    ("simulate-des mlp {T} --straggler x", "DEVICE:FACTOR", True),
    ("simulate-des mlp {T} --straggler 0:inf", "DEVICE:FACTOR", True),
    ("simulate-des mlp {T} --network pigeon", "invalid choice", True),
    ("simulate-des mlp --size tiny --mesh batch=2000000", "at most 1,048,576", True),
    # validate
    ("validate --cases {d}/garbage.jsonl", "not a text file", True),
    ("validate --cases {d}/list.jsonl", "not a JSON object", True),
    ("validate --cases {d}/types.jsonl", "field 'scenario' is 5", True),
    ("validate --cases {d}/mesh.jsonl", "field 'mesh' is 8", True),
    ("validate --cases {d}/badjson.jsonl", "not JSON", True),
    ("validate --cases {d}/adir", "is a directory", True),
    ("validate --cases {d}/nope.jsonl", "no such file", True),
    ("validate --cases {d}/empty.jsonl", "no cases", True),
    ("validate --cases {d}/badscenario.jsonl", "unknown scenario 'nope'", True),
    ("validate --cases {d}/toobig.jsonl", "at most 4096 chips", True),
    ("validate --cases {d}/unknownfield.jsonl", "unknown field 'colour'", True),
    ("validate --cases {d}/badhw.jsonl", "no hardware spec named 'tpu-v9'", True),
    ("validate --suite nope", "unknown validation suite 'nope'", True),
    ("validate --plot {d}/missing/p.png", "does not exist", True),
    ("validate --report {d}/adir", "is a directory", True),
    ("validate --cache {d}/afile", "not a directory", True),
    # replay
    ("replay {d}/garbage.jsonl", "not a message trace", True),
    ("replay {d}/head.jsonl", "the header has no 'mesh'", True),
    ("replay {d}/v1.jsonl", "version 1", True),
    ("replay {d}/notjson.jsonl", "not JSON", True),
    ("replay {d}/empty", "not JSON", True),
    ("replay {d}/adir", "is a directory", True),
    ("replay {d}/dpr0.jsonl", "'devices_per_rank' must be a positive integer", True),
    ("replay {d}/src99.jsonl", "a device outside 0..1", True),
    ("simulate mlp --hardware {d}/denormal.toml", "ici.link_bw_bytes_per_s = 1e-300 is outside the sensible", True),
    ("replay {d}/bomb.jsonl", "nested too deeply", True),
    ("replay {d}/digits.jsonl", "an integer of 5000 digits", True),
    ("replay {d}/huge.jsonl", "an integer of 22 digits", True),
    ("replay {d}/nan.jsonl", "NaN is not a JSON number", True),
    ("replay {d}/claim.jsonl", "needs at least 4096 transfers, the trace has 0", True),
    ("validate --cases {d}/bombcase.jsonl", "nested too deeply", True),
    ("validate --cases {d}/digitscase.jsonl", "an integer of 5000 digits", True),
    ("replay {d}/hugemesh.jsonl", "at most 1,048,576", True),
    ("replay {d}/bigmesh.jsonl", "has at most 4,096 chips", True),
    ("replay {d}/nope.jsonl", "no such file", True),
    ("replay {d}/head.jsonl --report {d}/adir", "is a directory", True),
    # paths that are no paths
    ("validate --cases {empty}", "the path is empty", True),
    ("validate --cache {empty}", "the path is empty", True),
    ("show mlp {T} --output {empty}", "the path is empty", True),
    ("run mlp {T} --inputs {empty}", "the path is empty", True),
    ("replay {long}", "File name too long", True),
    ("simulate mlp {T} --report {long}", "File name too long", True),
    ("hardware {long}", "no hardware spec named", True),
    # hardware, top level
    ("hardware {d}/garbage.toml", "not a TOML file", True),
    ("hardware {d}/partial.toml", "table [chip] is missing", True),
    ("hardware tpu-v9", "no hardware spec named 'tpu-v9'", True),
    ("", "the following arguments are required: COMMAND", True),
    ("frobnicate", "invalid choice", True),
]


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _argv(template: str, d: Path) -> list[str]:
    # "" and a 5000-character name are single arguments: split on spaces first, then substitute
    return [part.format(d=d, T=T, empty="", long="x" * 5000) for part in template.split()
            for part in ([part] if part != "{T}" else T.split())]


def test_the_catalogue_is_large_enough():
    assert len(CATALOGUE) >= 60
    assert len({c[0] for c in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("template, needle, up_front", CATALOGUE, ids=[c[0].replace("{d}/", "") or "(none)"
                                                                      for c in CATALOGUE])
def test_bad_command_line_exits_2_with_one_line(capsys, monkeypatch, d, template, needle, up_front):
    lowered: list[str] = []
    if up_front:     # the check must come before any lowering: a lowering now is recorded
        real = compiler_api.partition
        monkeypatch.setattr(compiler_api, "partition", lambda *a, **k: lowered.append("lowered") or real(*a, **k))
    rc, _, err = run_cli(capsys, _argv(template, d))
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert needle in err, err
    assert lines[0].startswith("partir-emu")
    assert not lowered, "the check should come before any lowering"


def test_hardware_lists_the_good_specs_and_one_line_per_bad_file(capsys, tmp_path, monkeypatch):
    (tmp_path / "junk.toml").write_bytes(b"\xff\xfe\x00\x80")
    (tmp_path / "dir.toml").mkdir()
    monkeypatch.setenv("PARTIR_EMU_HW_PATH", str(tmp_path))
    rc, out, err = run_cli(capsys, ["hardware"])
    assert rc == 2
    assert "tpu-v4" in out and "h100" in out
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert any("junk.toml" in line and "not a TOML file" in line for line in lines), err
    assert all(line.startswith("partir-emu hardware: error:") for line in lines)


# -- fuzz ------------------------------------------------------------------------------------------------
_JUNK = ["", "x", "-1", "0", "1", "nan", "inf", "-inf", "1e999", "3.5", "99999999999999999999", "é", "\x00",
         "batch", "=", ",", "--", "-", "batch=2", "a=b=c", "../../etc/passwd", "%s", "{}", "null"]
_SUBCOMMANDS: dict[str, list[str]] = {
    "run": ["--strategy", "--mesh", "--size", "--set", "--seed", "--backend", "--algorithm", "--devices",
            "--devices-per-rank", "--timeout", "--trace-messages", "--inputs", "--report", "--quiet"],
    "show": ["--strategy", "--mesh", "--size", "--set", "--seed", "--after-tactic", "--all", "--output"],
    "simulate": ["--strategy", "--mesh", "--size", "--set", "--hardware", "--placement", "--slice", "--overlap",
                 "--algorithm", "--top", "--report"],
    "simulate-des": ["--strategy", "--mesh", "--size", "--hardware", "--network", "--chunk-bytes",
                     "--comm-streams", "--straggler", "--message-overhead", "--merge-window", "--degrade-link",
                     "--fail-link", "--top", "--report", "--trace", "--trace-devices"],
    "validate": ["--cases", "--report", "--plot", "--cache"],
    "replay": ["--hardware", "--placement", "--slice", "--report"],
    "hardware": ["--json"],
    "list": [],
}
_REAL_VALUES = ["mlp", "transformer", "bp", "mp", "bp+mp", "z3", "tiny", "batch=2", "batch=2,model=2",
                "model=2", "batch=4", "tpu-v4", "h100", "ring", "direct", "native", "local", "mpi", "2", "8",
                "all_reduce=ring", "2x2x1", "flow", "chunk", "0:1.5", "0->1:0.5", "batch=3"]


def _path_values(d: Path) -> list[str]:
    return [str(d / n) for n in ("garbage.toml", "garbage.jsonl", "garbage.npz", "adir", "nope",
                                 "missing/x.json", "head.jsonl", "list.jsonl", "partial.toml", "afile")]


@st.composite
def _argvs(draw, d: Path) -> list[str]:
    cmd = draw(st.sampled_from(sorted(_SUBCOMMANDS)))
    values = st.sampled_from(_JUNK + _REAL_VALUES + _path_values(d)) | st.text(max_size=8)
    argv = [cmd]
    if cmd in ("run", "show", "simulate", "simulate-des"):
        argv.append(draw(st.sampled_from(["mlp", "nope", ""] + (["transformer"] if cmd != "run" else []))))
        argv += ["--size", "tiny"]                       # keep the rare valid command cheap ...
    if cmd == "replay":
        argv.append(draw(st.sampled_from(_path_values(d))))
    if cmd == "validate":
        argv += ["--cases", draw(st.sampled_from(_path_values(d)))]   # ... and never the whole default suite
    flags = _SUBCOMMANDS[cmd] + ["--bogus"]
    for _ in range(draw(st.integers(0, 4))):
        flag = draw(st.sampled_from(flags))
        if flag == "--size":
            continue
        argv.append(flag)
        if draw(st.booleans()) or flag not in ("--quiet", "--all", "--overlap", "--json"):
            argv.append(draw(values))
    if cmd in ("run", "show", "simulate", "simulate-des") and "--mesh" not in argv:
        argv += ["--mesh", draw(st.sampled_from(["batch=2", "batch=2,model=2", "model=2", "batch=0", "x"]))]
    return argv


@pytest.mark.slow
def test_fuzz_the_command_line(d, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)         # junk values may name files and directories: make them here
    @settings(max_examples=50, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_argvs(d))
    def fuzz(argv: list[str]) -> None:
        capsys.readouterr()
        rc = main(argv)
        _, err = capsys.readouterr()
        assert rc in (0, 1, 2), (argv, rc, err)
        assert "Traceback" not in err, (argv, err)
        if rc == 2:
            assert len([line for line in err.splitlines() if line.strip()]) == 1, (argv, err)

    fuzz()


# -- exit status 3, --help -------------------------------------------------------------------------------
def test_internal_error_exits_3_with_one_line(capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("something inside broke\nacross two lines")

    monkeypatch.setattr(cli, "cmd_list", boom)
    monkeypatch.delenv("PARTIR_EMU_DEBUG", raising=False)
    rc, _, err = run_cli(capsys, ["list"])
    assert rc == 3
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "internal error: RuntimeError: something inside broke across two lines" in err
    assert "PARTIR_EMU_DEBUG=1" in err and "in boom" in err
    monkeypatch.setenv("PARTIR_EMU_DEBUG", "1")
    rc, _, err = run_cli(capsys, ["list"])
    assert rc == 3 and "Traceback" in err and err.strip().splitlines()[-1].startswith("partir-emu list:")


def test_help_documents_the_exit_statuses(capsys):
    rc, out, _ = run_cli(capsys, ["--help"])
    assert rc == 0
    assert "exit status" in out and "bad input" in out and "internal error" in out and "PARTIR_EMU_DEBUG" in out


# -- memory -----------------------------------------------------------------------------------------------
def test_run_is_refused_before_lowering_when_inputs_cannot_fit(capsys, monkeypatch):
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 1024)
    rc, _, err = run_cli(capsys, ["run", "mlp", *T.split()])
    assert rc == 2 and "needs about" in err and "1.0 KiB available" in err and "partir-emu simulate" in err


def test_run_is_refused_from_the_lowered_program_estimate(capsys, monkeypatch):
    args = cli.build_parser().parse_args(["run", "mlp", *T.split()])
    exp = experiment_from_args(args)
    lower_bound = 2 * checks.input_bytes(exp)
    need, parts = checks.run_memory_bytes(exp.lower().spmd, exp.mesh.size)
    assert need > lower_bound and parts["devices"] > 0
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: lower_bound + 1)
    rc, _, err = run_cli(capsys, ["run", "mlp", *T.split()])
    assert rc == 2 and "peak per device × 4 devices" in err, err


def test_available_memory_is_read_from_proc_meminfo():
    avail = checks.available_memory_bytes()
    assert avail is None or avail > 0


# -- atomic files -------------------------------------------------------------------------------------------
def test_concurrent_report_writers_never_leave_invalid_json(tmp_path):
    path = tmp_path / "r.json"
    big = {f"k{i}": list(range(200)) for i in range(50)}
    bad: list[str] = []
    stop = threading.Event()

    def writer(tag: int) -> None:
        for _ in range(40):
            write_json_atomic(path, {"tag": tag, **big})

    def reader() -> None:
        while not stop.is_set():
            if path.exists():
                try:
                    json.loads(path.read_text())
                except ValueError as exc:
                    bad.append(str(exc))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    assert not bad
    assert json.loads(path.read_text())["tag"] in (0, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]       # no temp file left behind


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"old": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"new": object()})
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_bad_cache_entry_is_relowered_with_one_warning(tmp_path, capsys):
    """Truncated, not JSON, edited (its hash no longer matches), written for another program, or
    edited with its hash made to match (a program for another mesh, a dtype that is not jax's, an
    input the scenario does not have): each is named in one warning and lowered again, and the entry
    is rewritten whole."""
    case = Case("mlp", "bp", "tpu-v4", "batch=2", preset="tiny")
    first = case_program(case, ProgramCache(tmp_path))
    (entry,) = tmp_path.glob("*.json")
    good = entry.read_text()
    other = json.loads(good)
    other["key"]["strategy"] = "mp"
    edited = json.loads(good)
    edited["program"] = edited["program"].replace('"batch"', '"batch" ', 1)

    def rehashed(edit) -> str:
        """``good`` with its program edited by ``edit`` and the SHA-256 made to match: only the
        program's own checks can tell."""
        entry_ = json.loads(good)
        prog = json.loads(entry_["program"])
        edit(prog)
        entry_["program"] = json.dumps(prog)
        entry_["sha256"] = hashlib.sha256(entry_["program"].encode()).hexdigest()
        return json.dumps(entry_)

    def dtype(name):
        return lambda p: p["inputs"][0]["var"].__setitem__(2, name)

    def other_mesh(p):          # the cache entry of issue 22: a program lowered for another mesh
        p["mesh"] = [["batch", 4]]

    def renamed(p):
        p["inputs"][0]["name"] = "params/nope"

    for bad, why in ((good[:100], ""), ("\xff\x00", ""), (json.dumps(other), "another program"),
                     (json.dumps(edited), "SHA-256"), (rehashed(other_mesh), "lowered for another mesh"),
                     (rehashed(dtype("object")), "not an array dtype"), (rehashed(dtype("('<f4', (2,))")), "not an array dtype"),
                     (rehashed(dtype("V8")), "not an array dtype"), (rehashed(renamed), "not the scenario's")):
        entry.write_text(bad)
        again = case_program(case, ProgramCache(tmp_path))
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "ignoring the program cache entry" in err and why in err, err
        assert again.dumps() == first.dumps()
        assert json.loads(entry.read_text()) == json.loads(good)          # rewritten whole
    cache = ProgramCache(tmp_path)
    assert case_program(case, cache).dumps() == first.dumps() and (cache.hits, cache.misses) == (1, 0)
    assert not capsys.readouterr().err


def test_show_output_and_simulate_report_are_written_whole(capsys, tmp_path):
    out = tmp_path / "prog.json"
    rc, _, _ = run_cli(capsys, ["show", "mlp", *T.split(), "--output", str(out)])
    assert rc == 0 and json.loads(out.read_text())
    rep = tmp_path / "sim.json"
    rc, _, _ = run_cli(capsys, ["simulate", "mlp", *T.split(), "--report", str(rep)])
    assert rc == 0 and json.loads(rep.read_text())["devices"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prog.json", "sim.json"]


# -- progress -----------------------------------------------------------------------------------------------
def test_progress_shows_phases_only_after_the_delay():
    buf = StringIO()
    with Phases("run", stream=buf, force=True, delay_s=0.05) as ph:
        ph.phase("lowering")
        assert buf.getvalue() == ""
        time.sleep(0.3)
        announce("step")
    lines = buf.getvalue().splitlines()
    assert [line.split(" …")[0] for line in lines] == ["partir-emu run: lowering", "partir-emu run: step"]


def test_progress_is_quiet_off_a_terminal_or_with_quiet():
    buf = StringIO()            # not a tty
    with Phases("run", stream=buf, delay_s=0.0) as ph:
        ph.phase("lowering")
        time.sleep(0.05)
    assert buf.getvalue() == ""
    assert not Phases("run", quiet=True, stream=sys.stderr).enabled


def test_spec_data_files_are_all_valid():
    assert len(list(DATA_DIR.glob("*.toml"))) >= 7


def test_a_what_if_spec_beyond_hardware_still_writes_strict_json(tmp_path, capsys):
    """what_if = true skips the ranges; the report is strict JSON even where a figure is infinite."""
    spec = tmp_path / "slow.toml"
    text = (DATA_DIR / "tpu-v4.toml").read_text().replace("link_bw_bytes_per_s = ", "link_bw_bytes_per_s = 1e-300 #", 1)
    spec.write_text("what_if = true\n" + text)
    report = tmp_path / "r.json"
    assert main(["simulate", "mlp", "--size", "tiny", "--mesh", "batch=4", "--hardware", str(spec),
                 "--report", str(report)]) == 0
    capsys.readouterr()

    def refuse(token: str) -> float:
        raise AssertionError(f"bare {token} in the report")

    data = json.loads(report.read_text(), parse_constant=refuse)
    assert data["step_s"] == "Infinity" or data["step_s"] > 1e6    # seconds: an absurd link, said as it is


def test_big_endian_inputs_are_the_same_numbers(tmp_path, capsys):
    """An .npz written on a big-endian machine holds the same float32 values in the other byte order:
    it runs, with the outputs of the native file (it used to be refused as "expected float32[32],
    got float32[32]")."""
    from partir_emu.app.experiment import flatten
    from scenarios import get_scenario, resolve_size
    sc = get_scenario("mlp")
    cfg = resolve_size(sc, "tiny")
    arrays = {n: np.asarray(x) for n, x in zip(sc.input_names(cfg), flatten(sc.make_inputs(cfg, 0)))}
    np.savez(tmp_path / "native.npz", **arrays)
    np.savez(tmp_path / "big.npz", **{n: x.astype(x.dtype.newbyteorder(">")) for n, x in arrays.items()})
    reports = []
    for name in ("native", "big"):
        report = tmp_path / f"{name}.json"
        rc, _, err = run_cli(capsys, ["run", "mlp", "--size", "tiny", "--mesh", "batch=2", "--inputs",
                                      str(tmp_path / f"{name}.npz"), "--report", str(report)])
        assert rc == 0, err
        reports.append(json.loads(report.read_text()))
    assert reports[0]["verified"] and reports[1]["verified"]
    assert reports[0]["max_abs_err"] == reports[1]["max_abs_err"]
