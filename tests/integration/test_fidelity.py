"""``partir-emu fidelity``: the data file of published measurements, the FLOP conventions, the report,
and the accuracy the issue asks for on the five required cases (median |error| <= 5 %, max <= 12 %).

The required cases are lowered once per test session (``required_report``); everything else runs on
tiny configurations from a data file written here.
"""
from __future__ import annotations

import functools
import json
import math
import os
import statistics

import pytest

from partir_emu.app.cli.main import main
from partir_emu.app.programs import ProgramCache
from partir_emu.app.validation.fidelity import MAX_TARGET_PCT, MEDIAN_TARGET_PCT, run_cases
from partir_emu.app.validation.fidelity_data import CONVENTIONS, FidelityDataError, load_cases, select
from partir_emu.core.mesh import Mesh
from partir_emu.errors import PartirError
from partir_emu.hwmodels.machine.specs import load_spec
from scenarios import get_scenario
from tests.conftest import PROGRAMS_ENV

pytestmark = pytest.mark.xdist_group("fidelity")    # its cached programs and references: made once, on one worker


@functools.cache
def shared():
    """One program cache (the session's directory: lowered once) and one Analyzer for every test here
    that prices the published runs: lowering and analysing them is most of these tests' time."""
    from partir_emu.hwmodels.analytical import Analyzer
    return ProgramCache(os.environ.get(PROGRAMS_ENV)), Analyzer()

REQUIRED = ("megatron-1.7b", "megatron-7.5b", "megatron-22b", "maxtext-22b-v4", "maxtext-32b-v5e")

TINY_CASE = """
[[case]]
case = "tiny-{n}"
group = "{group}"
source = "made up for the test: {n}"
hardware = "tpu-v4"
chips = 2
strategy = "bp"
mesh = {{ batch = 2 }}
global_batch = 8
set = {{ batch = 8, seq = 8, d_model = 16, heads = 4, d_ff = 32, layers = 2, vocab = 32, remat = 0 }}
measured = {measured}
metric = "{metric}"
convention = "{convention}"
stack = "xla"
"""


def tiny_data(tmp_path, *cases: dict) -> str:
    path = tmp_path / "cases.toml"
    path.write_text("".join(TINY_CASE.format(**c) for c in cases))
    return str(path)


# -- the data file ------------------------------------------------------------------------------------
def test_data_file_parses_and_every_case_is_sourced():
    cases = load_cases()
    assert [c.case for c in cases if c.group == "required"] == list(REQUIRED)
    for c in cases:
        assert len(c.source) > 20 and any(ch.isdigit() for ch in c.source), c.case   # a citation with a date/table
        assert c.convention in CONVENTIONS and CONVENTIONS[c.convention].metric == c.metric
        assert c.measured > 0 and c.chips == math.prod(dict(c.mesh).values())
        assert dict(c.set)["batch"] == c.global_batch
        load_spec(c.hardware)
        sc = get_scenario(c.scenario)
        assert c.strategy in sc.strategies or sc.strategies.compose(c.strategy), c.case   # composed on request
        sc.strategy(c.strategy, Mesh(**dict(c.mesh)), sc.config(None, c.overrides))   # pp needs the config


def test_required_cases_match_the_issue_table():
    by = {c.case: c for c in load_cases()}
    for name, hw, chips, measured, metric in (("megatron-1.7b", "a100", 32, 137, "tflops_per_chip"),
                                              ("megatron-7.5b", "a100", 128, 142, "tflops_per_chip"),
                                              ("megatron-22b", "a100", 8, 1.42, "step_s"),
                                              ("maxtext-22b-v4", "tpu-v4", 64, 156, "tflops_per_chip"),
                                              ("maxtext-32b-v5e", "tpu-v5e", 256, 132, "tflops_per_chip")):
        c = by[name]
        assert (c.hardware, c.chips, c.measured, c.metric) == (hw, chips, measured, metric)
    assert dict(by["megatron-7.5b"].mesh) == {"batch": 32, "model": 4}
    assert dict(by["maxtext-32b-v5e"].set)["head_dim"] == 256


