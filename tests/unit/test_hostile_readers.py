"""Every reader of a user file, fuzzed (issue 22, item 6): a message trace, a saved program, a
cases file, a hardware spec and the bounded JSON reader itself. Whatever the bytes (random JSON
values, near-misses of the real formats, huge numbers, deep nesting, binary junk), a reader
returns or raises a PartirError (exit 2 on the command line), never anything else, and returns
quickly. Pure: no jax."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partir_emu.app.validation.cases import parse_cases
from partir_emu.core.msgtrace import read_message_trace
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import ArtifactError, PartirError
from partir_emu.hwmodels.machine.specs import DATA_DIR, load_spec
from partir_emu.limits import MAX_INT_DIGITS, loads
from tests.conftest import wall

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
# per read: a real one takes milliseconds; the bound only tells a hang from a read, so it takes the
# suite's slack for a loaded machine (5 s failed once under OPENBLAS_CORETYPE=Prescott + two busy loops)
BOUND_S = wall(5.0)

HEAD = {"format": "partir-emu-message-trace", "version": 2, "mesh": [["batch", 4]], "devices": 4, "ranks": 4,
        "devices_per_rank": 1, "algorithm": "ring",
        "collectives": {"0": {"prim": "all_reduce", "axes": ["batch"], "bytes": 64, "itemsize": 4}}}
ROW = {"coll": 0, "step": 0, "src": 0, "dst": 1, "bytes": 16}
CASE = {"scenario": "mlp", "strategy": "bp", "hardware": "tpu-v4", "mesh": "batch=8"}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 80), 2 ** 80), st.floats(allow_nan=True),
                    st.text(max_size=12))
values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                      max_leaves=20)


def _mutated(base: dict) -> st.SearchStrategy[dict]:
    """``base`` with some fields replaced by random values, dropped, or added."""
    keys = sorted(base)
    return st.builds(lambda repl, drop, extra: {**{k: v for k, v in base.items() if k not in drop}, **repl, **extra},
                     st.dictionaries(st.sampled_from(keys), values, max_size=3),
                     st.sets(st.sampled_from(keys), max_size=2),
                     st.dictionaries(st.text(max_size=6), values, max_size=1))


def _timed(fn, *args):
    t0 = time.perf_counter()
    try:
        fn(*args)
    except PartirError:
        pass
    assert time.perf_counter() - t0 < BOUND_S


def _bomb_or_junk() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=200),
                     st.integers(1, 200_000).map(lambda n: b"[" * n),
                     st.integers(MAX_INT_DIGITS + 1, 6000).map(lambda n: b'{"a": ' + b"7" * n + b"}"),
                     st.sampled_from([b"NaN", b"-Infinity", b"1e400", b'{"a": 1e999}', b"", b"\xff\xfe", b"[1,"]))


@SETTINGS
@given(st.one_of(values.map(lambda v: json.dumps(v).encode()), _bomb_or_junk()))
def test_bounded_loads_returns_or_says_why(data):
    _timed(loads, data, "f.json: line 1", ArtifactError, "test file")


@SETTINGS
@given(_mutated(HEAD), st.lists(_mutated(ROW), max_size=3), _bomb_or_junk())
def test_message_trace_reader(tmp_path_factory, head, rows, junk):
    path = Path(tmp_path_factory.mktemp("trace")) / "t.jsonl"
    lines = [json.dumps(head)] + [json.dumps(r) for r in rows]
    for text in ("\n".join(lines) + "\n", "\n".join(lines[:1]) + "\n" + junk.decode("latin-1") + "\n"):
        path.write_text(text, encoding="utf-8")
        _timed(read_message_trace, path)


@SETTINGS
@given(st.one_of(values, _mutated({"format": "partir-emu-spmd", "version": 1, "mesh": [["batch", 2]],
                                   "program": {}})), _bomb_or_junk())
def test_saved_program_reader(d, junk):
    _timed(SpmdProgram.loads, json.dumps(d), "p.json")
    _timed(SpmdProgram.loads, junk, "p.json")


@SETTINGS
@given(st.lists(st.one_of(_mutated(CASE).map(json.dumps), _bomb_or_junk().map(lambda b: b.decode("latin-1"))),
                min_size=1, max_size=3))
def test_cases_reader(lines):
    _timed(parse_cases, lines, "cases.jsonl")


@SETTINGS
@given(st.sampled_from(["chip.flops_bf16_per_s", "ici.link_bw_bytes_per_s", "ici.link_latency_s",
                        "ici.links_per_chip", "topology.pod_dims", "chip.hbm_bytes", "name", "what_if"]),
       st.one_of(scalars, st.lists(st.integers(-3, 10 ** 6), max_size=4)))
def test_spec_reader(field, value):
    """Every field of a spec given any value: a spec or a SpecError (a PartirError)."""
    _timed(load_spec, DATA_DIR / "tpu-v4.toml", {field: value})


@SETTINGS
@given(st.one_of(_bomb_or_junk(), st.integers(1, 60_000).map(lambda n: b"q = " + b"{a=" * n + b"1" + b"}" * n),
                 st.integers(1, 6000).map(lambda n: b"[chip]\nhbm_bytes = " + b"9" * n),
                 st.text(max_size=300).map(str.encode)))
def test_toml_spec_file_reader(tmp_path_factory, junk):
    """A spec file of any bytes (junk, nesting bombs, long integers, random text) after a real spec's
    text: a spec or a SpecError, quickly."""
    path = tmp_path_factory.mktemp("toml") / "spec.toml"
    path.write_bytes((DATA_DIR / "tpu-v4.toml").read_bytes() + b"\n" + junk)
    _timed(load_spec, path)


def test_the_fuzz_would_see_a_crash():
    """The harness itself: an error that is not a PartirError is not swallowed."""
    with pytest.raises(ZeroDivisionError):
        _timed(lambda: 1 / 0)
