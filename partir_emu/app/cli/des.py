"""``partir-emu simulate-des``, ``partir-emu validate`` and ``partir-emu replay``.

:func:`add_subcommands` registers them on the ``partir-emu`` parser (:mod:`partir_emu.app.cli.main`).
Nothing here imports jax: lowering goes through ``Experiment.lower`` (abstract tracing,
no arrays), which imports the compiler only when called.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from partir_emu.app import checks
from partir_emu.app.atomic import atomic_path
from partir_emu.app.cli.faults import add_fault_args, add_link_fault_args, fault_kwargs, link_fault_kwargs
from partir_emu.app.cli.phases import Phases
from partir_emu.app.cli.simulate import (
    check_placement,
    choose_placement,
    parse_algorithms,
    parse_slice,
    placement_lines,
)
from partir_emu.app.common import add_experiment_args, add_overlap_args, experiment_from_args, write_report
from partir_emu.app.validation.cases import Case, get_suite, read_cases, run_suite
from partir_emu.core.mesh import Mesh
from partir_emu.core.msgtrace import read_message_trace
from partir_emu.hwmodels.analytical import Analyzer, simulate
from partir_emu.hwmodels.des.model import DesOptions, simulate_des
from partir_emu.hwmodels.machine.slices import chips_limit
from partir_emu.hwmodels.machine.specs import load_spec
from partir_emu.hwmodels.validation.replay import replay

CHUNK_BYTES = 1 << 20     # --network chunk without --chunk-bytes
TRACE_DEVICES = 8         # --trace without --trace-devices


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate-des", help="simulate one step with the discrete-event model (links, contention)")
    add_experiment_args(p)
    _hardware_args(p)
    add_overlap_args(p)
    p.add_argument("--algorithm", default=None, metavar="ALG | KIND=ALG,...",
                   help="collective algorithm(s), as for `simulate` (default: as the runtime would choose)")
    p.add_argument("--network", choices=("flow", "chunk"), default="flow",
                   help="flow: max-min fair flows (default); chunk: store-and-forward chunks")
    p.add_argument("--chunk-bytes", type=checks.positive_int, default=None,
                   help=f"chunk size for --network chunk (default {CHUNK_BYTES:,})")
    add_fault_args(p, links=False)          # --comm-streams, --straggler (the link faults: _hardware_args)
    p.add_argument("--message-overhead", type=checks.nonnegative_seconds, default=0.0, metavar="SECONDS",
                   help="a sender posts the messages of a step one after another, this long each")
    p.add_argument("--merge-window", type=checks.nonnegative_seconds, default=50e-6, metavar="SECONDS",
                   help="devices finishing a collective this close together resume together (0 = exact)")
    p.add_argument("--no-symmetry", action="store_true", help="simulate every device as its own process")
    p.add_argument("--trace", default=None, metavar="FILE.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--trace-devices", type=checks.positive_int, default=None,
                   help=f"with --trace: devices in the trace (default {TRACE_DEVICES})")
    p.add_argument("--progress", action="store_true", help="show a progress bar even when stderr is not a tty")
    p.add_argument("--top", type=checks.positive_int, default=10,
                   help="links and collectives to list (default %(default)s)")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.set_defaults(fn=cmd_simulate_des)

    p = sub.add_parser("validate", help="analytical model vs DES on a suite of cases: errors, rankings, plot")
    p.add_argument("--suite", default=None, help="suite name (default, closed-form, quick; default: default)")
    p.add_argument("--cases", default=None, metavar="FILE.jsonl",
                   help="run these cases instead (one JSON object per line: scenario, strategy, hardware, mesh, "
                        "preset, overrides, placement, overlap, hw_overrides, slice_dims, comm_streams, "
                        "stragglers, degraded_links, failed_links, mechanism)")
    p.add_argument("--report", default=None, metavar="FILE.json", help="write the JSON report here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write the predicted-vs-simulated scatter")
    p.add_argument("--cache", default=None, metavar="DIR", help="keep lowered programs here between runs")
    p.add_argument("--progress", action="store_true", help="print each case as it finishes (always on a tty)")
    p.add_argument("--no-check", action="store_true", help="exit 0 even if the thresholds are not met")
    p.add_argument("--quiet", action="store_true", help="no per-case progress lines, even on a terminal")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("replay", help="replay an MPI message trace on a hardware model and check it")
    p.add_argument("trace", help="message trace (JSON lines) from `run --backend mpi --trace-messages`")
    _hardware_args(p)
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.set_defaults(fn=cmd_replay)


def _hardware_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default="tpu-v4", help="spec name or .toml path (default %(default)s)")
    p.add_argument("--placement", default=None, metavar="AXIS=DIMS,...", help="e.g. model=x,batch=yz")
    p.add_argument("--slice", dest="slice_dims", default=None, metavar="AxBxC",
                   help="TPU slice shape; one dim more in front: that many slices joined by DCN (2x16x16)")
    add_link_fault_args(p)


def _check_paths(args: argparse.Namespace, *flags: str) -> None:
    for flag in flags:
        check = checks.check_plot_path if flag == "--plot" else checks.check_output_path
        check(getattr(args, flag.lstrip("-").replace("-", "_")), flag)


def _options(args: argparse.Namespace, **kw: Any) -> DesOptions:
    return DesOptions(**link_fault_kwargs(args), **kw)


# -- simulate-des -----------------------------------------------------------------------------------------
def cmd_simulate_des(args: argparse.Namespace) -> int:
    _check_paths(args, "--report", "--trace")
    checks.only_with(args.chunk_bytes, "--chunk-bytes", args.network == "chunk", "with --network chunk")
    checks.only_with(args.prefetch_bytes, "--prefetch-bytes", args.overlap, "with --overlap (the default)",
                     "without overlap every gather blocks where it is used")
    checks.only_with(args.trace_devices, "--trace-devices", args.trace is not None, "with --trace FILE.json")
    checks.only_with(args.progress or None, "--progress", not args.quiet, "without --quiet")
    spec = load_spec(args.hardware)
    algorithms = parse_algorithms(args.algorithm)
    faults = fault_kwargs(args)          # the same faults and streams for both models
    options = _options(args, network=args.network, chunk_bytes=args.chunk_bytes or CHUNK_BYTES, comm_streams=faults["comm_streams"],
                       stragglers=faults["stragglers"],
                       message_overhead_s=args.message_overhead, merge_window_s=args.merge_window,
                       symmetry=not args.no_symmetry, trace=args.trace is not None,
                       trace_devices=args.trace_devices or TRACE_DEVICES, top_links=args.top,
                       progress=True if args.progress else (False if args.quiet else None))
    exp = experiment_from_args(args)
    checks.check_mesh_size(exp.mesh, checks.MAX_SIMULATE_DEVICES, "simulate-des")
    slice_dims = parse_slice(args.slice_dims)
    checks.check_fits_hardware(exp.mesh, chips_limit(spec, slice_dims), spec.name)
    analyzer = Analyzer()                # this command's session, shared by the search, the model and the DES
    check_placement(exp.mesh, spec, args.placement, slice_dims, analyzer)      # None (the default) = auto: searched
    with Phases("simulate-des", quiet=args.quiet) as phases:    # the DES then shows its own progress bar
        phases.phase("lowering")
        t0 = time.perf_counter()
        spmd = exp.lower().spmd
        lower_s = time.perf_counter() - t0
        phases.phase("placing")
        placed = choose_placement(spmd, spec, args.placement, analyzer, overlap=args.overlap, slice_dims=slice_dims,
                                  algorithms=algorithms, prefetch_bytes=args.prefetch_bytes, **faults)
    placement = placed.placement                                    # the DES runs on the same placement
    ana = simulate(spmd, spec, placement, overlap=args.overlap, algorithms=algorithms,
                   prefetch_bytes=args.prefetch_bytes, analyzer=analyzer, **faults)
    des = _des_with_trace(spmd, spec, placement, args, algorithms, options, analyzer)
    err = (ana.step_s - des.step_s) / des.step_s if des.step_s > 0 else 0.0
    rep = {"scenario": exp.scenario_name, "strategy": exp.strategy, "size": exp.cfg, "mesh": dict(exp.mesh.axes),
           "devices": exp.mesh.size, "hardware": spec.name, "lower_s": lower_s,
           "analytical_s": ana.step_s, "des_s": des.step_s, "rel_err": abs(err), "signed_err": err}
    rep.update(des.to_json(link_utilization=True))
    rep.update(placed.to_json(ana.step_s))
    write_report(rep, args.report)
    print(f"{rep['scenario']} / {rep['strategy']} on {rep['devices']} devices {rep['mesh']}")
    print("\n".join(placement_lines(rep)))
    print(des.table(top=args.top))
    print(f"\nanalytical: {ana.step_s * 1e3:.4f} ms   DES: {des.step_s * 1e3:.4f} ms   "
          f"(analytical - DES) / DES = {100 * err:+.2f}%")
    for path in (args.trace, args.report):
        if path:
            print(f"wrote {path}")
    return 0


def _des_with_trace(spmd: Any, spec: Any, placement: Any, args: argparse.Namespace, algorithms: Any,
                    options: DesOptions, analyzer: Analyzer) -> Any:
    """simulate_des, its Perfetto trace (if asked for) written atomically."""
    if not args.trace:
        return simulate_des(spmd, spec, placement, args.overlap, algorithms=algorithms, options=options,
                            prefetch_bytes=args.prefetch_bytes, analyzer=analyzer)
    with atomic_path(args.trace) as tmp:
        return simulate_des(spmd, spec, placement, args.overlap, algorithms=algorithms, options=options,
                            trace_path=tmp, prefetch_bytes=args.prefetch_bytes, analyzer=analyzer)


# -- validate -------------------------------------------------------------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    _check_paths(args, "--report", "--plot")
    checks.check_cache_dir(args.cache, "--cache")
    cases: Sequence[Case]
    checks.only_with(args.suite, "--suite", args.cases is None, "without --cases", "--cases names the cases to run")
    checks.only_with(args.progress or None, "--progress", not args.quiet, "without --quiet")
    if args.cases is not None:
        checks.check_input_file(args.cases, "--cases")
        cases = read_cases(args.cases)
        name = args.cases
    else:
        name = args.suite or "default"
        cases = get_suite(name)
    show = args.progress or (sys.stderr.isatty() and not args.quiet)

    def on_case(i: int, n: int, r) -> None:
        if show:
            print(f"[{i + 1}/{n}] {r.case.model} {r.case.label} on {r.case.hardware}: analytical "
                  f"{r.analytical_s * 1e3:.3f} ms, DES {r.des_s * 1e3:.3f} ms ({100 * r.signed_err:+.2f}%, "
                  f"{r.des_wall_s:.1f} s)", file=sys.stderr, flush=True)

    rep = run_suite(cases, cache_dir=args.cache, on_case=on_case)
    rep = type(rep)(name, rep.results, rep.wall_s, rep.lower_s)
    print(rep.table())
    write_report(rep.to_json(), args.report)
    if args.plot:
        with atomic_path(args.plot) as tmp:
            rep.plot(tmp)
    for path in (args.report, args.plot):
        if path:
            print(f"wrote {path}")
    return 0 if (rep.passed() or args.no_check) else 1


# -- replay ---------------------------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    _check_paths(args, "--report")
    checks.check_input_file(args.trace, "trace")
    head, rows = read_message_trace(args.trace)
    mesh, spec = Mesh.from_json(head["mesh"]), load_spec(args.hardware)
    checks.check_mesh_size(mesh, checks.MAX_SIMULATE_DEVICES, "replay", what=f"the mesh of {args.trace}")
    checks.check_fits_hardware(mesh, chips_limit(spec, parse_slice(args.slice_dims)), spec.name,
                               what=f"the mesh of {args.trace}")
    rep = replay(head, rows, spec, args.placement, parse_slice(args.slice_dims), _options(args))
    print(rep.table())
    write_report(rep.to_json(), args.report)
    if args.report:
        print(f"wrote {args.report}")
    return 0 if rep.check.ok else 1