# -- the conventions ----------------------------------------------------------------------------------
def test_megatron_convention_by_hand():
    # arXiv 2104.04473 Table 1 row 1: 1.7B, h 2304, 24 layers, batch 512, s 2048, V 51200, 137 TFLOP/s on 32 GPUs
    B, s, layers, h, V = 512, 2048, 24, 2304, 51200
    F = 96 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (16 * layers * h))
    assert F == pytest.approx(1.5467e16, rel=1e-4)
    by = {c.case: c for c in load_cases()}
    c = by["megatron-1.7b"]
    cfg = dict(c.set)
    assert c.flops_per_step(cfg, 0) == pytest.approx(F)
    step = c.measured_step_s(F)
    assert step == pytest.approx(F / (137e12 * 32))
    assert round(step, 2) == 3.53
    assert c.to_metric(step, F) == pytest.approx(137.0)
    assert c.to_metric(2 * step, F) == pytest.approx(68.5)           # twice as slow: half the TFLOP/s


def test_maxtext_conventions_by_hand():
    by = {c.case: c for c in load_cases()}
    c = by["maxtext-22b-v4"]                  # 2023-04: 6·N·tokens
    cfg, n = dict(c.set), 22_000_000_000
    assert c.flops_per_step(cfg, n) == pytest.approx(6 * n * 1024 * 1024)
    assert c.measured_step_s(c.flops_per_step(cfg, n)) == pytest.approx(6 * n * 1024 * 1024 / (156e12 * 64))
    c = by["maxtext-32b-v5e"]                 # 2023-10: 6·N·tokens + 12·H·L·dh·s²·B
    cfg = dict(c.set)
    want = 6 * n * 1024 * 2048 + 12 * 32 * 32 * 256 * 2048**2 * 1024
    assert c.flops_per_step(cfg, n) == pytest.approx(want)
    c = by["megatron-22b"]                    # the iteration time itself
    assert c.flops_per_step(dict(c.set), n) is None
    assert c.measured_step_s(None) == 1.42 and c.to_metric(1.5, None) == 1.5


def test_published_utilisation_matches_the_number_the_peak_and_our_model_flops():
    """The data file's MFU/HFU columns agree with its TFLOP/s and the spec's peak (catches a typo such as
    the README's first 16B row, 67.10 % for 61.10 %); where the source counts attention as PaLM does,
    our model FLOPs at the measured step give the published MFU."""
    checked = 0
    for c in load_cases():
        peak = load_spec(c.hardware).flops_bf16_per_s
        if c.metric == "tokens_per_s":
            # llm-foundry's MFU: tokens/s · (6·N + 12·L·d·s) over the chips' peak; N our parameter count
            sc = get_scenario(c.scenario)
            cfg = sc.config(None, c.overrides)
            per_token = 6 * sc.param_count(cfg) + 12 * cfg["layers"] * cfg["d_model"] * cfg["seq"]
            assert c.measured * per_token / (c.chips * peak) == pytest.approx(c.published_mfu, abs=0.005), c.case
            checked += 1
            continue
        for published in (c.published_mfu, c.published_hfu):
            if published is not None:
                assert c.measured * 1e12 / peak == pytest.approx(published, abs=0.005), c.case
        if c.convention == "maxtext_6n_attn":
            sc = get_scenario(c.scenario)
            cfg = sc.config(None, c.overrides)
            step = c.measured_step_s(c.flops_per_step(cfg, sc.param_count(cfg)))
            assert sc.model_flops(cfg) / c.chips / (step * peak) == pytest.approx(c.published_mfu, abs=0.005)
            checked += 1
    assert checked >= 2


# -- bad data -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace('metric = "step_s"', 'metric = "tflops"'), ["tiny-a", "'metric'"]),
    (lambda t: t.replace('convention = "iteration_time"', 'convention = "megatron_eq3"'), ["tiny-a", "convention"]),
    (lambda t: t.replace("chips = 2", "chips = 4"), ["tiny-a", "'chips'"]),
    (lambda t: t.replace("global_batch = 8", "global_batch = 16"), ["tiny-a", "global_batch"]),
    (lambda t: t.replace('group = "required"', 'group = "maybe"'), ["tiny-a", "'group'"]),
    (lambda t: t.replace("measured = 0.5", "measured = -1.0"), ["tiny-a", "'measured'"]),
    (lambda t: t.replace('source = "made up for the test: a"\n', ""), ["tiny-a", "'source'"]),
    (lambda t: t + "colour = 3\n", ["tiny-a", "unknown field 'colour'"]),
    (lambda t: t + t, ["tiny-a", "twice"]),
    (lambda t: t.replace("[[case]]", "[[case"), ["not valid TOML"]),
])
def test_bad_data_names_the_file_case_and_field(tmp_path, edit, words):
    path = tmp_path / "bad.toml"
    path.write_text(edit(TINY_CASE.format(n="a", group="required", measured=0.5, metric="step_s",
                                          convention="iteration_time")))
    with pytest.raises(FidelityDataError) as info:
        load_cases(path)
    assert isinstance(info.value, PartirError)
    for w in [str(path), *words]:
        assert w in str(info.value)


def test_unknown_case_and_missing_file(tmp_path, capsys):
    with pytest.raises(FidelityDataError, match="'nope'.*megatron-1.7b"):
        select(load_cases(), ["nope"])
    assert main(["fidelity", "--case", "nope"]) == 2
    assert "no such case" in capsys.readouterr().err
    assert main(["fidelity", "--data", str(tmp_path / "none.toml")]) == 2
    assert "none.toml" in capsys.readouterr().err


def test_a_key_the_scenario_lacks_fails_that_case_by_name(tmp_path, capsys):
    path = tiny_data(tmp_path, dict(n="a", group="required", measured=1e-4, metric="step_s",
                                    convention="iteration_time"))
    text = open(path).read().replace("remat = 0", "remat = 0, colour = 3")
    open(path, "w").write(text)
    assert main(["fidelity", "--data", path, "--group", "all"]) == 2
    out, err = capsys.readouterr()
    assert "tiny-a" in out and "FAILED" in out and "colour" in err


# -- the command ----------------------------------------------------------------------------------------
def test_report_and_plot(tmp_path, capsys):
    path = tiny_data(tmp_path,
                     dict(n="a", group="required", measured=1e-4, metric="step_s", convention="iteration_time"),
                     dict(n="b", group="extra", measured=0.001, metric="tflops_per_chip", convention="maxtext_6n"))
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    assert main(["fidelity", "--data", path, "--group", "all", "--report", str(report), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "tiny-a" in out and "tiny-b" in out and "median |error|" in out
    rep = json.loads(report.read_text())
    assert [c["case"] for c in rep["cases"]] == ["tiny-a", "tiny-b"]
    for c in rep["cases"]:
        for k in ("case", "source", "hardware", "measured", "predicted", "error_pct", "metric", "mfu", "hfu",
                  "measured_step_s", "predicted_step_s", "by_op_kind"):
            assert k in c, k
        assert c["error_pct"] == pytest.approx(100 * (c["predicted"] - c["measured"]) / c["measured"])
    a, b = rep["cases"]
    assert a["predicted"] == a["predicted_step_s"]                      # step_s: the step time itself
    peak = load_spec("tpu-v4").flops_bf16_per_s
    assert a["measured_mfu"] == pytest.approx(a["model_flops_per_device"] / (1e-4 * peak))
    assert a["mfu"] == pytest.approx(a["model_flops_per_device"] / (a["predicted_step_s"] * peak))
    assert b["predicted"] == pytest.approx(b["flops_per_step"] / (b["predicted_step_s"] * 2) / 1e12)
    # the summary is over the required group only
    assert rep["median_abs_error_pct"] == pytest.approx(abs(a["error_pct"]))
    assert rep["max_abs_error_pct"] == pytest.approx(abs(a["error_pct"]))
    assert rep["by_group"]["extra"]["n"] == 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_reports_mfu_and_hfu(tmp_path, capsys):
    report = tmp_path / "s.json"
    assert main(["simulate", "transformer", "--size", "tiny", "--mesh", "batch=2", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "HFU" in out
    rep = json.loads(report.read_text())
    sc = get_scenario("transformer")
    assert rep["model_flops_per_device"] == pytest.approx(sc.model_flops(rep["size"]) / 2)
    peak = load_spec("tpu-v4").flops_bf16_per_s
    # mfu: model FLOPs (no recompute, no elementwise) over step time and bf16 peak; hfu: the matmul FLOPs
    # the program executes (recomputation included)
    assert rep["mfu"] == pytest.approx(rep["model_flops_per_device"] / (rep["step_s"] * peak))
    assert rep["hfu"] == pytest.approx(rep["by_op_kind"]["matmul"]["flops"] / (rep["step_s"] * peak))
    # with remat the program executes more matmul FLOPs than the model counts
    assert main(["simulate", "transformer", "--size", "tiny", "--set", "remat=1", "--mesh", "batch=2",
                 "--report", str(report)]) == 0
    rep = json.loads(report.read_text())
    assert rep["hfu"] > 1.2 * rep["mfu"] > 0


# -- accuracy on the published runs ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def required_report():
    """The five required cases, lowered once for the session."""
    programs, analyzer = shared()
    return run_cases(select(load_cases(), list(REQUIRED)), programs=programs, analyzer=analyzer)


@pytest.mark.slow
def test_required_cases_all_run(required_report):
    assert not required_report.failures, required_report.failures
    assert [r.case.case for r in required_report.results] == list(REQUIRED)
    for r in required_report.results:
        assert r.sim.overlap and r.predicted_step_s > 0 and math.isfinite(r.error_pct)


@pytest.mark.slow
def test_required_cases_meet_the_accuracy_targets(required_report):
    print("\n" + required_report.table())
    errs = [abs(r.error_pct) for r in required_report.results]
    assert len(errs) == len(REQUIRED)
    assert statistics.median(errs) <= MEDIAN_TARGET_PCT, required_report.table()
    assert max(errs) <= MAX_TARGET_PCT, required_report.table()


# -- the fitted per-chip constants are reproducible -----------------------------------------------------
@pytest.mark.slow
def test_a_fitted_stack_fraction_is_refitted_without_the_held_out_runs():
    """``--holdout source`` predicts each source's runs of a fitted stack with the fraction fitted to
    the other source's runs only, and ``--holdout stack`` (no run of the stack left to fit on) with
    the unfitted model, 1.0. (That the profile holds the in-sample fit: the ``--fits`` test.) On the
    four cheapest pytorch-fsdp runs, two per source: each refit prices its runs a few times."""
    from partir_emu.app.validation.calibrate import fit_stack_fraction
    from partir_emu.app.validation.holdout import holdout
    from partir_emu.hwmodels.compute.stack import load_stack

    stack = load_stack("pytorch-fsdp")
    names = ("foundry-7b-h100", "foundry-7b-a100", "torchtitan-l2-13b-a100", "torchtitan-l3-8b-op-a100")
    cases = [c for c in load_cases() if c.case in names]
    sources = sorted({c.source_id for c in cases})
    assert len(cases) == 4 and len(sources) == 2 and {c.stack for c in cases} == {stack.name}
    programs, analyzer = shared()
    by_source = holdout(cases, "source", programs=programs, analyzer=analyzer)
    for src in sources:
        others = fit_stack_fraction([c for c in cases if c.source_id != src], stack, programs, analyzer)
        assert {r.stack_fraction for r in by_source.rows if r.group == src} == {others}
    by_stack = holdout(cases, "stack", programs=programs, analyzer=analyzer)
    assert {r.stack_fraction for r in by_stack.rows} == {1.0}
    # held out, the stack's runs are predicted too fast: the fraction is what they lose, not a free knob
    assert all(r.error_pct is not None and r.error_pct > 0 for r in by_stack.rows)


@pytest.mark.slow
def test_a_reported_out_of_memory_is_predicted():
    """torchtitan's performance.md (@ 1ea476e, footnote 1): Llama 2 70B on 64 A100 with selective
    (per-op) checkpointing ran at local batch 1 because local batch 2 ran out of memory. The model
    says the same: the published run fits, the same run at local batch 2 does not."""
    import dataclasses

    from partir_emu.app.validation.fidelity import run_case

    ran = next(c for c in load_cases() if c.case == "torchtitan-l2-70b-op-a100")
    assert dict(ran.set)["batch"] == ran.chips and "out of memory" in ran.source
    doubled = dataclasses.replace(ran, case="l2-70b-op-local-batch-2", global_batch=2 * ran.global_batch,
                                  set=tuple({**dict(ran.set), "batch": 2 * ran.global_batch}.items()))
    programs, analyzer = shared()
    assert run_case(ran, programs, analyzer).sim.fits
    assert not run_case(doubled, programs, analyzer).sim.fits


@pytest.mark.slow
def test_the_tightest_runs_that_ran_are_predicted_to_fit():
    """Every case is a run that ran, so each must be predicted to fit (issue 23). The two closest to
    their HBM: Megatron's 18.4B row, at the micro-batch of 8 the paper's own script gives
    (``examples/sc21/run_table_1.sh``: 4 micro-batches per replica, not 32 sequences at once), and
    llm-foundry's 7B on A100 without checkpointing, which fits only because a reshape is a view and
    the accumulated gradient is written in place (``memory.stack_liveness``); both in the table's
    memory line. The whole data file: ``partir-emu fidelity --group all``."""
    names = ["megatron-18.4b", "foundry-7b-a100"]
    programs, analyzer = shared()
    out = run_cases(select(load_cases(), names), programs=programs, analyzer=analyzer).table()
    assert "memory: 2 of 2 runs that ran are predicted to fit" in out, out


# -- out of sample by construction: --holdout and --fits ----------------------------------------------
def _two_sources(tmp_path, first_measured: float, second_measured: float | None = None) -> str:
    second_measured = first_measured if second_measured is None else second_measured
    text = tiny_data(tmp_path, dict(n="a", group="required", measured=first_measured, metric="step_s",
                                    convention="iteration_time"),
                     dict(n="b", group="extra", measured=second_measured, metric="step_s", convention="iteration_time"))
    body = open(text).read().split("[[case]]")
    body[1] = body[1].replace("stack = ", 'source_id = "table A"\nstack = ')
    body[2] = body[2].replace("stack = ", 'source_id = "table B"\nstack = ')
    open(text, "w").write("[[case]]".join(body))
    return text


def test_holdout_by_source_refits_without_the_held_out_table(tmp_path, capsys):
    """Two tables with the same run: fitted on one, the other is predicted exactly (held-out error 0);
    with the second run measured 2 % slower, the first is predicted 2 % slow and the second 1.96 % fast
    (step times: error = predicted/measured - 1), each fraction being the fit to the other alone."""
    from partir_emu.app.validation.calibrate import fit_fraction
    from partir_emu.app.validation.holdout import holdout
    from partir_emu.hwmodels.analytical import Analyzer

    # measured = what the spec's own fraction predicts, so the fits are inside the searched interval
    probe = run_cases(load_cases(_two_sources(tmp_path, 1e-4)))
    t = probe.results[0].predicted_step_s
    same = load_cases(_two_sources(tmp_path, t, t))
    rep = holdout(same, "source")
    assert [r.group for r in rep.rows] == ["table A", "table B"]
    assert [r.error_pct for r in rep.rows] == pytest.approx([0.0, 0.0], abs=0.05)
    slower = load_cases(_two_sources(tmp_path, t, 1.02 * t))
    rep = holdout(slower, "source")
    a, b = rep.rows
    analyzer, programs = Analyzer(), ProgramCache()
    assert a.fraction == pytest.approx(fit_fraction([slower[1]], analyzer.spec("tpu-v4"), programs, analyzer))
    assert a.error_pct == pytest.approx(2.0, abs=0.05) and b.error_pct == pytest.approx(100 * (1 / 1.02 - 1), abs=0.05)
    assert main(["fidelity", "--data", _two_sources(tmp_path, t, t), "--holdout", "chip"]) == 0
    out = capsys.readouterr().out
    assert out.count("no fit possible") == 2      # one fitted chip, held out: no case left to fit it on


def test_fits_lists_every_fitted_constant_with_its_cases():
    """``fidelity --fits`` (:func:`fitted_constants` + :func:`fits_table`, here on the shared caches):
    every fitted constant, refitted from the data file, equals the value its spec or stack profile
    holds, so each is a documented fit to published runs, not a free knob."""
    from partir_emu.app.validation.holdout import fits_table, fitted_constants

    programs, analyzer = shared()
    out = fits_table(fitted_constants(load_cases(), programs=programs, analyzer=analyzer))
    rows = {" ".join(ln.split()[:3 if ln.startswith("stack ") else 2]): ln
            for ln in out.splitlines() if "[efficiency]" in ln or "[dcn]" in ln}
    # the GPUs' constants are sourced, not fitted; the TPUs' matmul fractions, the DCN of the chips with
    # multi-slice runs and one stack's compute fraction are fits
    assert set(rows) == {"tpu-v4 [efficiency]", "tpu-v5e [efficiency]", "tpu-v5p [efficiency]",
                         "tpu-v4 [dcn]", "tpu-v5e [dcn]", "stack pytorch-fsdp [efficiency]"}
    assert "maxtext-22b-v4, maxtext-52b-v4" in rows["tpu-v4 [efficiency]"]
    assert "maxtext-32b-v5p" in rows["tpu-v5p [efficiency]"]
    assert "maxtext-22b-v4-x2" in rows["tpu-v4 [dcn]"] and "maxtext-22b-v4," not in rows["tpu-v4 [dcn]"]
    assert "maxtext-128b-v5e-x32" in rows["tpu-v5e [dcn]"]
    fsdp = rows["stack pytorch-fsdp [efficiency]"]
    assert "foundry-7b-h100" in fsdp and "torchtitan-l2-13b-a100" in fsdp
    for line in rows.values():
        spec, refit = (float(x) for x in line.split("]", 1)[1].split()[1:3])
        assert spec == pytest.approx(refit, abs=0.01), line    # the spec holds the value the data give


# -- the DCN of multi-slice runs: fitted on how the step grows from one slice --------------------------
SLICE_CASE = """
[[case]]
case = "{name}"
group = "extra"
source = "made up for the test: {name}, table {table}"
source_id = "table {table}"
hardware = "tpu-v5e"
chips = {chips}
strategy = "{strategy}"
mesh = {mesh}
slice = "{slice}"
global_batch = {batch}
set = {{ batch = {batch}, seq = 64, d_model = 64, heads = 4, d_ff = 256, layers = 2, vocab = 64, remat = 0 }}
measured = {measured}
metric = "step_s"
convention = "iteration_time"
stack = "xla"
{extra}
"""


def _slice_case(name: str, table: str, slices: int, measured: float, extra: str = "") -> str:
    multi = slices > 1
    return SLICE_CASE.format(name=name, table=table, chips=16 * slices, measured=measured, extra=extra,
                             strategy="bp+z3@batch" if multi else "z3", batch=16 * slices,
                             mesh=f"{{ dcn = {slices}, batch = 16 }}" if multi else "{ batch = 16 }",
                             slice=f"{slices}x4x4" if multi else "4x4")


def _slice_data(tmp_path, measured: dict[str, float]) -> str:
    """Tables A and B, each a run on one slice of 4x4 v5e chips and the same model on two slices."""
    path = tmp_path / "slices.toml"
    path.write_text("".join(_slice_case(f"{t}-{n}", t, n, measured[f"{t}-{n}"], "" if n == 1 else f'one_slice = "{t}-1"')
                            for t in "AB" for n in (1, 2)))
    return str(path)


def test_the_dcn_fraction_is_fitted_on_the_growth_from_one_slice_and_held_out_by_source(tmp_path):
    """Runs measured as the model predicts them with the DCN at 0.5 (table A) and 0.25 (table B) of its
    nominal figures: each table's fit gives its own fraction back, and ``--holdout source`` predicts each
    table's two-slice run with the other table's fraction (the single-slice runs, measured as predicted,
    anchor the growth and stay exact)."""
    from partir_emu.app.validation.dcn_fit import dcn_fit_pairs, fit_dcn_fraction, with_dcn_fraction
    from partir_emu.app.validation.fidelity import run_case
    from partir_emu.app.validation.holdout import holdout

    programs, analyzer = shared()
    probe = load_cases(_slice_data(tmp_path, dict.fromkeys(("A-1", "A-2", "B-1", "B-2"), 1.0)))
    spec = analyzer.spec("tpu-v5e")
    step = {f: run_case(probe[1], programs, analyzer, spec=with_dcn_fraction(spec, f)).predicted_step_s
            for f in (0.5, 0.25)}
    one = run_case(probe[0], programs, analyzer).predicted_step_s
    assert step[0.25] > step[0.5] > one               # a slower DCN, a longer step; both longer than one slice
    cases = load_cases(_slice_data(tmp_path, {"A-1": one, "A-2": step[0.5], "B-1": one, "B-2": step[0.25]}))
    for table, f in (("A", 0.5), ("B", 0.25)):
        pairs = [p for p in dcn_fit_pairs(cases, "tpu-v5e") if p[0].source_id == f"table {table}"]
        assert [(c.case, r.case) for c, r in pairs] == [(f"{table}-2", f"{table}-1")]
        assert fit_dcn_fraction(pairs, spec, programs, analyzer) == pytest.approx(f, rel=2e-3)
    rows = {r.case.case: r for r in holdout(cases, "source", programs=programs, analyzer=analyzer).rows}
    assert rows["A-2"].dcn_fraction == pytest.approx(0.25, rel=2e-3)
    assert rows["B-2"].dcn_fraction == pytest.approx(0.5, rel=2e-3)
    assert rows["A-1"].dcn_fraction is None and rows["A-1"].error_pct == pytest.approx(0.0, abs=0.05)
    assert rows["A-2"].error_pct == pytest.approx(100 * (step[0.25] / step[0.5] - 1), abs=0.1)
    assert rows["B-2"].error_pct == pytest.approx(100 * (step[0.5] / step[0.25] - 1), abs=0.1)
    by_chip = holdout(cases, "chip", programs=programs, analyzer=analyzer)     # one chip: nothing left to fit
    assert all(r.error_pct is None for r in by_chip.rows)


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace('one_slice = "A-1"', 'one_slice = "Z-1"'), ["A-2", "'Z-1'", "not a case"]),
    (lambda t: t.replace('one_slice = "A-1"', 'one_slice = "B-2"'), ["A-2", "'B-2'", "one slice"]),
    (lambda t: t.replace('hardware = "tpu-v5e"', 'hardware = "tpu-v4"', 1), ["A-2", "'A-1'", "same chip"]),
])
def test_a_bad_one_slice_is_named(tmp_path, edit, words):
    path = _slice_data(tmp_path, dict.fromkeys(("A-1", "A-2", "B-1", "B-2"), 1.0))
    text = edit(open(path).read())
    open(path, "w").write(text)
    with pytest.raises(FidelityDataError) as info:
        load_cases(path)
    for w in [path, *words]:
        assert w in str(info.value)


@pytest.mark.parametrize("root", [0.3, 0.655, 0.97])
@pytest.mark.parametrize("guess", [None, 0.5, 0.66])
def test_the_fit_finds_the_root_from_any_guess_and_clamps_at_the_ends(root, guess):
    """``zero_median`` on a step of which a share scales with 1/f (the median error of a fit): the root
    from the top of the interval or from a guess, in a few evaluations; an error that stays positive
    (too slow even at the peak) or negative (too fast at the floor) returns that end."""
    from partir_emu.app.validation.calibrate import HIGH, zero_median

    calls = []

    def err(f: float, share: float = 0.8) -> float:     # log(predicted / measured) of a step 80 % compute
        calls.append(f)
        return math.log((share / f + 1 - share) / (share / root + 1 - share))

    assert zero_median(err, guess=guess) == pytest.approx(root, abs=1e-4)
    assert len(calls) <= 6
    calls.clear()
    assert zero_median(lambda f: err(f) + 10.0, guess=guess) == HIGH
    assert zero_median(lambda f: err(f) - 10.0, low=0.05, guess=guess) == 0.05
